// The architecture-independent face of a language model: a whole-sequence forward (no caches),
// and sessions that hold a sequence's caches and states for prefill + token-by-token decode.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kda::model {

// What a config implies, without weights (kda info works on a bare config.json).
struct ArchitectureInfo {
  std::string model_type;                // "gpt2", "kimi_linear"
  std::string summary;                   // one line: sizes
  std::vector<std::string> layer_kinds;  // per layer, e.g. "KDA + dense MLP", "MLA + MoE"
  int64_t total_params = 0;
  int64_t active_params = 0;                    // per token (MoE: routed top-k + shared only)
  int64_t num_state_layers = 0;                 // layers with a fixed recurrent state (KDA)
  int64_t state_bytes_per_layer = 0;            // per sequence, at the engine's state dtypes
  int64_t num_cache_layers = 0;                 // layers whose cache grows with the context
  int64_t cache_bytes_per_token_per_layer = 0;  // bf16 cache entries
  // State + cache bytes per sequence at `tokens` of context.
  int64_t memory_per_sequence(int64_t tokens) const {
    return num_state_layers * state_bytes_per_layer +
           tokens * num_cache_layers * cache_bytes_per_token_per_layer;
  }
};

struct MemoryReport {
  int64_t weight_bytes = 0;  // as held in memory (fp32 on the CPU)
  int64_t state_bytes = 0;   // fixed-size recurrent and conv states
  int64_t cache_bytes = 0;   // growing caches (KV, MLA latent), bytes in use
};

// One sequence's caches and states.
class Session {
 public:
  virtual ~Session() = default;
  // Feeds the next tokens (a prefill when several, a decode step when one); returns the logits
  // of every fed token, [ids.size(), vocab] fp32. Throws past the session's max context.
  virtual Tensor feed(std::span<const int32_t> ids) = 0;
  // Like feed, but returns only the last fed token's logits, [1, vocab]: what generation needs,
  // without holding [prompt length, vocab] floats for a long prompt. Models may override it to
  // skip the other rows' output projection.
  virtual Tensor feed_last(std::span<const int32_t> ids) {
    const Tensor all = feed(ids);
    const int64_t vocab = all.dim(-1);
    Tensor last(DType::f32, {1, vocab});
    std::copy_n(all.f32() + (all.dim(0) - 1) * vocab, vocab, last.f32());
    return last;
  }
  virtual int64_t length() const = 0;  // tokens fed so far
  // The most tokens this session can hold (feeding past it throws); 0 when not bounded.
  virtual int64_t max_context() const { return 0; }
  virtual MemoryReport memory() const = 0;
  // An independent copy of this sequence's state (a snapshot: feeding either leaves the other as
  // it was), or nullptr where the backend cannot copy its state.
  virtual std::unique_ptr<Session> clone() const { return nullptr; }
};

class CausalLM {
 public:
  virtual ~CausalLM() = default;
  virtual const ArchitectureInfo& info() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t weight_bytes() const = 0;
  // One forward pass over one sequence without caches: logits [ids.size(), vocab].
  virtual Tensor forward(std::span<const int32_t> ids) const = 0;
  // max_context bounds the growing caches (0: the config's maximum).
  virtual std::unique_ptr<Session> start_session(int64_t max_context = 0) const = 0;
  // One decode step of several sequences at once: feeds ids[n] to sessions[n] (distinct
  // sessions of this model) and returns each one's next-token logits, [N, vocab]; row n is what
  // sessions[n]->feed_last(ids[n]) returns, up to float rounding. Models override it to read
  // their weights once for all N rows (a GEMM instead of N GEMVs); this default feeds each in
  // turn. Nothing is fed when a check fails (an id outside the vocabulary, a full context); an
  // error past the checks (a non-finite activation) leaves the sessions unusable, as feed does.
  virtual Tensor decode_batch(std::span<Session* const> sessions,
                              std::span<const int32_t> ids) const;
};

// decode_batch's checks (for the models' overrides): one id per session, ids in the vocabulary,
// distinct sessions, each with room for one more token; throws kda::Error.
void check_decode_batch(const CausalLM& lm, std::span<Session* const> sessions,
                        std::span<const int32_t> ids);

// Dispatch on config["model_type"]; throws kda::Error for an unknown type.
ArchitectureInfo describe_config(const nlohmann::json& config);
std::unique_ptr<CausalLM> load_causal_lm(const std::string& path);

}  // namespace kda::model
