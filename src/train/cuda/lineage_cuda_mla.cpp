// The lineage model's MLA mixer (`M` layers) on the GPU: train/cuda/mla_train.h (Kimi Linear's
// GPU trainer runs the same code) with the lineage's sizes (lineage_detail::mla_shape).
#include "train/cuda/lineage_cuda_internal.h"
#include "train/cuda/mla_train.h"

namespace kda::train::cuda {

using namespace lineage_detail;

k::AttentionArgs LineageCudaModel::mla_workspace_args(const PerLayer& P, int64_t len,
                                                      int64_t batch) const {
  const LineageConfig& c = host_->config();
  return mla_train::attention_args(P, mla_shape(c.heads, c.head_dim), 0, len, batch);
}

void LineageCudaModel::mla_forward(Layer& L, int64_t l, int64_t B, int64_t T) {
  const LineageConfig& c = host_->config();
  Activations& a = *acts_;
  const mla_train::Context x{
      engines_->gemm, engines_->wgrad,    engines_->scratch,  stream_, a.R, c.width, B, T,
      cu_seqlens_,    a.workspace.data(), a.workspace.bytes()};
  mla_train::forward(x, {L.Wq, L.kv_a, L.kv_a_norm, L.kv_b}, mla_shape(c.heads, c.head_dim),
                     a.layers[size_t(l)], a);
}

void LineageCudaModel::mla_backward(Layer& L, int64_t l, int64_t B, int64_t T) {
  const LineageConfig& c = host_->config();
  Activations& a = *acts_;
  const mla_train::Context x{
      engines_->gemm, engines_->wgrad,    engines_->scratch,  stream_, a.R, c.width, B, T,
      cu_seqlens_,    a.workspace.data(), a.workspace.bytes()};
  mla_train::backward(x, {L.Wq, L.kv_a, L.kv_a_norm, L.kv_b}, mla_shape(c.heads, c.head_dim),
                      a.layers[size_t(l)], a, a.dv_c.data());
}

}  // namespace kda::train::cuda
