#include "ops/delta_rule/cuda/chunk_plan.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>

#include "ops/common/sequences.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {
namespace {

size_t align_up(size_t x) {
  return (x + 255) & ~size_t(255);
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

ChunkPlan make_chunk_plan(const DeltaRuleShape& s, std::span<const int64_t> cu_seqlens,
                          bool backward) {
  const SequenceLayout seqs(s.B, s.T, cu_seqlens);
  ChunkPlan p;
  p.num_seqs = seqs.num_sequences();
  p.tokens = s.B * s.T;
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
  if (s.gate == Gate::channel) {
    require(uint64_t(p.num_chunks) * uint64_t(s.HV) < (uint64_t(1) << 32),
            "delta rule (cuda chunk): too many chunks x value heads");
    p.wide_entries = p.num_chunks * s.HV;
    p.off_wide = off, off = align_up(off + 4 + size_t(p.wide_entries) * 5);  // count, list, flags
  }
  if (backward) {
    const size_t states = size_t(p.num_chunks) * size_t(s.HV) * s.K * s.V;
    p.off_x = off, off = align_up(off + rows * kChunk * 2);
    p.off_a = off, off = align_up(off + rows * kChunk * 2);
    p.off_s0 = off, off = align_up(off + states * 2);
    p.off_ds = off, off = align_up(off + states * 2);
    p.off_d = off, off = align_up(off + rows * s.V * 2);
    p.off_dd = off, off = align_up(off + rows * s.V * 2);
    if (s.HV != s.H) {
      const size_t part = size_t(p.tokens) * size_t(s.HV) * s.K * 4;
      p.off_dq = off, off = align_up(off + part);
      p.off_dk = off, off = align_up(off + part);
    }
    if (s.gate == Gate::channel) {
      p.off_gate_part = off;
      off = align_up(off + size_t(p.num_chunks) * s.HV * kGatePartFloats * sizeof(float));
    }
  }
  p.total_bytes = off;
  return p;
}

ChunkWorkspace bind_chunk_workspace(const ChunkPlan& plan, void* workspace, cudaStream_t stream,
                                    bool upload_tables) {
  // (the staging buffer's copy waits on the host for the previous one: skipping it where the
  // tables are already there keeps the host queueing ahead)
  if (upload_tables) staging().copy(workspace, plan.tables.data(), plan.table_bytes, stream);
  char* base = static_cast<char*>(workspace);
  const int64_t* t = static_cast<const int64_t*>(workspace);
  const int64_t NC = plan.num_chunks, N = plan.num_seqs;
  auto bf = [&](size_t off) {
    return off ? reinterpret_cast<__nv_bfloat16*>(base + off) : nullptr;
  };
  ChunkWorkspace ws{};
  ws.chunk_tok0 = t;
  ws.chunk_len = t + NC;
  ws.seq_chunk0 = t + 2 * NC;
  ws.seq_nchunks = t + 2 * NC + N;
  ws.seq_bos = t + 2 * NC + 2 * N;
  ws.seq_len = t + 2 * NC + 3 * N;
  ws.W = bf(plan.off_w);
  ws.Qt = bf(plan.off_q);
  ws.Kd = bf(plan.off_kd);
  ws.U = bf(plan.off_u);
  ws.M = bf(plan.off_m);
  ws.gC = reinterpret_cast<float*>(base + plan.off_gc);
  if (plan.off_wide) {
    ws.wide_count = reinterpret_cast<unsigned*>(base + plan.off_wide);
    ws.wide_list = ws.wide_count + 1;
    ws.wide_flag = reinterpret_cast<unsigned char*>(ws.wide_list + plan.wide_entries);
  }
  ws.num_chunks = NC;
  ws.X = bf(plan.off_x);
  ws.A = bf(plan.off_a);
  ws.S0 = bf(plan.off_s0);
  ws.D = bf(plan.off_d);
  return ws;
}

KdaLayerParams kda_layer_params(const cuda::DeltaRuleDeviceInputs& in, const char* who) {
  const cuda::KdaLayerDeviceOptions& lo = in.kda_layer;
  KdaLayerParams p;
  if (!lo.any()) return p;
  require(in.dtype == cuda::ElementType::bf16 && in.shape.gate == Gate::channel,
          std::string(who) + ": KDA layer options need bf16 inputs and Gate::channel");
  require(!lo.gate_in_kernel || lo.gate == KdaGate::softplus ||
              (lo.lower_bound >= -5.f && lo.lower_bound < 0.f),
          std::string(who) + ": lower_bound must be in [-5, 0)");
  p.on = true;
  p.l2norm_qk = lo.l2norm_qk;
  p.gate = lo.gate_in_kernel;
  p.gate_softplus = lo.gate == KdaGate::softplus;
  p.beta_sigmoid = lo.beta_sigmoid;
  p.lower_bound = lo.lower_bound;
  p.A_log = lo.A_log;
  p.dt_bias = lo.dt_bias;
  return p;
}

ChunkTokens chunk_tokens(const cuda::DeltaRuleDeviceInputs& in, const KdaLayerParams& layer,
                         void* o, float* ht) {
  ChunkTokens x{};
  x.q = static_cast<const __nv_bfloat16*>(in.q);
  x.k = static_cast<const __nv_bfloat16*>(in.k);
  x.v = static_cast<const __nv_bfloat16*>(in.v);
  x.g = static_cast<const __nv_bfloat16*>(in.g);
  x.beta = static_cast<const __nv_bfloat16*>(in.beta);
  x.o = static_cast<__nv_bfloat16*>(o);
  x.h0 = in.h0;
  x.ht = ht;
  x.H = int(in.shape.H);
  x.HV = int(in.shape.HV);
  x.scale = float(in.shape.effective_scale());
  x.layer = layer;
  return x;
}

}  // namespace kda::ops::cuda_detail
