// The NoPE MLA mixer that both GPU trainers run (LineageCudaModel's `M` layers, KimiCudaModel's
// MLA layers): train/kimi_mla_train.cpp's expanded form,
//   q = x q_proj^T [R, H, nope + rope]  (or, with a query rank, q = RMSNorm(x q_a^T) q_b^T,
//   eps 1e-6: Kimi's q_lora_rank);  [c | k_rope] = x kv_a^T;  c <- RMSNorm(c) (eps 1e-6)
//   [k_nope_h | v_h] = c kv_b_h^T;  k_h = [k_nope_h | k_rope] (k_rope shared by every head)
//   o = causal softmax attention per sequence or document (scale (nope + rope)^-0.5), bf16
// and its backward; the output projection is the caller's (o_c [R, H v]). Templates over the
// trainer's per-layer and activation structs, which name their buffers alike.
#pragma once
#include <cstdint>
#include <vector>

#include "model/kimi_linear_config.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "train/cuda/training_helpers.h"

namespace kda::train::cuda::mla_train {

using namespace training_helpers;

struct Shape {
  int64_t H, nope, rope, v, latent, qk, row;
  int64_t q_rank;  // 0: one q_proj; else the query's low rank (q_a, its norm, q_b)
  Shape(int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t latent_dim,
        int64_t q_rank_dim = 0)
      : H(heads),
        nope(nope_dim),
        rope(rope_dim),
        v(v_dim),
        latent(latent_dim),
        qk(nope_dim + rope_dim),
        row(latent_dim + rope_dim),
        q_rank(q_rank_dim) {}
};

// q: q_proj, or q_b_proj when the shape has a query rank (then q_a, q_a_norm are set too).
struct Weights {
  const Entry *q = nullptr, *kv_a = nullptr, *kv_a_norm = nullptr, *kv_b = nullptr;
  const Entry *q_a = nullptr, *q_a_norm = nullptr;
};

// What a call needs of its trainer: engines, stream, sizes, the batch's layout and workspace.
struct Context {
  k::Gemm& gemm;
  model::cuda::WeightGradGemm& wgrad;
  k::TrainScratch& scratch;
  cudaStream_t s;
  int64_t R, d, B, T;
  const std::vector<int64_t>& cu_seqlens;
  void* workspace;
  size_t workspace_bytes;
};

template <class PerLayer>
k::AttentionArgs attention_args(const PerLayer& P, const Shape& m, int64_t r0, int64_t len,
                                int64_t batch) {
  k::AttentionArgs args;
  args.dtype = kBf16;
  args.Tq = args.Tk = len;
  args.Hq = args.Hkv = m.H;
  args.Dk = m.qk;
  args.Dv = m.v;
  args.q = offset(P.q_c, r0 * m.H * m.qk, 2);
  args.k = offset(P.k_c, r0 * m.H * m.qk, 2);
  args.v = offset(P.v_c, r0 * m.H * m.v, 2);
  args.o_bf16 = offset(P.o_c, r0 * m.H * m.v, 2);  // the output projection's input
  args.lse = offset<float>(P.lse, r0 * m.H, 4);
  args.batch = batch;
  return args;
}

// Reads P.a_c (the normed input); leaves the output projection's input in P.o_c. With a query
// rank it also keeps the query's rows (P.q_lat32), their inverse RMS and normed rows (P.q_latn_c).
template <class PerLayer, class Activations>
void forward(const Context& x, const Weights& W, const Shape& m, PerLayer& P, Activations& a) {
  const int64_t R = x.R, d = x.d, H = m.H;
  const cudaStream_t s = x.s;
  if (m.q_rank > 0) {
    x.gemm.linear(kBf16, R, m.q_rank, d, {P.a_c.data(), d}, {W.q_a->compute(), d},
                  {P.q_lat32.data(), kF32});
    k::rms_norm_forward_train(P.q_lat32.template as<float>(), R, m.q_rank, W.q_a_norm->f(),
                              model::kKimiLatentNormEps, {P.q_latn_c.data(), kBf16},
                              P.inv_q_lat.template as<float>(), s);
    x.gemm.linear(kBf16, R, H * m.qk, m.q_rank, {P.q_latn_c.data(), m.q_rank},
                  {W.q->compute(), m.q_rank}, {P.q_c.data(), kBf16});
  } else {
    x.gemm.linear(kBf16, R, H * m.qk, d, {P.a_c.data(), d}, {W.q->compute(), d},
                  {P.q_c.data(), kBf16});
  }
  x.gemm.linear(kBf16, R, m.row, d, {P.a_c.data(), d}, {W.kv_a->compute(), d},
                {P.rows32.data(), kF32});
  k::copy_rows(P.rows32.template as<float>(), R, m.latent, m.row, {P.lat32.data(), kF32}, s);
  k::rms_norm_forward_train(P.lat32.template as<float>(), R, m.latent, W.kv_a_norm->f(),
                            model::kKimiLatentNormEps, {P.latn_c.data(), kBf16},
                            P.inv_lat.template as<float>(), s);
  // kv_b's output [R, H, nope + v] (fp32, in the dkvb32 scratch: only the forward needs it)
  float* kvb = a.dkvb32.template as<float>();
  x.gemm.linear(kBf16, R, H * (m.nope + m.v), m.latent, {P.latn_c.data(), m.latent},
                {W.kv_b->compute(), m.latent}, {kvb, kF32});
  // keys [R, H, qk] = [k_nope_h | k_rope], values [R, H, v], in bf16
  k::copy_rows(kvb, R * H, m.nope, m.nope + m.v, {P.k_c.data(), kBf16, m.qk}, s);
  for (int64_t h = 0; h < H && m.rope > 0; ++h)
    k::copy_rows(P.rows32.template as<float>() + m.latent, R, m.rope, m.row,
                 {offset(P.k_c, h * m.qk + m.nope, 2), kBf16, H * m.qk}, s);
  k::copy_rows(kvb + m.nope, R * H, m.v, m.nope + m.v, {P.v_c.data(), kBf16}, s);
  for_each_attention(x.B, x.T, x.cu_seqlens, [&](int64_t r0, int64_t len, int64_t batch) {
    k::attention_forward(attention_args(P, m, r0, len, batch), x.workspace, x.workspace_bytes, s);
  });
}

// Reads the output projection's input gradient in a.do_c; writes the normed input's gradient
// to a.dan. dv_c: a bf16 [R, H v] scratch for the attention's value gradient; a.dq_lat32 (fp32
// [R, q_rank]) the query rows' gradient when the shape has a query rank.
template <class PerLayer, class Activations>
void backward(const Context& x, const Weights& W, const Shape& m, PerLayer& P, Activations& a,
              void* dv_c) {
  const int64_t R = x.R, d = x.d, H = m.H;
  const cudaStream_t s = x.s;
  float* dan = a.dan.template as<float>();
  // attention (d_o: a.do_c [R, H v] from the output projection)
  for_each_attention(x.B, x.T, x.cu_seqlens, [&](int64_t r0, int64_t len, int64_t batch) {
    const k::AttentionArgs args = attention_args(P, m, r0, len, batch);
    k::attention_backward(args, args.lse, offset(a.do_c, r0 * H * m.v, 2),
                          offset(a.dqm_c, r0 * H * m.qk, 2), offset(a.dkm_c, r0 * H * m.qk, 2),
                          static_cast<char*>(dv_c) + size_t(r0 * H * m.v) * 2, x.workspace,
                          x.workspace_bytes, s);
  });
  // q_proj (or q_b, the query's norm and q_a): dq is already bf16
  if (m.q_rank > 0) {
    // q_b into the normed rows' gradient, the norm back to the q_a rows' (in place, and in
    // bf16 into dy_c: what q_a's backward reads)
    float* dqa = a.dq_lat32.template as<float>();
    linear_backward(x.gemm, x.wgrad, R, m.q_rank, H * m.qk, a.dqm_c.data(), H * m.qk,
                    P.q_latn_c.data(), m.q_rank, *W.q, {dqa, kF32}, false);
    k::rms_norm_backward(P.q_lat32.template as<float>(), dqa, R, m.q_rank, W.q_a_norm->f(),
                         P.inv_q_lat.template as<float>(), dqa, W.q_a_norm->g(), x.scratch, s,
                         /*accumulate_dx=*/false, a.dy_c.data());
    linear_backward(x.gemm, x.wgrad, R, d, m.q_rank, a.dy_c.data(), m.q_rank, P.a_c.data(), d,
                    *W.q_a, {dan, kF32}, false);
  } else {
    linear_backward(x.gemm, x.wgrad, R, d, H * m.qk, a.dqm_c.data(), H * m.qk, P.a_c.data(), d,
                    *W.q, {dan, kF32}, false);
  }
  // back through the per-head split: kv_b's output gradient and the shared rope key's (the sum
  // over heads, as a product with the 0/1 matrix rope_sum [H qk, rope])
  float* dkeys = a.dkeys32.template as<float>();
  float* dvalues = a.dvalues32.template as<float>();
  float* dkvb = a.dkvb32.template as<float>();
  float* drows = a.drows32.template as<float>();
  k::convert(a.dkm_c.data(), kBf16, dkeys, kF32, R * H * m.qk, s);
  k::convert(dv_c, kBf16, dvalues, kF32, R * H * m.v, s);
  k::copy_rows(dkeys, R * H, m.nope, m.qk, {dkvb, kF32, m.nope + m.v}, s);
  k::copy_rows(dvalues, R * H, m.v, m.v, {dkvb + m.nope, kF32, m.nope + m.v}, s);
  if (m.rope > 0)
    x.gemm.matmul(kF32, R, m.rope, H * m.qk, {dkeys, H * m.qk}, {a.rope_sum.data(), m.rope},
                  {drows + m.latent, kF32, m.row});
  // kv_b, then the latent's RMSNorm into the first `latent` columns of the rows' gradient
  k::convert(dkvb, kF32, a.dy_c.data(), kBf16, R * H * (m.nope + m.v), s);
  float* dlat = a.dlat32.template as<float>();
  linear_backward(x.gemm, x.wgrad, R, m.latent, H * (m.nope + m.v), a.dy_c.data(),
                  H * (m.nope + m.v), P.latn_c.data(), m.latent, *W.kv_b, {dlat, kF32}, false);
  k::rms_norm_backward(P.lat32.template as<float>(), dlat, R, m.latent, W.kv_a_norm->f(),
                       P.inv_lat.template as<float>(), dlat, W.kv_a_norm->g(), x.scratch, s);
  k::copy_rows(dlat, R, m.latent, m.latent, {drows, kF32, m.row}, s);
  // kv_a
  k::convert(drows, kF32, a.dy_c.data(), kBf16, R * m.row, s);
  linear_backward(x.gemm, x.wgrad, R, d, m.row, a.dy_c.data(), m.row, P.a_c.data(), d, *W.kv_a,
                  {dan, kF32}, true);
}

}  // namespace kda::train::cuda::mla_train
