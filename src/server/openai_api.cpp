#include "server/openai_api.h"

#include <chrono>
#include <cmath>
#include <ctime>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "core/error.h"

namespace kda::server {
namespace {

using json = nlohmann::json;

// A request the client got wrong: answered with 400 and the field's name.
struct BadRequest {
  std::string message;
  std::string param;
};

json error_body(const std::string& message, const char* type, const std::string& param) {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", nullptr}}}};
}

// Text from the model is valid UTF-8 (tokenizer::TextStream); replacing is only a last guard.
std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

void send_json(HttpResponder& out, int status, const json& body) {
  out.send(status, "application/json", dump(body));
}

bool present(const json& body, const char* key) {
  return body.contains(key) && !body[key].is_null();
}

double number_field(const json& body, const char* key, double fallback, double lo, double hi) {
  if (!present(body, key)) return fallback;
  const json& v = body[key];
  if (!v.is_number()) throw BadRequest{std::string(key) + " must be a number", key};
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    throw BadRequest{std::string(key) + " must be in [" + json(lo).dump() + ", " + json(hi).dump() +
                         "], got " + v.dump(),
                     key};
  return x;
}

int64_t int_field(const json& body, const char* key, int64_t fallback, int64_t lo) {
  if (!present(body, key)) return fallback;
  const json& v = body[key];
  if (!v.is_number_integer()) throw BadRequest{std::string(key) + " must be an integer", key};
  const int64_t x = v.get<int64_t>();
  if (x < lo)
    throw BadRequest{std::string(key) + " must be >= " + std::to_string(lo) + ", got " + v.dump(),
                     key};
  return x;
}

std::string text_content(const json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {  // [{"type": "text", "text": "..."}, ...]
    std::string text;
    for (const json& part : content) {
      if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
          !part.contains("text") || !part["text"].is_string())
        throw BadRequest{"only text content parts are supported", param};
      text += part["text"].get<std::string>();
    }
    return text;
  }
  throw BadRequest{"content must be a string or a list of text parts", param};
}

// The sampling and stopping fields both endpoints share.
GenerationRequest common_fields(const json& body, bool chat) {
  GenerationRequest r;
  if (present(body, "n") && int_field(body, "n", 1, 1) != 1)
    throw BadRequest{"only n = 1 is supported", "n"};
  for (const char* refused : {"logprobs", "top_logprobs", "echo", "suffix", "best_of"}) {
    const bool off = !present(body, refused) || body[refused] == false ||
                     (std::string(refused) == "best_of" && body[refused] == 1);
    if (!off) throw BadRequest{std::string(refused) + " is not supported", refused};
  }
  // OpenAI's defaults: temperature 1, top_p 1; completions stop after 16 tokens, chat at the
  // end of the context
  r.sampling.temperature = float(number_field(body, "temperature", 1.0, 0.0, 2.0));
  r.sampling.top_p = float(number_field(body, "top_p", 1.0, 0.0, 1.0));
  if (r.sampling.top_p == 0) throw BadRequest{"top_p must be > 0", "top_p"};
  r.sampling.top_k = int_field(body, "top_k", 0, 0);
  r.sampling.seed =
      present(body, "seed") ? uint64_t(int_field(body, "seed", 0, 0)) : std::random_device{}();
  const char* max_key =
      chat && present(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  r.max_tokens = int_field(body, max_key, chat ? 0 : 16, 1);
  if (present(body, "stop")) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      r.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array() && stop.size() <= 4) {
      for (const json& s : stop) {
        if (!s.is_string()) throw BadRequest{"stop must hold strings", "stop"};
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      throw BadRequest{"stop must be a string or a list of at most 4 strings", "stop"};
    }
  }
  return r;
}

}  // namespace

OpenAiApi::OpenAiApi(Scheduler& scheduler, const tokenizer::Tokenizer& tok, std::string model_name)
    : scheduler_(scheduler),
      tok_(tok),
      model_name_(std::move(model_name)),
      started_(int64_t(std::time(nullptr))) {}

