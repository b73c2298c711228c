// Host side shared by the chunked forward and backward: the chunk plan (sequence and chunk
// tables, workspace layout) and the pinned staging of the tables.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops::cuda_detail {

struct ChunkPlan {
  std::vector<int64_t> tables;  // chunk_tok0, chunk_len, seq_chunk0, seq_nchunks, seq_bos, seq_len
  int64_t num_seqs = 0, num_chunks = 0, tokens = 0;
  size_t table_bytes = 0, total_bytes = 0;
  size_t off_w = 0, off_q = 0, off_kd = 0, off_u = 0, off_m = 0, off_gc = 0;
  size_t off_wide = 0;       // Gate::channel: the wide-decay count, list and flags (ChunkWorkspace)
  int64_t wide_entries = 0;  // num_chunks * HV: the list's and the flags' length
  // backward only (zero when planned for the forward)
  size_t off_x = 0, off_a = 0, off_s0 = 0, off_d = 0, off_ds = 0, off_dd = 0, off_dq = 0,
         off_dk = 0;
  size_t off_gate_part = 0;  // Gate::channel: ChunkGrads::gate_part
};

// `backward` adds the arrays the backward needs after the forward's.
ChunkPlan make_chunk_plan(const DeltaRuleShape& s, std::span<const int64_t> cu_seqlens,
                          bool backward);

// Copies the plan's tables to the start of `workspace` (asynchronously, through a pinned buffer,
// unless `upload_tables` is false: a workspace that already holds them) and returns the forward
// workspace view; the backward arrays are set when planned.
ChunkWorkspace bind_chunk_workspace(const ChunkPlan& plan, void* workspace, cudaStream_t stream,
                                    bool upload_tables = true);

// A KDA layer's options as the kernels take them (`on` false when none is set), after checking
// what chunk_forward and chunk_backward require of them (bf16, Gate::channel, lower_bound in
// [-5, 0)); `who` starts the error messages.
KdaLayerParams kda_layer_params(const cuda::DeltaRuleDeviceInputs& in, const char* who);

// The kernels' view of the bf16 inputs (o, ht: the forward's outputs, null where not wanted).
ChunkTokens chunk_tokens(const cuda::DeltaRuleDeviceInputs& in, const KdaLayerParams& layer,
                         void* o, float* ht);

}  // namespace kda::ops::cuda_detail
