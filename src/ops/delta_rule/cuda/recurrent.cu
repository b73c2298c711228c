// The delta-rule recurrence token by token on the GPU: the fused decode step (one token per
// sequence, states updated in place in a slot pool) and the fp32 prefill path (many tokens).
//
// One block of 128 threads owns a K x 32 column tile of one (sequence, value head) state in
// registers: thread (warp w, lane l) holds rows [R*kg, R*kg + R) with kg = 4w + l / 8 and
// R = K / 16, and columns 4 * (l % 8) .. + 3 of the tile. Columns of the state evolve
// independently, so tiles never talk to each other. Per token one reduction over K gives
// k^T P, q^T P and q.k together (P = decayed state), from which the write and the output follow:
//   d = beta (v - P^T k),   S = P + k d^T,   o = scale (P^T q + (q.k) d).
//
// The decode step (DECODE = true) caps registers at 64 so that 8 blocks share an SM (2048
// tiles of a 16-sequence, 32-head step in 1.94 waves instead of 2.2), and may be launched with
// programmatic dependent launch (DecodeArgs::overlap_launch): the block waits for the previous
// kernel on the stream (griddepcontrol.wait) before its first memory access and lets the next
// one be scheduled as soon as every block has started, which hides the launch gap between
// back-to-back steps.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/common/sequences.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace kda::ops::cuda_detail;

constexpr int kTile = 32;  // state columns per block
constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;

struct RecurrentParams {
  const void *q, *k, *v, *g, *beta;
  void* o;
  const float* h_in;       // states read at start (null: zeros)
  float* h_out;            // states written at end (null: not written)
  const int32_t* slots;    // decode: state index per sequence (in and out); null: sequence index
  const int64_t* seq_bos;  // [N] first token, or null for fixed length
  const int64_t* seq_len;  // [N]
  int64_t fixed_len;       // tokens per sequence when seq_bos is null
  int H, HV, V;
  float scale;
};

// R consecutive values of one thread's rows (R = K / 16: 8, 4, or 2 for K = 32).
template <int R, class T>
__device__ __forceinline__ void load_rows(const T* p, float out[R]) {
  if constexpr (R == 8) {
    load8(p, out);
  } else if constexpr (R == 4) {
    load4(p, out);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = to_f32(p[r]);
  }
}