// The template's markers are special tokens; a message's text must not bring its own (a user
// writing "<|im_end|>" would otherwise end their turn and open one of another role). Such
// messages are refused; the rest is encoded whole, as `kda run --chat` encodes it.
std::vector<int32_t> OpenAiApi::encode_chat(
    const std::vector<tokenizer::ChatMessage>& messages) const {
  for (size_t i = 0; i < messages.size(); ++i) {
    if (tok_.encode(messages[i].content, true) != tok_.encode(messages[i].content, false))
      throw BadRequest{"messages[" + std::to_string(i) + "].content holds a special token",
                       "messages[" + std::to_string(i) + "].content"};
  }
  try {
    return tok_.encode(tok_.apply_chat_template(messages), /*allow_special=*/true);
  } catch (const Error& e) {
    throw BadRequest{std::string(e.what()) + "; use /v1/completions", "messages"};
  }
}

std::string OpenAiApi::next_id(const char* prefix) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%llx%06llx", prefix, (unsigned long long)started_,
                (unsigned long long)counter_.fetch_add(1));
  return buf;
}

void OpenAiApi::handle(const HttpRequest& request, HttpResponder& out) {
  const std::string& path = request.path;
  const bool get = request.method == "GET", post = request.method == "POST";
  if (path == "/health" && get) return send_json(out, 200, {{"status", "ok"}});
  if (path == "/v1/models" && get) {
    return send_json(out, 200,
                     {{"object", "list"},
                      {"data", json::array({{{"id", model_name_},
                                             {"object", "model"},
                                             {"created", started_},
                                             {"owned_by", "kda.cpp"}}})}});
  }
  if ((path == "/v1/completions" || path == "/v1/chat/completions") && post)
    return completions(request, out, path == "/v1/chat/completions");
  const bool known = path == "/health" || path == "/v1/models" || path == "/v1/completions" ||
                     path == "/v1/chat/completions";
  if (known)
    return send_json(
        out, 405,
        error_body(request.method + " is not allowed on " + path, "invalid_request_error", ""));
  send_json(out, 404, error_body("no route " + path, "invalid_request_error", ""));
}

