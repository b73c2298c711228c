// Models on the GPU: the same CausalLM / Session faces as the CPU models (model/causal_lm.h),
// with weights, states and caches in device memory and every layer run by CUDA kernels and
// cuBLAS. `type` picks the weights' and GEMM inputs' element type: bf16 (the fast path), or fp32
// (exact to fp32 rounding: the path held to the CPU model and the fixtures at 1e-4). The
// residual stream, norms, gates, recurrent states and logits stay fp32 either way.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "model/causal_lm.h"
#include "ops/common/device_types.h"

namespace kda::model::cuda {

// A Hugging Face folder (or its config.json's folder) of a supported model_type (kimi_linear,
// gpt2), loaded onto the current CUDA device. Throws kda::Error as load_causal_lm does.
std::unique_ptr<CausalLM> load_causal_lm_cuda(const std::string& path, ops::cuda::ElementType type);

// A Kimi Linear model of this config.json with deterministic random weights made on the device
// (benchmarks of shapes whose checkpoints are too large to ship or load).
std::unique_ptr<CausalLM> synthetic_kimi_linear_cuda(const nlohmann::json& config,
                                                     ops::cuda::ElementType type, uint64_t seed);

// Tokens per prefill call to the layers: longer feeds are cut into pieces this long, which bounds
// the scratch memory (the MLA keys / values of a piece, the KDA projections) at long contexts.
constexpr int64_t kPrefillPieceTokens = 16384;

}  // namespace kda::model::cuda
