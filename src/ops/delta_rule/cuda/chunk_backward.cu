// Host side of the chunked backward: plans the workspace (forward arrays, then X, A, S0, dS, D,
// dD and the grouped-head partials) and queues
//   chunk_prepare + chunk_state (forward again, writing X, A, S0, D; no o, no ht) unless
//   chunk_forward_for_backward (the same two kernels, with o and ht) left them in the workspace,
//   chunk_state_bwd (dS, dD, dh0), chunk_bwd_local (dq, dk, dv, dg, dbeta; with a KDA layer's
//   gate also its blocks' terms of dA_log, ddt_bias, which kda_gate_grads sums),
//   and, for grouped value heads or the layer's l2norm, finish_qk_grads (dq / dk per q / k head).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"
#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/chunk_plan.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda {

using namespace kda::ops::cuda_detail;

size_t chunk_backward_workspace_bytes(const DeltaRuleShape& shape,
                                      std::span<const int64_t> cu_seqlens) {
  shape.validate();
  return make_chunk_plan(shape, cu_seqlens, true).total_bytes;
}

namespace {

struct BackwardSetup {
  ChunkPlan plan;
  KdaLayerParams layer;
};

// What chunk_backward and chunk_forward_for_backward require of their arguments (`who` starts
// the messages), and the backward's plan of the workspace.
BackwardSetup backward_setup(const DeltaRuleDeviceInputs& in, const void* workspace,
                             size_t workspace_bytes, const std::string& who) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  require(in.dtype == ElementType::bf16, who + ": bf16 inputs only");
  BackwardSetup b{{}, kda_layer_params(in, who.c_str())};
  require(s.K == s.V && (s.K == 64 || s.K == 128),
          who + ": supports K = V in {64, 128}, got K=" + std::to_string(s.K) +
              " V=" + std::to_string(s.V));
  require(in.q && in.k && in.v && in.beta, who + ": q, k, v and beta must be non-null");
  require(s.gate == Gate::none || in.g, who + ": g must be non-null for gated rules");
  require(s.HV <= 65535, who + ": HV too large");
  b.plan = make_chunk_plan(s, in.cu_seqlens, true);
  require(b.plan.num_seqs <= 65535, who + ": at most 65535 sequences per call");
  require(workspace && workspace_bytes >= b.plan.total_bytes,
          who + ": workspace too small (" + std::to_string(workspace_bytes) + " < " +
              std::to_string(b.plan.total_bytes) + " bytes)");
  return b;
}

}  // namespace

void chunk_forward_for_backward(const DeltaRuleDeviceInputs& in, void* o, float* ht,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const BackwardSetup b =
      backward_setup(in, workspace, workspace_bytes, "delta rule (cuda forward for backward)");
  require(o != nullptr, "delta rule (cuda forward for backward): o must be non-null");
  // the backward's recompute exactly, plus o and ht: not pipelined, Qt / Kd kept for every gate
  const ChunkWorkspace ws = bind_chunk_workspace(b.plan, workspace, stream);
  const ChunkTokens x = chunk_tokens(in, b.layer, o, ht);
  const int K = int(in.shape.K), V = int(in.shape.V);
  launch_chunk_prepare(x, ws, in.shape.gate, K, V, stream);
  launch_chunk_state(x, ws, b.plan.num_seqs, K, V, stream);
}

void chunk_backward(const DeltaRuleDeviceInputs& in, const void* d_o, const float* d_ht,
                    const DeltaRuleDeviceGrads& grads, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream, ChunkBackwardFrom from) {
  const DeltaRuleShape& s = in.shape;
  const BackwardSetup b =
      backward_setup(in, workspace, workspace_bytes, "delta rule (cuda backward)");
  const ChunkPlan& plan = b.plan;
  const KdaLayerParams& layer = b.layer;
  require(d_o != nullptr, "delta rule (cuda backward): d_o must be non-null");
  require(grads.dq && grads.dk && grads.dv && grads.dbeta,
          "delta rule (cuda backward): dq, dk, dv and dbeta must be non-null");
  require(s.gate == Gate::none || grads.dg,
          "delta rule (cuda backward): dg must be non-null for gated rules");

  // (chunk_forward_for_backward left the same plan's tables in the workspace)
  const ChunkWorkspace ws =
      bind_chunk_workspace(plan, workspace, stream, from == ChunkBackwardFrom::recompute);
  char* base = static_cast<char*>(workspace);

  // the recompute writes neither o nor ht; it and chunk_bwd_local activate as the forward did
  const ChunkTokens x = chunk_tokens(in, layer, nullptr, nullptr);

  ChunkGrads gd{};
  gd.dO = static_cast<const __nv_bfloat16*>(d_o);
  gd.dht = d_ht;
  gd.dh0 = grads.dh0;
  gd.dS = reinterpret_cast<__nv_bfloat16*>(base + plan.off_ds);
  gd.dD = reinterpret_cast<__nv_bfloat16*>(base + plan.off_dd);
  gd.dq = static_cast<__nv_bfloat16*>(grads.dq);
  gd.dk = static_cast<__nv_bfloat16*>(grads.dk);
  gd.dq_part = plan.off_dq ? reinterpret_cast<float*>(base + plan.off_dq) : nullptr;
  gd.dk_part = plan.off_dk ? reinterpret_cast<float*>(base + plan.off_dk) : nullptr;
  gd.dv = static_cast<__nv_bfloat16*>(grads.dv);
  gd.dg = static_cast<__nv_bfloat16*>(grads.dg);
  gd.dbeta = static_cast<__nv_bfloat16*>(grads.dbeta);
  gd.dA_log = layer.gate ? grads.dA_log : nullptr;
  gd.ddt_bias = layer.gate ? grads.ddt_bias : nullptr;
  if (gd.dA_log || gd.ddt_bias) gd.gate_part = reinterpret_cast<float*>(base + plan.off_gate_part);

  const int K = int(s.K), V = int(s.V);
  // Kernel-lab knob: KDA_BWD_STAGES=recompute|state|local runs one stage alone (for timing only;
  // the gradients are then incomplete). Unset in normal use.
  const char* only = std::getenv("KDA_BWD_STAGES");
  auto run = [&](const char* stage) { return !only || std::strcmp(only, stage) == 0; };
  if (from == ChunkBackwardFrom::recompute && run("recompute")) {
    launch_chunk_prepare(x, ws, s.gate, K, V, stream);
    launch_chunk_state(x, ws, plan.num_seqs, K, V, stream);
  }
  if (run("state")) launch_chunk_state_bwd(x, ws, gd, plan.num_seqs, K, V, stream);
  if (run("local")) {
    launch_chunk_bwd_local(x, ws, gd, s.gate, K, V, stream);
    launch_kda_gate_grads(gd, plan.num_chunks, int(s.HV), K, stream);
    launch_finish_qk_grads(x, gd, plan.tokens, K, stream);
  }
}

}  // namespace kda::ops::cuda