template <class Tin, Gate GATE, int K, bool DECODE>
__global__ void __launch_bounds__(kThreads, DECODE ? 8 : 1)
    recurrent_kernel(const RecurrentParams p) {
  constexpr int R = K / 16;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (DECODE) {  // no-ops unless launched with programmatic stream serialization
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
#endif
  const int tiles = p.V / kTile;
  const int vt = blockIdx.x % tiles;
  const int hv = blockIdx.x / tiles;
  const int64_t n = blockIdx.y;
  const int h = hv / (p.HV / p.H);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kg = warp * 4 + (lane >> 3);
  const int row0 = kg * R;
  const int col = vt * kTile + (lane & 7) * 4;

  const int64_t bos = p.seq_bos ? p.seq_bos[n] : n * p.fixed_len;
  const int64_t len = p.seq_bos ? p.seq_len[n] : p.fixed_len;
  const int64_t state_index = p.slots ? int64_t(p.slots[n]) : n;
  const size_t state_off = (size_t(state_index) * p.HV + hv) * size_t(K) * p.V;

  float s[R][4];
  if (p.h_in) {
    const float* src = p.h_in + state_off + size_t(row0) * p.V + col;
#pragma unroll
    for (int r = 0; r < R; ++r) load4(src + size_t(r) * p.V, s[r]);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = s[r][2] = s[r][3] = 0.f;
  }

  const Tin* q = static_cast<const Tin*>(p.q);
  const Tin* k = static_cast<const Tin*>(p.k);
  const Tin* v = static_cast<const Tin*>(p.v);
  const Tin* g = static_cast<const Tin*>(p.g);
  const Tin* beta = static_cast<const Tin*>(p.beta);
  Tin* o = static_cast<Tin*>(p.o);

  __shared__ float partial[2][4][8][9];  // [parity][warp][column group][kP x4, qP x4, q.k]

  for (int64_t t = 0; t < len; ++t) {
    const int64_t tok = bos + t;
    float kr[R], qr[R], vr[4];
    const size_t qk_off = (size_t(tok) * p.H + h) * K + row0;
    load_rows<R>(k + qk_off, kr);
    load_rows<R>(q + qk_off, qr);
    load4(v + (size_t(tok) * p.HV + hv) * p.V + col, vr);
    const float b = to_f32(beta[size_t(tok) * p.HV + hv]);
    if constexpr (GATE == Gate::channel) {
      float gr[R];
      const size_t g_off = (size_t(tok) * p.HV + hv) * K + row0;
      load_rows<R>(g + g_off, gr);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float decay = fast_exp2(gr[r] * kLog2e);
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] *= decay;
      }
    } else if constexpr (GATE == Gate::scalar) {
      const float decay = fast_exp2(to_f32(g[size_t(tok) * p.HV + hv]) * kLog2e);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] *= decay;
    }
    float acc[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) acc[i] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[c] += kr[r] * s[r][c];
        acc[4 + c] += qr[r] * s[r][c];
      }
      acc[8] += qr[r] * kr[r];
    }
    // Sum over the four row groups of the warp (lanes l, l^8, l^16, l^24), then over warps.
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 8);
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 16);
    }
    const int parity = int(t & 1);
    if (lane < 8) {
#pragma unroll
      for (int i = 0; i < 9; ++i) partial[parity][warp][lane][i] = acc[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 9; ++i)
      acc[i] = partial[parity][0][lane & 7][i] + partial[parity][1][lane & 7][i] +
               partial[parity][2][lane & 7][i] + partial[parity][3][lane & 7][i];
    float d[4], out[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      d[c] = b * (vr[c] - acc[c]);
      out[c] = p.scale * (acc[4 + c] + acc[8] * d[c]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[r][c] += kr[r] * d[c];
    if (kg == 0) store4(o + (size_t(tok) * p.HV + hv) * p.V + col, out);
  }

  if (p.h_out) {
    float* dst = p.h_out + state_off + size_t(row0) * p.V + col;
#pragma unroll
    for (int r = 0; r < R; ++r) store4(dst + size_t(r) * p.V, s[r]);
  }
}

template <class Tin, Gate GATE, int K, bool DECODE>
void launch_kernel(dim3 grid, const RecurrentParams& p, bool overlap, cudaStream_t stream) {
  if (!overlap) {
    recurrent_kernel<Tin, GATE, K, DECODE><<<grid, kThreads, 0, stream>>>(p);
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, recurrent_kernel<Tin, GATE, K, DECODE>, p),
             "delta rule decode launch");
}

template <class Tin, Gate GATE, bool DECODE>
void launch_for_k(int K, dim3 grid, const RecurrentParams& p, bool overlap, cudaStream_t stream) {
  if (K == 128)
    launch_kernel<Tin, GATE, 128, DECODE>(grid, p, overlap, stream);
  else if (K == 64)
    launch_kernel<Tin, GATE, 64, DECODE>(grid, p, overlap, stream);
  else
    launch_kernel<Tin, GATE, 32, DECODE>(grid, p, overlap, stream);
}

template <class Tin, bool DECODE>
void launch_for_gate(Gate gate, int K, dim3 grid, const RecurrentParams& p, bool overlap,
                     cudaStream_t stream) {
  switch (gate) {
    case Gate::channel:
      launch_for_k<Tin, Gate::channel, DECODE>(K, grid, p, overlap, stream);
      break;
    case Gate::scalar:
      launch_for_k<Tin, Gate::scalar, DECODE>(K, grid, p, overlap, stream);
      break;
    case Gate::none:
      launch_for_k<Tin, Gate::none, DECODE>(K, grid, p, overlap, stream);
      break;
  }
}

