// Kimi's NoPE MLA mixer on the GPU: train/cuda/mla_train.h (the lineage model's `M` layers run
// the same code) with Kimi's config sizes and weights (q_lora_rank included).
#include "model/kimi_linear_config.h"
#include "train/cuda/kimi_cuda_internal.h"
#include "train/cuda/mla_train.h"

namespace kda::train::cuda {

using namespace kimi_detail;

namespace {

mla_train::Shape mla_shape(const model::KimiLinearConfig& c) {
  return {c.mla_heads,  c.qk_nope_head_dim, c.qk_rope_head_dim,
          c.v_head_dim, c.kv_lora_rank,     c.q_lora_rank};
}

}  // namespace

void KimiCudaModel::mla_forward(Layer& L, PerLayer& P, int64_t B, int64_t T) {
  Activations& a = *acts_;
  const mla_train::Context x{
      engines_->gemm, engines_->wgrad,    engines_->scratch,  stream_, a.R, c_.hidden_size, B, T,
      cu_seqlens_,    a.workspace.data(), a.workspace.bytes()};
  mla_train::forward(x, {L.q, L.kv_a, L.kv_a_norm, L.kv_b, L.q_a, L.q_a_norm}, mla_shape(c_), P, a);
}

void KimiCudaModel::mla_backward(Layer& L, PerLayer& P, int64_t B, int64_t T) {
  Activations& a = *acts_;
  const mla_train::Context x{
      engines_->gemm, engines_->wgrad,    engines_->scratch,  stream_, a.R, c_.hidden_size, B, T,
      cu_seqlens_,    a.workspace.data(), a.workspace.bytes()};
  mla_train::backward(x, {L.q, L.kv_a, L.kv_a_norm, L.kv_b, L.q_a, L.q_a_norm}, mla_shape(c_), P, a,
                      a.dvm_c.data());
}

}  // namespace kda::train::cuda
