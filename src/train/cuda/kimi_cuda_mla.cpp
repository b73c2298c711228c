// Kimi's NoPE MLA mixer on the GPU, train/kimi_mla_train.cpp's expanded form:
//   q = x q_proj^T [R, H, nope + rope];  [c | k_rope] = x kv_a^T;  c <- RMSNorm(c) (eps 1e-6)
//   [k_nope_h | v_h] = c kv_b_h^T;  k_h = [k_nope_h | k_rope] (k_rope shared by every head)
//   o = causal softmax attention per document (scale (nope + rope)^-0.5), bf16 q / k / v
// and its backward; the output projection is the caller's (o_c [R, H v]). The lineage model's
// MLA (train/cuda/lineage_cuda_mla.cpp) with Kimi's config sizes.
#include "core/error.h"
#include "model/kimi_linear_config.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "train/cuda/kimi_cuda_internal.h"

namespace kda::train::cuda {

using namespace kimi_detail;

namespace {

struct MlaSizes {
  int64_t H, nope, rope, v, latent, qk, row;
  explicit MlaSizes(const model::KimiLinearConfig& c)
      : H(c.mla_heads),
        nope(c.qk_nope_head_dim),
        rope(c.qk_rope_head_dim),
        v(c.v_head_dim),
        latent(c.kv_lora_rank),
        qk(nope + rope),
        row(latent + rope) {}
};

k::AttentionArgs mla_attention_args(const KimiCudaModel::PerLayer& P, const MlaSizes& m, int64_t r0,
                                    int64_t len, int64_t batch) {
  k::AttentionArgs args;
  args.dtype = kBf16;
  args.Tq = args.Tk = len;
  args.Hq = args.Hkv = m.H;
  args.Dk = m.qk;
  args.Dv = m.v;
  args.q = offset(P.q_c, r0 * m.H * m.qk, 2);
  args.k = offset(P.k_c, r0 * m.H * m.qk, 2);
  args.v = offset(P.v_c, r0 * m.H * m.v, 2);
  args.o = offset<float>(P.o32, r0 * m.H * m.v, 4);
  args.lse = offset<float>(P.lse, r0 * m.H, 4);
  args.batch = batch;
  return args;
}

}  // namespace

void KimiCudaModel::mla_forward(Layer& L, PerLayer& P, int64_t B, int64_t T) {
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, D = c_.hidden_size;
  const MlaSizes m(c_);
  const int64_t H = m.H;
  gemm.linear(kBf16, R, H * m.qk, D, {P.a_c.data(), D}, {L.q->compute(), D}, {P.q_c.data(), kBf16});
  gemm.linear(kBf16, R, m.row, D, {P.a_c.data(), D}, {L.kv_a->compute(), D},
              {P.rows32.data(), kF32});
  k::copy_rows(P.rows32.as<float>(), R, m.latent, m.row, {P.lat32.data(), kF32}, s);
  k::rms_norm_forward_train(P.lat32.as<float>(), R, m.latent, L.kv_a_norm->f(),
                            model::kKimiLatentNormEps, {P.latn_c.data(), kBf16},
                            P.inv_lat.as<float>(), s);
  // kv_b's output [R, H, nope + v] (fp32, in the dkvb32 scratch: only the forward needs it)
  float* kvb = a.dkvb32.as<float>();
  gemm.linear(kBf16, R, H * (m.nope + m.v), m.latent, {P.latn_c.data(), m.latent},
              {L.kv_b->compute(), m.latent}, {kvb, kF32});
  // keys [R, H, qk] = [k_nope_h | k_rope], values [R, H, v], in bf16
  k::copy_rows(kvb, R * H, m.nope, m.nope + m.v, {P.k_c.data(), kBf16, m.qk}, s);
  for (int64_t h = 0; h < H && m.rope > 0; ++h)
    k::copy_rows(P.rows32.as<float>() + m.latent, R, m.rope, m.row,
                 {offset(P.k_c, h * m.qk + m.nope, 2), kBf16, H * m.qk}, s);
  k::copy_rows(kvb + m.nope, R * H, m.v, m.nope + m.v, {P.v_c.data(), kBf16}, s);
  for_each_attention(B, T, cu_seqlens_, [&](int64_t r0, int64_t len, int64_t batch) {
    k::attention_forward(mla_attention_args(P, m, r0, len, batch), a.workspace.data(),
                         a.workspace.bytes(), s);
  });
  k::convert(P.o32.data(), kF32, P.o_c.data(), kBf16, R * H * m.v, s);
}

void KimiCudaModel::mla_backward(Layer& L, PerLayer& P, int64_t B, int64_t T) {
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  auto& wgrad = engines_->wgrad;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, D = c_.hidden_size;
  const MlaSizes m(c_);
  const int64_t H = m.H;
  float* dan = a.dan.as<float>();
  // attention (d_o: a.do_c [R, H v] from the output projection)
  for_each_attention(B, T, cu_seqlens_, [&](int64_t r0, int64_t len, int64_t batch) {
    const k::AttentionArgs args = mla_attention_args(P, m, r0, len, batch);
    k::attention_backward(args, args.lse, offset(a.do_c, r0 * H * m.v, 2),
                          offset(a.dqm_c, r0 * H * m.qk, 2), offset(a.dkm_c, r0 * H * m.qk, 2),
                          offset(a.dvm_c, r0 * H * m.v, 2), a.workspace.data(), a.workspace.bytes(),
                          s);
  });
  // q_proj: dq is already bf16
  linear_backward(gemm, wgrad, R, D, H * m.qk, a.dqm_c.data(), H * m.qk, P.a_c.data(), D, *L.q,
                  {dan, kF32}, false);
  // back through the per-head split: kv_b's output gradient and the shared rope key's (the sum
  // over heads, as a product with the 0/1 matrix rope_sum [H qk, rope])
  float* dkeys = a.dkeys32.as<float>();
  float* dvalues = a.dvalues32.as<float>();
  float* dkvb = a.dkvb32.as<float>();
  float* drows = a.drows32.as<float>();
  k::convert(a.dkm_c.data(), kBf16, dkeys, kF32, R * H * m.qk, s);
  k::convert(a.dvm_c.data(), kBf16, dvalues, kF32, R * H * m.v, s);
  k::copy_rows(dkeys, R * H, m.nope, m.qk, {dkvb, kF32, m.nope + m.v}, s);
  k::copy_rows(dvalues, R * H, m.v, m.v, {dkvb + m.nope, kF32, m.nope + m.v}, s);
  if (m.rope > 0)
    gemm.matmul(kF32, R, m.rope, H * m.qk, {dkeys, H * m.qk}, {a.rope_sum.data(), m.rope},
                {drows + m.latent, kF32, m.row});
  // kv_b, then the latent's RMSNorm into the first `latent` columns of the rows' gradient
  k::convert(dkvb, kF32, a.dy_c.data(), kBf16, R * H * (m.nope + m.v), s);
  float* dlat = a.dlat32.as<float>();
  linear_backward(gemm, wgrad, R, m.latent, H * (m.nope + m.v), a.dy_c.data(), H * (m.nope + m.v),
                  P.latn_c.data(), m.latent, *L.kv_b, {dlat, kF32}, false);
  k::rms_norm_backward(P.lat32.as<float>(), dlat, R, m.latent, L.kv_a_norm->f(),
                       P.inv_lat.as<float>(), dlat, L.kv_a_norm->g(), engines_->scratch, s);
  k::copy_rows(dlat, R, m.latent, m.latent, {drows, kF32, m.row}, s);
  // kv_a
  k::convert(drows, kF32, a.dy_c.data(), kBf16, R * m.row, s);
  linear_backward(gemm, wgrad, R, D, m.row, a.dy_c.data(), m.row, P.a_c.data(), D, *L.kv_a,
                  {dan, kF32}, true);
}

}  // namespace kda::train::cuda
