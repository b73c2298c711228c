// Host side of the chunked forward: validates, lays out the workspace (sequence and chunk
// tables, then the per-chunk arrays), and queues chunk_prepare then chunk_state.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/common/sequences.h"
#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace kda::ops::cuda_detail;

size_t align_up(size_t x) {
  return (x + 255) & ~size_t(255);
}

struct Plan {
  std::vector<int64_t> tables;  // chunk_tok0, chunk_len, seq_chunk0, seq_nchunks, seq_bos, seq_len
  int64_t num_seqs = 0, num_chunks = 0;
  size_t table_bytes = 0, total_bytes = 0;
  size_t off_w = 0, off_q = 0, off_kd = 0, off_u = 0, off_m = 0, off_gc = 0;
};

Plan make_plan(const DeltaRuleShape& s, std::span<const int64_t> cu_seqlens) {
  const SequenceLayout seqs(s.B, s.T, cu_seqlens);
  Plan p;
  p.num_seqs = seqs.num_sequences();
  std::vector<int64_t> tok0, len, seq_chunk0, seq_nchunks, bos, slen;
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t L = seqs.length(n), nc = (L + kChunk - 1) / kChunk;
    seq_chunk0.push_back(int64_t(tok0.size()));
    seq_nchunks.push_back(nc);
    bos.push_back(seqs.start(n));
    slen.push_back(L);
    for (int64_t c = 0; c < nc; ++c) {
      tok0.push_back(seqs.start(n) + c * kChunk);
      len.push_back(std::min<int64_t>(kChunk, L - c * kChunk));
    }
  }
  p.num_chunks = int64_t(tok0.size());
  for (auto* v : {&tok0, &len, &seq_chunk0, &seq_nchunks, &bos, &slen})
    p.tables.insert(p.tables.end(), v->begin(), v->end());
  p.table_bytes = p.tables.size() * sizeof(int64_t);
  const size_t rows = size_t(p.num_chunks) * size_t(s.HV) * kChunk;
  size_t off = align_up(p.table_bytes);
  p.off_w = off, off = align_up(off + rows * s.K * 2);
  p.off_q = off, off = align_up(off + rows * s.K * 2);
  p.off_kd = off, off = align_up(off + rows * s.K * 2);
  p.off_u = off, off = align_up(off + rows * s.V * 2);
  p.off_m = off, off = align_up(off + rows * kChunk * 2);
  p.off_gc = off, off = align_up(off + size_t(p.num_chunks) * s.HV * s.K * 4);
  p.total_bytes = off;
  return p;
}

// Copies host tables through one pinned buffer so the copy is truly asynchronous (a pageable
// source would make cudaMemcpyAsync wait for the stream). The buffer is reused once the
// previous copy has run.
class PinnedStaging {
 public:
  void copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) check_cuda(cudaEventSynchronize(done_), "staging event wait");
    if (bytes > capacity_) {
      if (buffer_) check_cuda(cudaFreeHost(buffer_), "cudaFreeHost");
      buffer_ = nullptr;
      check_cuda(cudaMallocHost(&buffer_, bytes), "cudaMallocHost (table staging)");
      capacity_ = bytes;
    }
    if (!done_) check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "event");
    std::memcpy(buffer_, src, bytes);
    check_cuda(cudaMemcpyAsync(dst, buffer_, bytes, cudaMemcpyHostToDevice, stream),
               "copy of the chunk tables");
    check_cuda(cudaEventRecord(done_, stream), "staging event record");
  }

 private:
  std::mutex mutex_;
  void* buffer_ = nullptr;
  size_t capacity_ = 0;
  cudaEvent_t done_ = nullptr;
};

PinnedStaging& staging() {
  static PinnedStaging* s = new PinnedStaging();  // never destroyed: outlives CUDA teardown
  return *s;
}

}  // namespace

size_t chunk_forward_workspace_bytes(const DeltaRuleShape& shape,
                                     std::span<const int64_t> cu_seqlens) {
  shape.validate();
  return make_plan(shape, cu_seqlens).total_bytes;
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
  const Plan plan = make_plan(s, in.cu_seqlens);
  require(plan.num_seqs <= 65535, "delta rule (cuda chunk): at most 65535 sequences per call");
  require(workspace && workspace_bytes >= plan.total_bytes,
          "delta rule (cuda chunk): workspace too small (" + std::to_string(workspace_bytes) +
              " < " + std::to_string(plan.total_bytes) + " bytes)");

  staging().copy(workspace, plan.tables.data(), plan.table_bytes, stream);
  char* base = static_cast<char*>(workspace);
  const int64_t* t = static_cast<const int64_t*>(workspace);
  const int64_t NC = plan.num_chunks, N = plan.num_seqs;
  ChunkWorkspace ws{};
  ws.chunk_tok0 = t;
  ws.chunk_len = t + NC;
  ws.seq_chunk0 = t + 2 * NC;
  ws.seq_nchunks = t + 2 * NC + N;
  ws.seq_bos = t + 2 * NC + 2 * N;
  ws.seq_len = t + 2 * NC + 3 * N;
  ws.W = reinterpret_cast<__nv_bfloat16*>(base + plan.off_w);
  ws.Qt = reinterpret_cast<__nv_bfloat16*>(base + plan.off_q);
  ws.Kd = reinterpret_cast<__nv_bfloat16*>(base + plan.off_kd);
  ws.U = reinterpret_cast<__nv_bfloat16*>(base + plan.off_u);
  ws.M = reinterpret_cast<__nv_bfloat16*>(base + plan.off_m);
  ws.gC = reinterpret_cast<float*>(base + plan.off_gc);
  ws.num_chunks = NC;

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
