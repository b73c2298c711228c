// The NoPE MLA mixer of a Kimi Linear layer on the GPU; the steps of model/kimi_mla_block.cpp:
//   q = q_proj x (or q_b(RMSNorm(q_a x)))                        [T, H, nope + rope] fp32
//   row = [kv_a_layernorm(c) ; k_rope] = kv_a_proj_with_mqa x     appended to the latent cache
//   expanded (prefill):  K, V of every head from kv_b and the cached rows; flash attention
//   absorbed (decode):   q_lat_h = q_nope_h W_UK_h (one batched GEMM over heads), attention
//                        over the latent rows as one shared KV head (width latent + rope; the
//                        values are the first `latent` columns), o_h = o_lat_h W_UV_h^T
//   y = o_proj o
#include <cmath>

#include "core/error.h"
#include "model/cuda/device_tensor.h"
#include "model/cuda/kimi_cuda_blocks.h"
#include "model/cuda/mla_kernels.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::model::cuda {

MlaDeviceWeights upload_mla(const kimi::MlaWeights& w, ElementType type) {
  MlaDeviceWeights d;
  d.q_proj = upload(w.q_proj, type);
  if (!w.q_a_proj.empty()) {
    d.q_a_proj = upload(w.q_a_proj, type);
    d.q_a_layernorm = upload(w.q_a_layernorm, ElementType::f32);
  }
  d.kv_a = upload(w.kv_a, type);
  d.kv_a_layernorm = upload(w.kv_a_layernorm, ElementType::f32);
  d.kv_b = upload(w.kv_b, type);
  d.o_proj = upload(w.o_proj, type);
  return d;
}

MlaDeviceWeights random_mla(const KimiLinearConfig& c, ElementType type, uint64_t seed) {
  const int64_t D = c.hidden_size, H = c.mla_heads, L = c.kv_lora_rank;
  const float in_scale = 1.f / std::sqrt(float(D));
  MlaDeviceWeights d;
  if (c.q_lora_rank > 0) {
    d.q_a_proj = random_weights(c.q_lora_rank * D, type, in_scale, seed + 1);
    d.q_a_layernorm = upload_f32(std::vector<float>(size_t(c.q_lora_rank), 1.f));
    d.q_proj = random_weights(H * c.mla_qk_dim() * c.q_lora_rank, type,
                              1.f / std::sqrt(float(c.q_lora_rank)), seed + 2);
  } else {
    d.q_proj = random_weights(H * c.mla_qk_dim() * D, type, in_scale, seed + 2);
  }
  d.kv_a = random_weights(c.mla_row_width() * D, type, in_scale, seed + 3);
  d.kv_a_layernorm = upload_f32(std::vector<float>(size_t(L), 1.f));
  d.kv_b = random_weights(H * (c.qk_nope_head_dim + c.v_head_dim) * L, type,
                          1.f / std::sqrt(float(L)), seed + 4);
  d.o_proj = random_weights(D * H * c.v_head_dim, type, 1.f / std::sqrt(float(H * c.v_head_dim)),
                            seed + 5);
  return d;
}

