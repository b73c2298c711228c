// Host side of the chunked forward: validates, lays out the workspace (chunk_plan.h), and
// queues chunk_prepare then chunk_state.
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

size_t chunk_forward_workspace_bytes(const DeltaRuleShape& shape,
                                     std::span<const int64_t> cu_seqlens) {
  shape.validate();
  return make_chunk_plan(shape, cu_seqlens, false).total_bytes;
}

void chunk_forward(const DeltaRuleDeviceInputs& in, void* o, float* ht, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  const KdaLayerParams layer = kda_layer_params(in, "delta rule (cuda chunk)");
  if (in.dtype == ElementType::f32) {
    require(workspace_bytes >= recurrent_forward_workspace_bytes(in.cu_seqlens),
            "delta rule (cuda chunk): workspace too small");
    return recurrent_forward(in, o, ht, workspace, workspace_bytes, stream);
  }
  require((s.K == 64 || s.K == 128) && (s.V == 64 || s.V == 128),
          "delta rule (cuda chunk): bf16 path supports K, V in {64, 128}, got K=" +
              std::to_string(s.K) + " V=" + std::to_string(s.V));
  require(in.q && in.k && in.v && in.beta && o,
          "delta rule (cuda chunk): q, k, v, beta and o must be non-null");
  require(s.gate == Gate::none || in.g, "delta rule (cuda chunk): the gate g is null");
  require(s.HV <= 65535, "delta rule (cuda chunk): HV too large");
  const ChunkPlan plan = make_chunk_plan(s, in.cu_seqlens, false);
  require(plan.num_seqs <= 65535, "delta rule (cuda chunk): at most 65535 sequences per call");
  require(workspace && workspace_bytes >= plan.total_bytes,
          "delta rule (cuda chunk): workspace too small (" + std::to_string(workspace_bytes) +
              " < " + std::to_string(plan.total_bytes) + " bytes)");

  const int64_t N = plan.num_seqs;
  ChunkWorkspace ws = bind_chunk_workspace(plan, workspace, stream);
  // Gated DeltaNet: chunk_state reads q, k and applies the scalar decays itself, where that
  // measured faster: with two-tile state blocks (prepare -10%, state about even); with
  // one-tile blocks (one long sequence) the state walk lost more (2.57 against 2.21 ms at
  // 1 x 65536) than prepare gained (0.15 ms)
  // (the wgmma walk takes the raw path on every grid: not yet measured without it)
  // (the split walk, chunk_state_split.cu, reads plain operands: raw measured slower there)
  ws.raw_qk = s.gate == Gate::scalar && (chunk_state_uses_wgmma(N, int(s.HV), int(s.K), int(s.V)) ||
                                         (chunk_state_wide(N, int(s.HV), int(s.V)) &&
                                          !chunk_state_split_wide(N, int(s.HV), int(s.V))));
  // Kernel-lab knob: KDA_GDN_RAW=0 keeps Qt / Kd in the workspace for Gated DeltaNet too.
  if (const char* raw = std::getenv("KDA_GDN_RAW")) ws.raw_qk = ws.raw_qk && raw[0] != '0';
  // On the wgmma walk the raw path also forms M there (prepare skips it). Kernel-lab knob:
  // KDA_GDN_STATE_M=0 keeps M in the workspace.
  const char* state_m = std::getenv("KDA_GDN_STATE_M");
  ws.m_in_state = ws.raw_qk && chunk_state_uses_wgmma(N, int(s.HV), int(s.K), int(s.V)) &&
                  !(state_m && state_m[0] == '0');
  // Gated DeltaNet on the split walk: its output warps read the q rows and scale P themselves
  // (chunk_state_split.cu's QROWS), so chunk_prepare does not write Qt. Measured (session 23,
  // H200): 2 x 8192 0.684 -> 0.652 ms, 1 x 65536 3.246 -> 3.061 ms, 8 x 2048 (wgmma walk) even.
  if (s.gate == Gate::scalar && !ws.raw_qk &&
      !chunk_state_uses_wgmma(N, int(s.HV), int(s.K), int(s.V)) && chunk_state_split_on()) {
    const bool wide = chunk_state_wide(N, int(s.HV), int(s.V));
    ws.qt_in_state = !wide || chunk_state_split_wide(N, int(s.HV), int(s.V));
  }

  const ChunkTokens x = chunk_tokens(in, layer, o, ht);
  // Kernel-lab knob: KDA_CHUNK_STAGES=prepare|state runs one stage alone (for timing only;
  // the output is then incomplete). Unset in normal use.
  const char* stages = std::getenv("KDA_CHUNK_STAGES");
  const bool only_prepare = stages && std::strcmp(stages, "prepare") == 0;
  const bool only_state = stages && std::strcmp(stages, "state") == 0;
  const int K = int(s.K), V = int(s.V);
  if (!only_state) launch_chunk_prepare(x, ws, s.gate, K, V, stream);
  if (!only_prepare) launch_chunk_state(x, ws, N, K, V, stream);
}

}  // namespace kda::ops::cuda