// decode: the DECODE instantiation (64 registers), optionally with the overlapped launch
void launch_recurrent(const DeltaRuleShape& s, ElementType dtype, int64_t num_seqs,
                      const RecurrentParams& p, cudaStream_t stream, bool decode = false,
                      bool overlap = false) {
  require(s.K == 32 || s.K == 64 || s.K == 128,
          "delta rule (cuda recurrent): K must be 32, 64 or 128, got " + std::to_string(s.K));
  require(s.V % kTile == 0 && s.V >= kTile,
          "delta rule (cuda recurrent): V must be a multiple of 32, got " + std::to_string(s.V));
  require(num_seqs <= 65535, "delta rule (cuda recurrent): at most 65535 sequences per call");
  const dim3 grid(unsigned(s.HV * (s.V / kTile)), unsigned(num_seqs));
  if (decode) {
    if (dtype == ElementType::bf16)
      launch_for_gate<__nv_bfloat16, true>(s.gate, int(s.K), grid, p, overlap, stream);
    else
      launch_for_gate<float, true>(s.gate, int(s.K), grid, p, overlap, stream);
  } else {
    if (dtype == ElementType::bf16)
      launch_for_gate<__nv_bfloat16, false>(s.gate, int(s.K), grid, p, false, stream);
    else
      launch_for_gate<float, false>(s.gate, int(s.K), grid, p, false, stream);
  }
  check_launch("delta rule recurrent kernel");
}

void require_tokens(const DeltaRuleShape& s, const void* q, const void* k, const void* v,
                    const void* g, const void* beta, const void* o) {
  require(q && k && v && beta && o, "delta rule (cuda): q, k, v, beta and o must be non-null");
  require(s.gate == Gate::none || g, "delta rule (cuda): the gate g is null");
}

}  // namespace

size_t recurrent_forward_workspace_bytes(std::span<const int64_t> cu_seqlens) {
  return cu_seqlens.empty() ? 0 : 2 * sizeof(int64_t) * (cu_seqlens.size() - 1);
}

void recurrent_forward(const DeltaRuleDeviceInputs& in, void* o, float* ht, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  require_tokens(s, in.q, in.k, in.v, in.g, in.beta, o);
  require(!in.kda_layer.any(),
          "delta rule (cuda recurrent): KDA layer options need the bf16 chunked path");
  const SequenceLayout seqs(s.B, s.T, in.cu_seqlens);
  RecurrentParams p{
      in.q,    in.k,    in.v,    in.g, in.beta,  o,         in.h0,    ht,
      nullptr, nullptr, nullptr, s.T,  int(s.H), int(s.HV), int(s.V), float(s.effective_scale())};
  const int64_t N = seqs.num_sequences();
  if (!in.cu_seqlens.empty()) {
    const size_t need = recurrent_forward_workspace_bytes(in.cu_seqlens);
    require(workspace && workspace_bytes >= need,
            "delta rule (cuda recurrent): workspace too small (" + std::to_string(workspace_bytes) +
                " < " + std::to_string(need) + " bytes)");
    std::vector<int64_t> table(2 * N);
    for (int64_t i = 0; i < N; ++i) table[i] = seqs.start(i), table[N + i] = seqs.length(i);
    check_cuda(cudaMemcpyAsync(workspace, table.data(), need, cudaMemcpyHostToDevice, stream),
               "copy of the sequence table");
    p.seq_bos = static_cast<const int64_t*>(workspace);
    p.seq_len = p.seq_bos + N;
  }
  launch_recurrent(s, in.dtype, N, p, stream);
}

void decode_step(const DecodeArgs& a, cudaStream_t stream) {
  DeltaRuleShape s = a.shape;
  s.T = 1;
  s.validate();
  require_tokens(s, a.q, a.k, a.v, a.g, a.beta, a.o);
  require(a.state_pool && a.slots, "delta rule decode (cuda): state_pool and slots are required");
  require(a.num_slots >= 1, "delta rule decode (cuda): num_slots must be positive");
  const RecurrentParams p{a.q,      a.k,       a.v,          a.g,
                          a.beta,   a.o,       a.state_pool, a.state_pool,
                          a.slots,  nullptr,   nullptr,      1,
                          int(s.H), int(s.HV), int(s.V),     float(s.effective_scale())};
  bool overlap = a.overlap_launch;
  // Kernel-lab knob: KDA_DECODE_OVERLAP=0|1 overrides DecodeArgs::overlap_launch (timing only).
  if (const char* knob = std::getenv("KDA_DECODE_OVERLAP")) overlap = knob[0] == '1';
  launch_recurrent(s, a.dtype, s.B, p, stream, true, overlap);
}

}  // namespace kda::ops::cuda