void mla_forward(const KimiLinearConfig& c, const MlaDeviceWeights& w, const void* xc, int64_t T,
                 LatentDeviceCache& cache, float* y, Context& ctx) {
  namespace k = ops::cuda;
  const int64_t D = c.hidden_size, H = c.mla_heads, L = c.kv_lora_rank;
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vd = c.v_head_dim;
  const int64_t qk = nope + rope, row = c.mla_row_width(), q_width = H * qk;
  const ElementType type = ctx.type;
  const size_t es = ctx.esize();
  const cudaStream_t stream = ctx.stream();
  auto& s = ctx.s;
  require(cache.length + T <= cache.capacity, "kimi_linear (cuda): the MLA cache is full");
  const float scale = float(1.0 / std::sqrt(double(qk)));

  // Queries, fp32 [T, H, qk]
  float* q = take(s.q, T * q_width);
  if (c.q_lora_rank > 0) {
    const int64_t R = c.q_lora_rank;
    float* qa = take(s.lowrank, T * R);
    ctx.gemm.linear(type, T, R, D, {xc, D}, {w.q_a_proj.data(), D}, {qa, ElementType::f32});
    void* qa_c = take<char>(s.hidden, T * R, es);
    k::rms_norm(qa, T, R, R, w.q_a_layernorm.as<float>(), kKimiLatentNormEps, {qa_c, type}, stream);
    ctx.gemm.linear(type, T, q_width, R, {qa_c, R}, {w.q_proj.data(), R}, {q, ElementType::f32});
  } else {
    ctx.gemm.linear(type, T, q_width, D, {xc, D}, {w.q_proj.data(), D}, {q, ElementType::f32});
  }

  // The new latent rows, normalised, straight into the cache.
  float* rows32 = take(s.k, T * row);
  ctx.gemm.linear(type, T, row, D, {xc, D}, {w.kv_a.data(), D}, {rows32, ElementType::f32});
  const int64_t past = cache.length;
  char* cache_rows = cache.rows.as<char>();
  // A replayed decode step writes its row to a fixed place and appends it where the device-side
  // length says; otherwise the row goes straight to its place in the cache.
  const bool replayed = ctx.length_device && T == 1;
  char* new_rows = replayed ? take<char>(s.staging, row, es) : cache_rows + size_t(past * row) * es;
  k::rms_norm(rows32, T, L, row, w.kv_a_layernorm.as<float>(), kKimiLatentNormEps,
              {new_rows, type, row}, stream);
  k::copy_rows(rows32 + L, T, rope, row, {new_rows + size_t(L) * es, type, row}, stream);
  if (replayed) mla_append_row(new_rows, cache_rows, row, type, ctx.length_device, stream);
  cache.length += T;
  const int64_t Tk = cache.length;

  const char* kv_b = w.kv_b.as<char>();
  void* o = take<char>(s.normed, T * H * vd, es);  // [T, H, v] in the GEMM type, for o_proj
  if (T >= kMlaExpandFromTokens) {
    // Expanded: kvb = rows[:, :L] kv_b^T, then keys / values per head.
    float* kvb = take(s.kvb, Tk * H * (nope + vd));
    ctx.gemm.linear(type, Tk, H * (nope + vd), L, {cache_rows, row}, {kv_b, L},
                    {kvb, ElementType::f32});
    void* keys = take<char>(s.keys, Tk * H * qk, es);
    void* values = take<char>(s.values, Tk * H * vd, es);
    mla_expand_keys_values(kvb, cache_rows, Tk, H, nope, rope, vd, L, type, keys, values, stream);
    void* qc = take<char>(s.qc, T * q_width, es);
    k::convert(q, ElementType::f32, qc, type, T * q_width, stream);
    float* attn = take(s.attn, T * H * vd);
    k::AttentionArgs a;
    a.dtype = type;
    a.Tq = T;
    a.Tk = Tk;
    a.Hq = a.Hkv = H;
    a.Dk = qk;
    a.Dv = vd;
    a.q = qc;
    a.k = keys;
    a.v = values;
    a.q_offset = past;
    a.scale = scale;
    a.o = attn;
    const size_t ws = k::attention_workspace_bytes(a);
    k::attention_forward(a, take<char>(s.workspace, int64_t(ws), 1), ws, stream);
    k::convert(attn, ElementType::f32, o, type, T * H * vd, stream);
  } else {
    // Absorbed: q_lat [T, H, L + rope] = [q_nope_h W_UK_h ; q_rope_h]
    void* qc = take<char>(s.qc, T * q_width, es);
    k::convert(q, ElementType::f32, qc, type, T * q_width, stream);
    void* q_lat = take<char>(s.kc, T * H * row, es);
    ctx.gemm.batched(type, H, T, L, nope, {{qc, q_width}, qk * int64_t(1)},
                     {{kv_b, L}, (nope + vd) * L}, false, {{q_lat, type, H * row}, row});
    k::copy_rows(q + nope, T * H, rope, qk, {static_cast<char*>(q_lat) + size_t(L) * es, type, row},
                 stream);
    float* o_lat = take(s.o_latent, T * H * L);
    k::AttentionArgs a;
    a.dtype = type;
    a.Tq = T;
    a.Tk = Tk;
    a.Hq = H;
    a.Hkv = 1;
    a.Dk = row;
    a.Dv = L;
    a.q = q_lat;
    a.k = cache_rows;
    a.v = cache_rows;
    a.q_row_stride = H * row;
    a.k_row_stride = row;
    a.v_row_stride = row;
    a.q_offset = past;
    if (replayed) {
      a.Tk = ctx.plan_keys;
      a.Tk_device = ctx.length_device;
    }
    a.scale = scale;
    a.o = o_lat;
    const size_t ws = k::attention_workspace_bytes(a);
    k::attention_forward(a, take<char>(s.workspace, int64_t(ws), 1), ws, stream);
    void* o_lat_c = take<char>(s.o_latent_c, T * H * L, es);
    k::convert(o_lat, ElementType::f32, o_lat_c, type, T * H * L, stream);
    // o_h [T, v] = o_lat_h [T, L] W_UV_h^T, W_UV_h = kv_b rows h (nope + v) + nope ..
    ctx.gemm.batched(type, H, T, vd, L, {{o_lat_c, H * L}, L},
                     {{kv_b + size_t(nope * L) * es, L}, (nope + vd) * L}, true,
                     {{o, type, H * vd}, vd});
  }
  ctx.gemm.linear(type, T, D, H * vd, {o, H * vd}, {w.o_proj.data(), H * vd},
                  {y, ElementType::f32});
}

}  // namespace kda::model::cuda
