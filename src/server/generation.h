// One request's generation, advanced a unit of work at a time so that a scheduler can interleave
// many: the prompt's prefill in pieces, then one decode step per call. It owns the sequence's
// session (KDA states, MLA cache) and sampler, and turns ids into text with stop strings applied.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/causal_lm.h"
#include "runtime/sampling.h"
#include "server/prefix_cache.h"
#include "tokenizer/text_stream.h"
#include "tokenizer/tokenizer.h"

namespace kda::server {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;  // 0: until a stop or the context limit
  runtime::SamplingParams sampling;
  std::vector<std::string> stop;  // generation ends before the first of these strings
};

enum class FinishReason { running, stop, length };
const char* finish_reason_name(FinishReason r);  // "stop", "length" (null while running)

class Generation {
 public:
  // Checks the request (throws kda::Error: an empty prompt, ids outside the vocabulary, no room
  // left in `context_limit` tokens, the session's limit for `context`, see context_limit()) and
  // allocates nothing: the session is made (or continued from the prefix cache's longest
  // snapshot that begins the prompt) by the first step, when a scheduler admits the request.
  Generation(const model::CausalLM& lm, const tokenizer::Tokenizer& tok, GenerationRequest request,
             int64_t context, int64_t context_limit, PrefixCache* cache = nullptr);
  // The context a session made with start_session(context) holds (0: unbounded); it allocates
  // one session, so callers ask once.
  static int64_t context_limit(const model::CausalLM& lm, int64_t context);

  // Prefill of at most kPrefillPiece prompt tokens, or one decode step; returns the text that
  // became final (possibly empty: an unfinished character, or a possible start of a stop string).
  std::string step();
  // step() in two halves, for a scheduler that batches many sequences' decode steps into one
  // model call (CausalLM::decode_batch): advance() does everything but that call and leaves the
  // sampled id in pending_token() (nothing pending after a prefill piece or at the end); the
  // caller feeds it to session() and hands the logits to accept_logits().
  std::string advance();
  std::optional<int32_t> pending_token() const { return pending_; }
  model::Session& session() { return *session_; }
  void accept_logits(Tensor logits);  // [1, vocab] of the pending token
  bool done() const { return finish_ != FinishReason::running; }
  FinishReason finish_reason() const { return finish_; }
  int64_t prompt_tokens() const { return int64_t(request_.prompt.size()); }
  int64_t completion_tokens() const { return generated_; }
  int64_t cached_tokens() const { return cached_; }  // prompt tokens taken from the cache

  // Prompt tokens fed per step: long prompts then yield to the other sequences between pieces.
  static constexpr int64_t kPrefillPiece = 512;

 private:
  void start();                                     // the session, new or from the cache
  std::string emit(std::string piece, bool final);  // applies the stop strings
  void finish(FinishReason r);

  const model::CausalLM& lm_;
  const tokenizer::Tokenizer& tok_;
  GenerationRequest request_;
  std::unique_ptr<model::Session> session_;
  runtime::Sampler sampler_;
  tokenizer::TextStream text_;
  std::vector<int32_t> stop_ids_;
  int64_t context_option_ = 0, context_ = 0;
  PrefixCache* cache_ = nullptr;
  std::vector<int32_t> fed_;  // the ids the session has consumed (prompt, then the answer)
  int64_t cached_ = 0;
  int64_t prefilled_ = 0;
  int64_t generated_ = 0;
  Tensor last_logits_;
  std::optional<int32_t> pending_;  // sampled, not yet fed
  std::string held_;                // text not yet handed out: it may be the start of a stop string
  FinishReason finish_ = FinishReason::running;
};

}  // namespace kda::server
