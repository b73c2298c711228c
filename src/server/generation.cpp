#include "server/generation.h"

#include <algorithm>

#include "core/error.h"

namespace kda::server {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::stop:
      return "stop";
    case FinishReason::length:
      return "length";
    default:
      return nullptr;
  }
}

int64_t Generation::context_limit(const model::CausalLM& lm, int64_t context) {
  return lm.start_session(context)->max_context();
}

Generation::Generation(const model::CausalLM& lm, const tokenizer::Tokenizer& tok,
                       GenerationRequest request, int64_t context, int64_t context_limit,
                       PrefixCache* cache)
    : lm_(lm),
      tok_(tok),
      request_(std::move(request)),
      sampler_(request_.sampling),
      text_(tok),
      stop_ids_(tok.stop_ids()),
      context_option_(context),
      context_(context_limit),
      cache_(cache) {
  request_.sampling.validate();
  require(!request_.prompt.empty(), "the prompt encodes to no tokens");
  require(request_.max_tokens >= 0, "max_tokens must be >= 0");
  for (const int32_t id : request_.prompt)
    require(id >= 0 && id < lm.vocab_size(),
            "prompt token id " + std::to_string(id) + " is outside the model's vocabulary");
  require(context_ == 0 || prompt_tokens() < context_,
          "the prompt has " + std::to_string(prompt_tokens()) +
              " tokens, which leaves no room in the context of " + std::to_string(context_));
  std::erase_if(request_.stop, [](const std::string& s) { return s.empty(); });
}

void Generation::start() {
  if (cache_) {
    PrefixCache::Hit hit = cache_->lookup(request_.prompt);
    if (hit.session) {
      session_ = std::move(hit.session);
      prefilled_ = cached_ = hit.tokens;
      last_logits_ = std::move(hit.last_logits);
    }
  }
  if (!session_) session_ = lm_.start_session(context_option_);
  fed_.assign(request_.prompt.begin(), request_.prompt.begin() + prefilled_);
}

void Generation::finish(FinishReason r) {
  finish_ = r;
  // the sequence so far (the last sampled id is not fed): the next turn of a chat starts with it
  if (cache_) cache_->store(fed_, *session_, last_logits_);
}

std::string Generation::step() {
  std::string out = advance();
  if (pending_) accept_logits(session_->feed_last(std::span<const int32_t>(&*pending_, 1)));
  return out;
}

void Generation::accept_logits(Tensor logits) {
  require(pending_.has_value(), "generation: no token is waiting for its logits");
  last_logits_ = std::move(logits);
  fed_.push_back(*pending_);
  pending_.reset();
}

std::string Generation::advance() {
  require(!pending_, "generation: the sampled token has not been fed yet");
  if (done()) return {};
  if (!session_) {
    start();
    if (prefilled_ < prompt_tokens()) return {};  // else the cache held the whole prompt
  }
  if (prefilled_ < prompt_tokens()) {
    const int64_t n = std::min(kPrefillPiece, prompt_tokens() - prefilled_);
    const std::span<const int32_t> piece(request_.prompt.data() + prefilled_, size_t(n));
    last_logits_ = session_->feed_last(piece);
    fed_.insert(fed_.end(), piece.begin(), piece.end());
    prefilled_ += n;
    if (cache_ && prefilled_ == prompt_tokens()) cache_->store(fed_, *session_, last_logits_);
    return {};
  }
  const int32_t next = sampler_.sample(last_logits_.span_f32());
  if (std::find(stop_ids_.begin(), stop_ids_.end(), next) != stop_ids_.end()) {
    finish(FinishReason::stop);
    return emit(text_.finish(), true);
  }
  ++generated_;
  std::string piece = text_.add(next);
  const bool at_limit = (request_.max_tokens > 0 && generated_ >= request_.max_tokens) ||
                        (context_ > 0 && session_->length() + 1 > context_);
  if (at_limit) {
    finish(FinishReason::length);
    piece += text_.finish();
    return emit(std::move(piece), true);
  }
  std::string out = emit(std::move(piece), false);
  if (!done()) pending_ = next;
  return out;
}

std::string Generation::emit(std::string piece, bool final) {
  held_ += piece;
  // the earliest stop string in the held text ends the generation there
  size_t cut = std::string::npos;
  for (const std::string& s : request_.stop) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    finish(FinishReason::stop);
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  if (final) return std::exchange(held_, {});
  // hold back the longest tail that is a proper prefix of some stop string
  size_t keep = 0;
  for (const std::string& s : request_.stop)
    for (size_t n = std::min(s.size() - 1, held_.size()); n > keep; --n)
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

}  // namespace kda::server
