// The blocks of a Kimi Linear layer on the GPU (internal to src/model/cuda/kimi_*): device
// weights (projections in the model's element type, norms, gates and the router in fp32), the
// per-sequence device memory of each mixer, and the forward of T new tokens of one sequence.
// Mirrors model/kimi_linear_blocks.h (the CPU model), whose loaders supply the host weights.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/cuda/stage_timer.h"
#include "model/kimi_linear_blocks.h"
#include "model/kimi_linear_config.h"
#include "ops/common/device_buffer.h"
#include "ops/gemm/cuda/gemm_cuda.h"
#include "ops/moe/cuda/moe_cuda.h"

namespace kda::model::cuda {

using ops::cuda::DeviceBuffer;
using ops::cuda::ElementType;

// What every block reads and writes besides its own weights: the stream's cuBLAS handle, the
// element type of weights and GEMM inputs, and scratch buffers grown on demand and kept.
struct Context {
  ops::cuda::Gemm& gemm;
  ElementType type;  // weights and GEMM inputs: fp32 (the exact path) or bf16
  struct Scratch {
    DeviceBuffer h, x32, xc, out, proj, q, k, v, qc, kc, vc, lowrank, graw, gate, g, beta, attn,
        normed, state, kvb, keys, values, o_latent, o_latent_c, workspace, slot, ids, logits,
        hidden, staging;
    ops::cuda::MoeDeviceWorkspace moe;
  } s;
  StageTimer timer;  // KDA_CUDA_PROFILE: time per stage
  // Decode steps replayed from a CUDA graph (kimi_linear_cuda.cpp): nothing the graph's
  // kernels read may change between replays but memory contents, so the sequence length comes
  // from device memory (tokens held after this step) and the MLA attention is planned for up to
  // `plan_keys` keys. Null: eager launches planned for the exact length.
  const int32_t* length_device = nullptr;
  int64_t plan_keys = 0;
  cudaStream_t stream() const { return gemm.stream(); }
  size_t esize() const { return ops::cuda::element_bytes(type); }
};

// What a session owns on the device besides its memory: its stream, the stream's cuBLAS handle
// and the scratch of its forward passes (sessions run independently of one another).
class SessionDevice {
 public:
  explicit SessionDevice(ElementType type);
  ~SessionDevice();
  SessionDevice(const SessionDevice&) = delete;
  SessionDevice& operator=(const SessionDevice&) = delete;
  cudaStream_t stream() const { return stream_; }
  Context& ctx() { return *ctx_; }

 private:
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<ops::cuda::Gemm> gemm_;
  std::unique_ptr<Context> ctx_;
};

// The first `bytes` of `src` into `dst` (device to device, on `stream`; nothing when 0).
void copy_device_bytes(DeviceBuffer& dst, const DeviceBuffer& src, size_t bytes,
                       cudaStream_t stream);

// Grows `b` to hold n elements of `bytes_each` bytes and returns its memory as T*.
template <class T = float>
T* take(DeviceBuffer& b, int64_t n, size_t bytes_each = sizeof(T)) {
  b.reserve(size_t(n) * bytes_each);
  return b.as<T>();
}

// --- KDA ---
struct KdaDeviceWeights {
  DeviceBuffer in_proj;   // [3 HK + 2 K + H, D]  q | k | v | f_a | g_a | b   (type)
  DeviceBuffer conv;      // [3, HK, W] fp32
  DeviceBuffer f_b, g_b;  // [HK, K] (type)
  DeviceBuffer A_log;     // [H] fp32
  DeviceBuffer dt_bias;   // [HK] fp32
  DeviceBuffer o_norm;    // [K] fp32
  DeviceBuffer o_proj;    // [D, HK] (type)
};
struct KdaDeviceState {
  DeviceBuffer recurrent;  // [H, K, V] fp32
  DeviceBuffer conv;       // [3, W - 1, HK] fp32
};
KdaDeviceWeights upload_kda(const kimi::KdaWeights& w, ElementType type);
KdaDeviceWeights random_kda(const KimiLinearConfig& c, ElementType type, uint64_t seed);
KdaDeviceState new_kda_device_state(const KimiLinearConfig& c);
// y [T, D] fp32 from the normalised input xc [T, D] (type); advances the state by T tokens.
void kda_forward(const KimiLinearConfig& c, const KdaDeviceWeights& w, const void* xc, int64_t T,
                 KdaDeviceState& state, float* y, Context& ctx);

// --- MLA ---
struct MlaDeviceWeights {
  DeviceBuffer q_proj;  // [H (nope + rope), D or q_lora_rank] (type)
  DeviceBuffer q_a_proj, q_a_layernorm;
  DeviceBuffer kv_a;            // [latent + rope, D] (type)
  DeviceBuffer kv_a_layernorm;  // [latent] fp32
  DeviceBuffer kv_b;            // [H (nope + v), latent] (type)
  DeviceBuffer o_proj;          // [D, H v] (type)
};
// One sequence's latent rows [capacity, latent + rope] of the model's type.
struct LatentDeviceCache {
  DeviceBuffer rows;
  int64_t capacity = 0, length = 0;
};
MlaDeviceWeights upload_mla(const kimi::MlaWeights& w, ElementType type);
MlaDeviceWeights random_mla(const KimiLinearConfig& c, ElementType type, uint64_t seed);
// Prefills of at least this many tokens expand keys and values (flash attention over heads);
// shorter feeds attend in absorbed form over the latent rows (one shared KV head).
constexpr int64_t kMlaExpandFromTokens = 64;
void mla_forward(const KimiLinearConfig& c, const MlaDeviceWeights& w, const void* xc, int64_t T,
                 LatentDeviceCache& cache, float* y, Context& ctx);

// --- Feed-forward ---
struct FfnDeviceWeights {
  bool moe = false;
  int64_t shared_intermediate = 0;           // dense MLP / shared experts' I (0: none)
  DeviceBuffer gate_up, down;                // [2 I, D], [D, I] (type)
  DeviceBuffer router, correction_bias;      // fp32
  DeviceBuffer expert_gate_up, expert_down;  // [E, 2 I, D], [E, D, I] (type)
  ops::MoeRouting routing;
};
FfnDeviceWeights upload_ffn(const KimiLinearConfig& c, int64_t layer, const kimi::FfnWeights& w,
                            ElementType type);
FfnDeviceWeights random_ffn(const KimiLinearConfig& c, int64_t layer, ElementType type,
                            uint64_t seed);
// y [T, D] fp32 from x32 [T, D] fp32 and the same rows xc in the model's type.
void ffn_forward(const KimiLinearConfig& c, const FfnDeviceWeights& w, const float* x32,
                 const void* xc, int64_t T, float* y, Context& ctx);

// Random weights of `type`, uniform in [-scale, scale) (benchmarks; deterministic per seed).
DeviceBuffer random_weights(int64_t n, ElementType type, float scale, uint64_t seed);
// fp32 device copy of host values (norm weights, gates, biases).
DeviceBuffer upload_f32(const std::vector<float>& values);

}  // namespace kda::model::cuda
