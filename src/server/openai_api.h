// The OpenAI-style HTTP API over a Scheduler: GET /health, GET /v1/models, POST /v1/completions
// and POST /v1/chat/completions, whole or streamed as server-sent events. Request bodies are
// validated field by field (a 400 names the field); fields this engine does not act on
// (frequency_penalty, user, ...) are accepted and ignored, ones it cannot honour (n > 1,
// logprobs, echo) are refused.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "server/http_server.h"
#include "server/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace kda::server {

class OpenAiApi {
 public:
  OpenAiApi(Scheduler& scheduler, const tokenizer::Tokenizer& tok, std::string model_name);
  void handle(const HttpRequest& request, HttpResponder& out);

 private:
  void completions(const HttpRequest& request, HttpResponder& out, bool chat);
  std::string next_id(const char* prefix);
  std::vector<int32_t> encode_chat(const std::vector<tokenizer::ChatMessage>& messages) const;

  Scheduler& scheduler_;
  const tokenizer::Tokenizer& tok_;
  std::string model_name_;
  std::atomic<uint64_t> counter_{0};
  int64_t started_ = 0;  // unix time, the models' "created"
};

}  // namespace kda::server
