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

  const ChunkWorkspace ws = bind_chunk_workspace(plan, workspace, stream);
  const int64_t N = plan.num_seqs;

  ChunkTokens x{};
  x.q = static_cast<const __nv_bfloat16*>(in.q);
  x.k = static_cast<const __nv_bfloat16*>(in.k);
  x.v = static_cast<const __nv_bfloat16*>(in.v);
  x.g = static_cast<const __nv_bfloat16*>(in.g);
  x.beta = static_cast<const __nv_bfloat16*>(in.beta);
  x.o = static_cast<__nv_bfloat16*>(o);
  x.h0 = in.h0;
  x.ht = ht;
  x.H = int(s.H);
  x.HV = int(s.HV);
  x.scale = float(s.effective_scale());
  // Kernel-lab knob: KDA_CHUNK_STAGES=prepare|state runs one stage alone (for timing only;
  // the output is then incomplete). Unset in normal use.
  const char* stages = std::getenv("KDA_CHUNK_STAGES");
  const bool only_prepare = stages && std::strcmp(stages, "prepare") == 0;
  const bool only_state = stages && std::strcmp(stages, "state") == 0;
  if (!only_state) launch_chunk_prepare(x, ws, s.gate, int(s.K), int(s.V), stream);
  if (!only_prepare) launch_chunk_state(x, ws, N, int(s.K), int(s.V), stream);
}

}  // namespace kda::ops::cuda