void OpenAiApi::completions(const HttpRequest& request, HttpResponder& out, bool chat) {
  std::shared_ptr<Job> job;
  bool stream = false, include_usage = false;
  try {
    json body;
    try {
      body = json::parse(request.body);
    } catch (const json::exception& e) {
      throw BadRequest{std::string("the body is not valid JSON: ") + e.what(), ""};
    }
    if (!body.is_object()) throw BadRequest{"the body must be a JSON object", ""};
    if (present(body, "stream")) {
      if (!body["stream"].is_boolean()) throw BadRequest{"stream must be true or false", "stream"};
      stream = body["stream"].get<bool>();
    }
    if (present(body, "stream_options")) {
      const json& so = body["stream_options"];
      if (!so.is_object()) throw BadRequest{"stream_options must be an object", "stream_options"};
      if (so.contains("include_usage") && !so["include_usage"].is_boolean())
        throw BadRequest{"stream_options.include_usage must be true or false",
                         "stream_options.include_usage"};
      include_usage = so.value("include_usage", false);
    }
    GenerationRequest r = common_fields(body, chat);
    if (chat) {
      if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
        throw BadRequest{"messages must be a non-empty list", "messages"};
      std::vector<tokenizer::ChatMessage> messages;
      for (size_t i = 0; i < body["messages"].size(); ++i) {
        const json& m = body["messages"][i];
        const std::string where = "messages[" + std::to_string(i) + "]";
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
          throw BadRequest{where + " needs a role", where + ".role"};
        const std::string role = m["role"].get<std::string>();
        if (role != "system" && role != "user" && role != "assistant" && role != "developer")
          throw BadRequest{where + ": unknown role '" + role + "'", where + ".role"};
        if (!m.contains("content")) throw BadRequest{where + " needs content", where + ".content"};
        messages.push_back({role == "developer" ? "system" : role,
                            text_content(m["content"], where + ".content")});
      }
      r.prompt = encode_chat(messages);
    } else {
      if (!body.contains("prompt")) throw BadRequest{"prompt is required", "prompt"};
      const json& p = body["prompt"];
      if (p.is_string()) {
        r.prompt = tok_.encode(p.get<std::string>(), /*allow_special=*/false);
      } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
        r.prompt = tok_.encode(p[0].get<std::string>(), /*allow_special=*/false);
      } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
        for (const json& id : p) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
            throw BadRequest{"prompt token ids must be integers in [0, 2^31)", "prompt"};
          r.prompt.push_back(int32_t(id.get<int64_t>()));
        }
      } else {
        throw BadRequest{"prompt must be a string, a list of one string, or a list of token ids",
                         "prompt"};
      }
    }
    try {
      job = scheduler_.submit(std::move(r));
    } catch (const Unavailable& e) {
      return send_json(out, 503, error_body(e.what(), "server_error", ""));
    } catch (const Error& e) {
      throw BadRequest{e.what(), chat ? "messages" : "prompt"};
    }
  } catch (const BadRequest& bad) {
    return send_json(out, 400, error_body(bad.message, "invalid_request_error", bad.param));
  } catch (const json::exception& e) {  // a field of the wrong type deep inside
    return send_json(out, 400,
                     error_body(std::string("a field has the wrong type: ") + e.what(),
                                "invalid_request_error", ""));
  } catch (const Error& e) {  // the tokenizer refusing the text
    return send_json(out, 400, error_body(e.what(), "invalid_request_error", ""));
  }
  // However the handler ends (the client gone, an exception), the sequence stops with it.
  struct CancelOnExit {
    Job& job;
    ~CancelOnExit() { job.cancel(); }
  } cancel_on_exit{*job};

  const std::string id = next_id(chat ? "chatcmpl" : "cmpl");
  const int64_t created = int64_t(std::time(nullptr));
  const char* object =
      chat ? (stream ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  auto usage = [](const Job::Event& e) {
    return json{{"prompt_tokens", e.prompt_tokens},
                {"completion_tokens", e.completion_tokens},
                {"total_tokens", e.prompt_tokens + e.completion_tokens},
                {"prompt_tokens_details", {{"cached_tokens", e.cached_tokens}}}};
  };
  auto finish = [](const Job::Event& e) {
    const char* name = finish_reason_name(e.finish);
    return name ? json(name) : json(nullptr);
  };

  if (!stream) {
    std::string text;
    Job::Event e;
    auto checked = std::chrono::steady_clock::now();
    do {
      // every 200 ms: has the client gone? Then nobody waits for the answer: stop generating it
      if (std::chrono::steady_clock::now() - checked > std::chrono::milliseconds(200)) {
        if (out.peer_closed()) return;
        checked = std::chrono::steady_clock::now();
      }
      std::optional<Job::Event> got = job->next_for(200);
      if (!got) continue;
      e = std::move(*got);
      text += e.text;
    } while (!e.last);
    if (!e.error.empty()) return send_json(out, 500, error_body(e.error, "server_error", ""));
    json choice = {{"index", 0}, {"finish_reason", finish(e)}};
    if (chat)
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    else
      choice["text"] = text, choice["logprobs"] = nullptr;
    return send_json(out, 200,
                     {{"id", id},
                      {"object", object},
                      {"created", created},
                      {"model", model_name_},
                      {"choices", json::array({choice})},
                      {"usage", usage(e)}});
  }

  // server-sent events: one chunk per text piece, the finish reason on the last, then [DONE]
  auto chunk = [&](const json& delta_or_text, const json& finish_reason) {
    json choice = {{"index", 0}, {"finish_reason", finish_reason}};
    if (chat)
      choice["delta"] = delta_or_text;
    else
      choice["text"] = delta_or_text, choice["logprobs"] = nullptr;
    json c = {{"id", id},
              {"object", object},
              {"created", created},
              {"model", model_name_},
              {"choices", json::array({choice})}};
    return "data: " + dump(c) + "\n\n";
  };
  bool alive = out.begin_stream(200, "text/event-stream");
  if (chat && alive) alive = out.write(chunk({{"role", "assistant"}, {"content", ""}}, nullptr));
  while (alive) {
    std::optional<Job::Event> got = job->next_for(200);
    if (!got) {
      alive = !out.peer_closed();  // a long prefill: notice a client that left meanwhile
      continue;
    }
    const Job::Event& e = *got;
    if (!e.error.empty()) {
      out.write("data: " + dump(error_body(e.error, "server_error", "")) + "\n\n");
      break;
    }
    if (!e.text.empty() || e.last) {
      const json piece =
          chat ? (e.text.empty() ? json::object() : json{{"content", e.text}}) : json(e.text);
      alive = out.write(chunk(piece, e.last ? finish(e) : json(nullptr)));
    }
    if (e.last) {
      if (include_usage) {
        json c = {{"id", id},
                  {"object", object},
                  {"created", created},
                  {"model", model_name_},
                  {"choices", json::array()},
                  {"usage", usage(e)}};
        out.write("data: " + dump(c) + "\n\n");
      }
      out.write("data: [DONE]\n\n");
      break;
    }
  }
  out.end();
}

}  // namespace kda::server
