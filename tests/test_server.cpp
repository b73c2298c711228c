// The OpenAI-style server (src/server): generation units against a plain decode loop, stop
// strings and limits, the scheduler's interleaving against one-at-a-time runs, and the HTTP API
// end to end over a real socket (whole and streamed responses, every refusal), on the embedded
// default model.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <fstream>
#include <sstream>

#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "model/causal_lm.h"
#include "run_command.h"
#include "runtime/sampling.h"
#include "scratch_dir.h"
#include "server/generation.h"
#include "server/http_server.h"
#include "server/openai_api.h"
#include "server/scheduler.h"
#include "tokenizer/text_stream.h"
#include "tokenizer/tokenizer.h"

namespace kda::server {
namespace {

using json = nlohmann::json;

const std::string kModelDir = std::string(KDA_MODELS_DIR) + "/kimi-mini";

struct Loaded {
  std::unique_ptr<model::CausalLM> lm = model::load_causal_lm(kModelDir);
  std::unique_ptr<tokenizer::Tokenizer> tok = tokenizer::load_tokenizer(kModelDir);
};
const Loaded& loaded() {
  static const Loaded l;
  return l;
}

// The continuation by a plain session loop, greedy or drawn by a seeded sampler: what every
// server path must reproduce.
std::vector<int32_t> sampled_ids(const std::vector<int32_t>& prompt, int64_t n,
                                 const runtime::SamplingParams& params) {
  const auto session = loaded().lm->start_session();
  Tensor last = session->feed_last(prompt);
  const std::vector<int32_t> stops = loaded().tok->stop_ids();
  runtime::Sampler sampler(params);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t next = sampler.sample(last.span_f32());
    if (std::find(stops.begin(), stops.end(), next) != stops.end()) break;  // as the server ends
    out.push_back(next);
    last = session->feed_last(std::span<const int32_t>(&next, 1));
  }
  return out;
}
std::vector<int32_t> greedy_ids(const std::vector<int32_t>& prompt, int64_t n) {
  return sampled_ids(prompt, n, {});
}

std::vector<int32_t> encode(const std::string& text) {
  return loaded().tok->encode(text, false);
}

// The context a session of the model holds with the --ctx option `context` (0: the model's).
int64_t limit(int64_t context) {
  return Generation::context_limit(*loaded().lm, context);
}

// Runs a generation to its end; returns the text and the pieces it came in.
std::string run_all(Generation& g, std::vector<std::string>* pieces = nullptr) {
  std::string text;
  for (int guard = 0; !g.done() && guard < 100000; ++guard) {
    std::string piece = g.step();
    if (pieces && !piece.empty()) pieces->push_back(piece);
    text += piece;
  }
  EXPECT_TRUE(g.done());
  return text;
}

GenerationRequest greedy(const std::string& prompt, int64_t max_tokens) {
  GenerationRequest r;
  r.prompt = encode(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

TEST(ServerGeneration, GreedyMatchesAPlainDecodeLoop) {
  for (const char* prompt : {"The jury said that the city", "It", "In the morning, the men of"}) {
    const std::vector<int32_t> ids = greedy_ids(encode(prompt), 24);
    Generation g(*loaded().lm, *loaded().tok, greedy(prompt, 24), 0, limit(0));
    const std::string text = run_all(g);
    EXPECT_EQ(text, loaded().tok->decode(ids)) << prompt;
    EXPECT_EQ(g.finish_reason(), FinishReason::length);
    EXPECT_EQ(g.completion_tokens(), 24);
    EXPECT_EQ(g.prompt_tokens(), int64_t(encode(prompt).size()));
  }
}

TEST(ServerGeneration, LongPromptsArePrefilledInPieces) {
  std::string prompt;
  while (int64_t(encode(prompt).size()) < 2 * Generation::kPrefillPiece + 37)
    prompt += "The city said that the jury was not in the way at the first. ";
  prompt += "In the morning, the men of the";  // mid-sentence: text follows, not end-of-text
  const std::vector<int32_t> ids = greedy_ids(encode(prompt), 8);
  ASSERT_EQ(ids.size(), 8u);
  Generation g(*loaded().lm, *loaded().tok, greedy(prompt, 8), 0, limit(0));
  int empty_steps = 0;
  while (!g.done() && g.step().empty()) ++empty_steps;
  EXPECT_GE(empty_steps, 3);  // three prefill pieces before any text
  Generation again(*loaded().lm, *loaded().tok, greedy(prompt, 8), 0, limit(0));
  EXPECT_EQ(run_all(again), loaded().tok->decode(ids));
}

TEST(ServerGeneration, StopStringsEndTheTextBeforeThem) {
  const std::string prompt = "The jury said that the city";
  Generation full(*loaded().lm, *loaded().tok, greedy(prompt, 40), 0, limit(0));
  const std::string text = run_all(full);
  ASSERT_GT(text.size(), 20u);
  // a stop string spanning several tokens, found mid-text, and one that never occurs
  for (const size_t at : {size_t(5), text.size() / 2, text.size() - 4}) {
    GenerationRequest r = greedy(prompt, 40);
    const std::string stop = text.substr(at, 4);
    r.stop = {"never-in-this-text", stop};
    Generation g(*loaded().lm, *loaded().tok, r, 0, limit(0));
    std::vector<std::string> pieces;
    const std::string got = run_all(g, &pieces);
    EXPECT_EQ(got, text.substr(0, text.find(stop))) << "stop '" << stop << "'";
    EXPECT_EQ(g.finish_reason(), FinishReason::stop);
    for (const std::string& p : pieces) EXPECT_EQ(p.find(stop), std::string::npos);
  }
  GenerationRequest r = greedy(prompt, 40);
  r.stop = {"never-in-this-text"};
  Generation g(*loaded().lm, *loaded().tok, r, 0, limit(0));
  EXPECT_EQ(run_all(g), text);
  EXPECT_EQ(g.finish_reason(), FinishReason::length);
}

TEST(ServerGeneration, ContextLimitAndRefusals) {
  const std::string prompt = "The jury said that the city";
  const int64_t p = int64_t(encode(prompt).size());
  Generation g(*loaded().lm, *loaded().tok, greedy(prompt, 0), p + 3, limit(p + 3));
  run_all(g);
  EXPECT_EQ(g.finish_reason(), FinishReason::length);
  EXPECT_EQ(g.completion_tokens(), 4);  // the last from the logits of the context's last token
  EXPECT_THROW(Generation(*loaded().lm, *loaded().tok, greedy(prompt, 4), p, limit(p)), Error);
  EXPECT_THROW(Generation(*loaded().lm, *loaded().tok, greedy("", 4), 0, limit(0)), Error);
  GenerationRequest bad = greedy(prompt, 4);
  bad.prompt.push_back(int32_t(loaded().lm->vocab_size()));
  EXPECT_THROW(Generation(*loaded().lm, *loaded().tok, bad, 0, limit(0)), Error);
  GenerationRequest negative = greedy(prompt, 4);
  negative.sampling.temperature = -1;
  EXPECT_THROW(Generation(*loaded().lm, *loaded().tok, negative, 0, limit(0)), Error);
}

// A snapshot is independent of its source: both continue exactly as the source would have.
TEST(ServerSessionClone, CopiesAreIndependentAndExact) {
  const std::string gpt2_dir = std::string(KDA_SHARED_DIR) + "/fixtures/models/gpt2_tiny";
  const std::unique_ptr<model::CausalLM> gpt2 = model::load_causal_lm(gpt2_dir);
  for (const model::CausalLM* lm : {loaded().lm.get(), gpt2.get()}) {
    const int64_t V = std::min<int64_t>(lm->vocab_size(), 200);
    std::vector<int32_t> prefix, more, other;
    for (int i = 0; i < 37; ++i) prefix.push_back(int32_t((i * 7919 + 13) % V));
    for (int i = 0; i < 5; ++i) more.push_back(int32_t((i * 31 + 3) % V));
    for (int i = 0; i < 9; ++i) other.push_back(int32_t((i * 17 + 5) % V));
    const auto source = lm->start_session(256);
    source->feed(prefix);
    const auto mutated = source->clone(), copy = source->clone();
    ASSERT_TRUE(mutated && copy);
    EXPECT_EQ(copy->length(), source->length());
    mutated->feed(other);  // must touch neither the source nor the other copy
    const Tensor a = source->feed(more), b = copy->feed(more);
    ASSERT_EQ(a.numel(), b.numel());
    for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.f32()[i], b.f32()[i]) << i;
    EXPECT_EQ(copy->length(), int64_t(prefix.size() + more.size()));
    EXPECT_EQ(mutated->length(), int64_t(prefix.size() + other.size()));
  }
}

TEST(ServerPrefixCache, ContinuesFromSnapshotsWithTheSameAnswers) {
  const std::vector<int32_t> p = encode("The jury said that the city");
  auto request = [&](std::vector<int32_t> prompt) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_tokens = 8;
    r.sampling.temperature = 0;
    return r;
  };
  auto uncached = [&](const std::vector<int32_t>& prompt) {
    Generation g(*loaded().lm, *loaded().tok, request(prompt), 0, limit(0));
    return run_all(g);
  };
  PrefixCache cache(4);
  Generation first(*loaded().lm, *loaded().tok, request(p), 0, limit(0), &cache);
  const std::string first_text = run_all(first);
  EXPECT_EQ(first.cached_tokens(), 0);
  EXPECT_EQ(first_text, uncached(p));
  EXPECT_EQ(cache.size(), 2);  // after the prompt, and at the end

  // the same prompt again: no prefill at all (the snapshot keeps its last logits)
  Generation again(*loaded().lm, *loaded().tok, request(p), 0, limit(0), &cache);
  EXPECT_EQ(run_all(again), first_text);
  EXPECT_EQ(again.cached_tokens(), int64_t(p.size()));

  // a longer prompt that starts with it
  std::vector<int32_t> longer = p;
  for (const int32_t id : encode(" and the men")) longer.push_back(id);
  Generation extended(*loaded().lm, *loaded().tok, request(longer), 0, limit(0), &cache);
  EXPECT_EQ(run_all(extended), uncached(longer));
  EXPECT_EQ(extended.cached_tokens(), int64_t(p.size()));

  // the next turn of a conversation: the prompt, the answer, then more
  std::vector<int32_t> next_turn = p;
  for (const int32_t id : greedy_ids(p, 7)) next_turn.push_back(id);  // the fed part of the answer
  for (const int32_t id : encode(". It was")) next_turn.push_back(id);
  Generation turn(*loaded().lm, *loaded().tok, request(next_turn), 0, limit(0), &cache);
  EXPECT_EQ(run_all(turn), uncached(next_turn));
  EXPECT_EQ(turn.cached_tokens(), int64_t(p.size()) + 7);

  // a prompt that shares the first words and then turns, and one that is a strict prefix of
  // every entry: no snapshot begins either, so both prefill from the start
  for (const std::string& text :
       {std::string("The jury said that the men"), std::string("The jury")}) {
    const std::vector<int32_t> near = encode(text);
    Generation g(*loaded().lm, *loaded().tok, request(near), 0, limit(0), &cache);
    EXPECT_EQ(run_all(g), uncached(near)) << text;
    EXPECT_EQ(g.cached_tokens(), 0) << text;
  }

  // unrelated prompts miss; the least recently used entries go first
  Generation miss(*loaded().lm, *loaded().tok, request(encode("A man")), 0, limit(0), &cache);
  run_all(miss);
  EXPECT_EQ(miss.cached_tokens(), 0);
  EXPECT_EQ(cache.size(), 4);
  PrefixCache none(0);
  Generation no_cache(*loaded().lm, *loaded().tok, request(p), 0, limit(0), &none);
  run_all(no_cache);
  EXPECT_EQ(none.size(), 0);
}

// Full, the cache drops its least recently used entry: a lookup counts as a use, a store of
// held ids only refreshes them.
TEST(ServerPrefixCache, EvictsTheLeastRecentlyUsed) {
  PrefixCache cache(2);
  auto store = [&](const std::string& text) {
    const std::vector<int32_t> ids = encode(text);
    const auto session = loaded().lm->start_session();
    const Tensor last = session->feed_last(ids);
    cache.store(ids, *session, last);
  };
  auto hit_tokens = [&](const std::string& text) {
    const std::vector<int32_t> ids = encode(text);
    return std::pair{cache.lookup(ids).tokens, int64_t(ids.size())};
  };
  store("The jury said");
  store("It was");
  const auto [jury, jury_size] = hit_tokens("The jury said");  // the older entry, used now
  EXPECT_EQ(jury, jury_size);
  store("In the morning");  // full: drops "It was", not the older but just used "The jury said"
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(hit_tokens("It was").first, 0);
  // a store of held ids refreshes them: "In the morning" is now the least recently used
  store("The jury said");
  store("It was");
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(hit_tokens("In the morning").first, 0);
  EXPECT_EQ(hit_tokens("The jury said").first, jury_size);
  EXPECT_EQ(hit_tokens("It was").first, int64_t(encode("It was").size()));
}

TEST(ServerScheduler, InterleavedRequestsEqualOneAtATime) {
  const std::vector<std::string> prompts = {
      "The jury said that the city", "It was", "In the morning", "The man",
      "Several members said that",   "A"};
  std::vector<std::string> alone;
  for (const std::string& p : prompts) {
    Generation g(*loaded().lm, *loaded().tok, greedy(p, 12 + int64_t(p.size() % 5)), 0, limit(0));
    alone.push_back(run_all(g));
  }
  Scheduler scheduler(*loaded().lm, *loaded().tok, {.max_active = 2, .context = 0});
  std::vector<std::shared_ptr<Job>> jobs;
  for (const std::string& p : prompts)
    jobs.push_back(scheduler.submit(greedy(p, 12 + int64_t(p.size() % 5))));
  for (size_t i = 0; i < jobs.size(); ++i) {
    std::string text;
    Job::Event e;
    do {
      e = jobs[i]->next();
      text += e.text;
    } while (!e.last);
    EXPECT_TRUE(e.error.empty()) << e.error;
    EXPECT_EQ(text, alone[i]) << prompts[i];
    EXPECT_EQ(e.finish, FinishReason::length);
    EXPECT_EQ(e.completion_tokens, 12 + int64_t(prompts[i].size() % 5));
  }
  EXPECT_THROW(scheduler.submit(greedy("", 3)), Error);
  scheduler.shutdown();
  EXPECT_THROW(scheduler.submit(greedy("The", 3)), Error);
}

// The model with its decode_batch calls counted by size; while `open` is false, decode steps
// wait (so that sequences submitted meanwhile are certain to join the next round).
class BatchCounter final : public model::CausalLM {
 public:
  explicit BatchCounter(const model::CausalLM& inner) : inner_(inner) {}
  const model::ArchitectureInfo& info() const override { return inner_.info(); }
  int64_t vocab_size() const override { return inner_.vocab_size(); }
  int64_t weight_bytes() const override { return inner_.weight_bytes(); }
  Tensor forward(std::span<const int32_t> ids) const override { return inner_.forward(ids); }
  std::unique_ptr<model::Session> start_session(int64_t max_context) const override {
    return inner_.start_session(max_context);
  }
  Tensor decode_batch(std::span<model::Session* const> sessions,
                      std::span<const int32_t> ids) const override {
    while (!open.load()) std::this_thread::yield();
    const size_t n = sessions.size();
    if (sizes.size() <= n) sizes.resize(n + 1, 0);
    ++sizes[n];
    return inner_.decode_batch(sessions, ids);
  }
  mutable std::vector<int64_t> sizes;  // sizes[n]: calls with n sequences (the worker's alone)
  std::atomic<bool> open{true};

 private:
  const model::CausalLM& inner_;
};

// Sequences decoding at the same time share one model call a round, and still get the answers
// they get alone (the batched step's sums differ only in rounding).
TEST(ServerScheduler, DecodeStepsAreBatched) {
  const std::vector<std::string> prompts = {"The jury said", "It was", "In the morning",
                                            "Several members said that"};
  std::vector<std::string> alone;
  for (const std::string& p : prompts) {
    Generation g(*loaded().lm, *loaded().tok, greedy(p, 10), 0, limit(0));
    alone.push_back(run_all(g));
  }
  BatchCounter counter(*loaded().lm);
  std::vector<std::string> texts(prompts.size());
  {
    Scheduler scheduler(counter, *loaded().tok, {.max_active = 4, .context = 0});
    std::vector<std::shared_ptr<Job>> jobs;
    // the first sequence's first decode step waits until all four are submitted: however slowly
    // this thread gets to submit, the others join it while it has 8 steps left
    counter.open = false;
    for (const std::string& p : prompts) jobs.push_back(scheduler.submit(greedy(p, 10)));
    counter.open = true;
    for (size_t i = 0; i < jobs.size(); ++i) {
      Job::Event e;
      do {
        e = jobs[i]->next();
        texts[i] += e.text;
      } while (!e.last);
      EXPECT_TRUE(e.error.empty()) << e.error;
    }
  }  // the worker has stopped: sizes is ours to read
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(texts[i], alone[i]) << prompts[i];
  int64_t steps = 0, batched = 0;
  for (size_t n = 1; n < counter.sizes.size(); ++n) {
    steps += int64_t(n) * counter.sizes[n];
    if (n >= 2) batched += int64_t(n) * counter.sizes[n];
  }
  // 4 x 10 tokens, the last of each sampled but not fed: 36 decode steps, some of them batched
  // (how many depends on how soon the worker saw each submit, but at least the second round's)
  EXPECT_EQ(steps, 36);
  EXPECT_GE(batched, 2) << "no decode steps were fed in batches of two or more";
}

// --- HTTP, over a socket ---

struct Reply {
  int status = 0;
  std::string headers, body;
};

// Connects to the server on loopback (a receive timeout turns a hung server into a failure).
int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval timeout{60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

Reply http(int port, const std::string& method, const std::string& path,
           const std::string& body = "", const std::string& extra_headers = "",
           const std::string& version = "HTTP/1.1") {
  const int fd = connect_to(port);
  const std::string request = method + " " + path + " " + version + "\r\nHost: localhost\r\n" +
                              extra_headers + "Content-Length: " + std::to_string(body.size()) +
                              "\r\n\r\n" + body;
  // the server may answer (and stop reading) before a too-large request is all sent
  for (size_t done = 0; done < request.size();) {
    const ssize_t n = send(fd, request.data() + done, request.size() - done, MSG_NOSIGNAL);
    if (n <= 0) break;
    done += size_t(n);
  }
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) raw.append(buf, size_t(n));
  close(fd);
  Reply r;
  const size_t head_end = raw.find("\r\n\r\n");
  if (head_end == std::string::npos) return r;
  r.status = std::stoi(raw.substr(9, 3));
  r.headers = raw.substr(0, head_end);
  std::string rest = raw.substr(head_end + 4);
  if (r.headers.find("Transfer-Encoding: chunked") == std::string::npos) {
    r.body = rest;
    return r;
  }
  size_t pos = 0;  // de-chunk
  while (true) {
    const size_t line_end = rest.find("\r\n", pos);
    const size_t size = std::stoul(rest.substr(pos, line_end - pos), nullptr, 16);
    if (size == 0) break;
    r.body += rest.substr(line_end + 2, size);
    pos = line_end + 2 + size + 2;
  }
  return r;
}

// The data lines of a server-sent event stream, [DONE] excluded (checked to come last).
std::vector<json> events(const std::string& body) {
  std::vector<json> out;
  size_t pos = 0;
  bool done = false;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos);
    const std::string line = body.substr(pos, end - pos);
    EXPECT_EQ(line.rfind("data: ", 0), 0u) << line;
    EXPECT_FALSE(done) << "data after [DONE]";
    if (line == "data: [DONE]")
      done = true;
    else
      out.push_back(json::parse(line.substr(6)));
    pos = end + 2;
  }
  EXPECT_TRUE(done);
  return out;
}

// The model's tokenizer, passed through: the tests' variants below override one call each.
class WrappedTokenizer : public tokenizer::Tokenizer {
 public:
  explicit WrappedTokenizer(const tokenizer::Tokenizer& inner) : inner_(inner) {}
  std::vector<int32_t> encode(const std::string& text, bool allow_special) const override {
    return inner_.encode(text, allow_special);
  }
  std::string decode(const std::vector<int32_t>& ids) const override { return inner_.decode(ids); }
  int64_t vocab_size() const override { return inner_.vocab_size(); }
  std::string apply_chat_template(const std::vector<tokenizer::ChatMessage>& m) const override {
    return inner_.apply_chat_template(m);
  }
  std::vector<int32_t> stop_ids() const override { return inner_.stop_ids(); }

 private:
  const tokenizer::Tokenizer& inner_;
};

// A simple chat template around the model's own tokenizer (which has none).
class ChatTokenizer : public WrappedTokenizer {
 public:
  using WrappedTokenizer::WrappedTokenizer;
  std::string apply_chat_template(const std::vector<tokenizer::ChatMessage>& m) const override {
    std::string out;
    for (const auto& x : m) out += x.role + ": " + x.content + "\n";
    return out + "assistant:";
  }
};

// Without stop tokens: a sampled end-of-text cannot end a request early.
class NoStopTokenizer : public WrappedTokenizer {
 public:
  using WrappedTokenizer::WrappedTokenizer;
  std::vector<int32_t> stop_ids() const override { return {}; }
};

class ServerHttp : public ::testing::Test {
 protected:
  void start(const tokenizer::Tokenizer& tok, SchedulerOptions options = {}) {
    scheduler_ = std::make_unique<Scheduler>(*loaded().lm, tok, options);
    api_ = std::make_unique<OpenAiApi>(*scheduler_, tok, "kimi-mini");
    server_ = std::make_unique<HttpServer>(
        "127.0.0.1", 0, [this](const HttpRequest& q, HttpResponder& o) { api_->handle(q, o); });
    thread_ = std::thread([this] { server_->run(); });
  }
  void TearDown() override {
    if (!server_) return;
    server_->stop();
    thread_.join();
    scheduler_->shutdown();
    server_.reset();
  }
  int port() const { return server_->port(); }
  json post(const std::string& path, const json& body, int expect_status = 200) {
    const Reply r = http(port(), "POST", path, body.dump());
    EXPECT_EQ(r.status, expect_status) << r.body;
    return r.status == 200 && body.value("stream", false) ? json() : json::parse(r.body);
  }

  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<OpenAiApi> api_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
};

TEST_F(ServerHttp, CompletionsWholeAndStreamed) {
  start(*loaded().tok);
  const std::string prompt = "The jury said that the city";
  const std::string expected = loaded().tok->decode(greedy_ids(encode(prompt), 20));
  const json whole =
      post("/v1/completions",
           {{"prompt", prompt}, {"max_tokens", 20}, {"temperature", 0}, {"model", "anything"}});
  EXPECT_EQ(whole["object"], "text_completion");
  EXPECT_EQ(whole["model"], "kimi-mini");
  EXPECT_EQ(whole["choices"][0]["text"], expected);
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(whole["usage"]["prompt_tokens"], int64_t(encode(prompt).size()));
  EXPECT_EQ(whole["usage"]["completion_tokens"], 20);
  EXPECT_EQ(whole["usage"]["total_tokens"], int64_t(encode(prompt).size()) + 20);
  EXPECT_EQ(whole["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const json repeat =
      post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 20}, {"temperature", 0}});
  EXPECT_EQ(repeat["choices"][0]["text"], expected);
  EXPECT_EQ(repeat["usage"]["prompt_tokens_details"]["cached_tokens"],
            int64_t(encode(prompt).size()));

  // token ids as the prompt: the same continuation
  const json by_ids =
      post("/v1/completions", {{"prompt", encode(prompt)}, {"max_tokens", 20}, {"temperature", 0}});
  EXPECT_EQ(by_ids["choices"][0]["text"], expected);

  const Reply r = http(port(), "POST", "/v1/completions",
                       json{{"prompt", prompt},
                            {"max_tokens", 20},
                            {"temperature", 0},
                            {"stream", true},
                            {"stream_options", {{"include_usage", true}}}}
                           .dump());
  ASSERT_EQ(r.status, 200);
  EXPECT_NE(r.headers.find("Content-Type: text/event-stream"), std::string::npos);
  const std::vector<json> ev = events(r.body);
  ASSERT_GE(ev.size(), 3u);
  std::string text;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    text += ev[i]["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(ev[i]["choices"][0]["finish_reason"].is_null(), i + 2 < ev.size());
    EXPECT_EQ(ev[i]["id"], ev[0]["id"]);
  }
  EXPECT_EQ(text, expected);
  EXPECT_EQ(ev[ev.size() - 2]["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(ev.back()["choices"].empty());
  EXPECT_EQ(ev.back()["usage"]["completion_tokens"], 20);
}

TEST_F(ServerHttp, SeededSamplingRepeatsAndStopsApply) {
  start(*loaded().tok);
  const json body = {{"prompt", "The man"}, {"max_tokens", 16}, {"temperature", 0.9},
                     {"top_k", 40},         {"top_p", 0.95},    {"seed", 7}};
  const json a = post("/v1/completions", body), b = post("/v1/completions", body);
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
  const std::string text = a["choices"][0]["text"];
  // the model's distribution at those settings, drawn with that seed (so none is dropped)
  const runtime::SamplingParams params{.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = 7};
  EXPECT_EQ(text, loaded().tok->decode(sampled_ids(encode("The man"), 16, params)));
  json other_seed = body;
  other_seed["seed"] = 8;
  EXPECT_NE(post("/v1/completions", other_seed)["choices"][0]["text"], text);
  ASSERT_GT(text.size(), 8u);
  json stopped = body;
  stopped["stop"] = json::array({text.substr(4, 3)});
  const json c = post("/v1/completions", stopped);
  EXPECT_EQ(c["choices"][0]["text"], text.substr(0, text.find(text.substr(4, 3))));
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerHttp, ConcurrentClientsGetTheirOwnAnswers) {
  start(*loaded().tok, {.max_active = 3, .context = 0});
  const std::vector<std::string> prompts = {"The jury", "It was",  "In the morning", "The man",
                                            "A",        "Several", "The city said"};
  std::vector<std::future<json>> replies;
  for (const std::string& p : prompts)
    replies.push_back(std::async(std::launch::async, [&, p] {
      return json::parse(http(port(), "POST", "/v1/completions",
                              json{{"prompt", p}, {"max_tokens", 10}, {"temperature", 0}}.dump())
                             .body);
    }));
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(replies[i].get()["choices"][0]["text"],
              loaded().tok->decode(greedy_ids(encode(prompts[i]), 10)))
        << prompts[i];
}

TEST_F(ServerHttp, ChatWholeAndStreamed) {
  const ChatTokenizer chat(*loaded().tok);
  start(chat);
  const json messages = json::array(
      {{{"role", "system"}, {"content", "Be brief."}},
       {{"role", "user"},
        {"content", json::array({{{"type", "text"}, {"text", "Tell me of the city"}}})}}});
  const std::string prompt = "system: Be brief.\nuser: Tell me of the city\nassistant:";
  const std::string expected =
      loaded().tok->decode(greedy_ids(loaded().tok->encode(prompt, true), 12));
  const json whole = post("/v1/chat/completions",
                          {{"messages", messages}, {"max_tokens", 12}, {"temperature", 0}});
  EXPECT_EQ(whole["object"], "chat.completion");
  EXPECT_EQ(whole["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(whole["choices"][0]["message"]["content"], expected);
  const Reply r = http(port(), "POST", "/v1/chat/completions",
                       json{{"messages", messages},
                            {"max_completion_tokens", 12},
                            {"temperature", 0},
                            {"stream", true}}
                           .dump());
  const std::vector<json> ev = events(r.body);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(ev[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (const json& e : ev) text += e["choices"][0]["delta"].value("content", "");
  EXPECT_EQ(text, expected);
  EXPECT_EQ(ev.back()["choices"][0]["finish_reason"], "length");
}

TEST_F(ServerHttp, RefusesWhatItCannotServe) {
  start(*loaded().tok, {.max_active = 4, .context = 64});
  const auto refused = [&](const std::string& path, const std::string& body, const char* param,
                           int status = 400) {
    const Reply r = http(port(), "POST", path, body);
    EXPECT_EQ(r.status, status) << body << " -> " << r.body;
    const json e = json::parse(r.body);
    EXPECT_TRUE(e["error"]["message"].is_string()) << r.body;
    if (param) {
      EXPECT_EQ(e["error"]["param"], param) << r.body;
    }
  };
  const std::string c = "/v1/completions";
  refused(c, "{not json", nullptr);
  refused(c, "[1, 2]", nullptr);
  refused(c, R"({"max_tokens": 3})", "prompt");
  refused(c, R"({"prompt": 5})", "prompt");
  refused(c, R"({"prompt": ["a", "b"]})", "prompt");
  refused(c, R"({"prompt": [1, -2]})", "prompt");
  refused(c, R"({"prompt": [8192000]})", "prompt");  // outside the vocabulary
  refused(c, R"({"prompt": "a", "n": 2})", "n");
  refused(c, R"({"prompt": "a", "temperature": 3})", "temperature");
  refused(c, R"({"prompt": "a", "temperature": "hot"})", "temperature");
  refused(c, R"({"prompt": "a", "top_p": 0})", "top_p");
  refused(c, R"({"prompt": "a", "max_tokens": -1})", "max_tokens");
  refused(c, R"({"prompt": "a", "max_tokens": 0})", "max_tokens");
  refused(c, R"({"prompt": "a", "stream": true, "stream_options": {"include_usage": 1}})",
          "stream_options.include_usage");
  refused("/v1/chat/completions", R"({"messages": [{"role": "user", "content": [{"type": 5}]}]})",
          "messages[0].content");
  refused(c, R"({"prompt": "a", "stop": [1]})", "stop");
  refused(c, R"({"prompt": "a", "stop": ["a","b","c","d","e"]})", "stop");
  refused(c, R"({"prompt": "a", "logprobs": 2})", "logprobs");
  refused(c, R"({"prompt": "a", "echo": true})", "echo");
  refused(c, R"({"prompt": "a", "stream": "yes"})", "stream");
  std::string long_prompt;
  for (int i = 0; i < 80; ++i) long_prompt += "The city said ";
  refused(c, json{{"prompt", long_prompt}}.dump(), "prompt");  // over the 64-token context
  refused("/v1/chat/completions", R"({"messages": []})", "messages");
  refused("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}]})",
          "messages");  // this tokenizer has no chat template
  refused("/v1/nothing", "{}", nullptr, 404);
  EXPECT_EQ(http(port(), "GET", "/v1/completions").status, 405);
  EXPECT_EQ(http(port(), "POST", c, R"({"prompt": "a"})", "Transfer-Encoding: chunked\r\n").status,
            501);
  EXPECT_EQ(http(port(), "POST", c, "", "X-Big: " + std::string(70000, 'x') + "\r\n").status, 431);
  const Reply health = http(port(), "GET", "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(json::parse(health.body)["status"], "ok");
  const json models = json::parse(http(port(), "GET", "/v1/models").body);
  EXPECT_EQ(models["data"][0]["id"], "kimi-mini");
  // still serving after all that
  // (greedy: a sampled end-of-text would stop it after fewer tokens)
  EXPECT_EQ(post(c, {{"prompt", "The"},
                     {"max_tokens", 2},
                     {"temperature", 0}})["usage"]["completion_tokens"],
            2);
}

TEST(ServerText, PiecesAreWholeCharacters) {
  using tokenizer::incomplete_utf8_tail;
  using tokenizer::valid_utf8;
  const std::string text = "a\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80!";  // aé 日本 😀!
  EXPECT_EQ(valid_utf8(text), text);
  EXPECT_EQ(valid_utf8("a\xFF"
                       "b"),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(valid_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong
  EXPECT_EQ(valid_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(valid_utf8("\xF4\x90\x80\x80").size(), 12u);                          // past U+10FFFF
  EXPECT_EQ(incomplete_utf8_tail("ab\xE6\x97"), 2u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xF0"), 1u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xE6\x97\xA5"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("ab\x97"), 0u);  // a stray continuation: not a start
  // through the model's byte-level tokenizer: every piece valid, together the text
  const std::vector<int32_t> ids = loaded().tok->encode(text, false);
  tokenizer::TextStream stream(*loaded().tok);
  std::string joined;
  for (const int32_t id : ids) {
    const std::string piece = stream.add(id);
    EXPECT_EQ(valid_utf8(piece), piece);
    joined += piece;
  }
  joined += stream.finish();
  EXPECT_EQ(joined, text);
  // a character left incomplete at the end: the byte-level vocabulary has every single byte
  int32_t lead = -1;
  for (int32_t id = 0; id < loaded().tok->vocab_size() && lead < 0; ++id)
    if (loaded().tok->decode({id}) == "\xE6") lead = id;
  ASSERT_GE(lead, 0);
  tokenizer::TextStream cut(*loaded().tok);
  std::string half = cut.add(loaded().tok->encode("x", false).at(0));
  EXPECT_EQ(cut.add(lead), "");  // held back: more bytes may come
  EXPECT_EQ(half + cut.finish(), "x\xEF\xBF\xBD");
}

TEST_F(ServerHttp, NonAsciiOutputIsValidJsonWholeAndStreamed) {
  start(*loaded().tok);
  for (const int seed : {38, 1, 2, 3}) {
    const json body = {
        {"prompt", "\xC3\xA9 \xC3\xBC \xC3\x9F \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80 \xC3\xB1"},
        {"max_tokens", 40},
        {"temperature", 2},
        {"seed", seed}};
    const json whole = post("/v1/completions", body);
    const std::string text = whole["choices"][0]["text"];
    EXPECT_EQ(tokenizer::valid_utf8(text), text);
    json streamed_body = body;
    streamed_body["stream"] = true;
    const Reply r = http(port(), "POST", "/v1/completions", streamed_body.dump());
    std::string joined;
    for (const json& e : events(r.body)) joined += e["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(joined, text);  // same seed: the same answer
  }
}

TEST_F(ServerHttp, ClientsThatLeaveFreeTheirSequence) {
  // without stop tokens: a sampled end-of-text would finish the request before the client leaves
  const NoStopTokenizer no_stop(*loaded().tok);
  start(no_stop, {.max_active = 1, .context = 0, .prefix_cache = 0, .max_waiting = 0});
  for (const bool stream : {false, true}) {
    // a request that would generate for a long time, and a client that leaves at once
    const int fd = connect_to(port());
    const std::string body =
        json{{"prompt", "The jury"}, {"max_tokens", 4000}, {"stream", stream}}.dump();
    const std::string request =
        "POST /v1/completions HTTP/1.1\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\n\r\n" + body;
    ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
    for (int i = 0; i < 3000 && scheduler_->in_flight() == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(scheduler_->in_flight(), 1);
    // the only slot is taken and nothing may wait: another request is refused with 503
    EXPECT_EQ(http(port(), "POST", "/v1/completions", R"({"prompt": "A"})").status, 503);
    const int64_t cancelled = scheduler_->cancelled();
    close(fd);
    // dropped at its next turn, long before its 4000 tokens: it ends as cancelled, not finished
    for (int i = 0; i < 3000 && scheduler_->in_flight() > 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(scheduler_->in_flight(), 0) << (stream ? "streamed" : "whole");
    EXPECT_EQ(scheduler_->cancelled(), cancelled + 1) << (stream ? "streamed" : "whole");
  }
  EXPECT_EQ(
      post("/v1/completions", {{"prompt", "The"}, {"max_tokens", 2}})["usage"]["completion_tokens"],
      2);
}

TEST_F(ServerHttp, ChatMessagesCannotCarryTemplateTokens) {
  const ChatTokenizer chat(*loaded().tok);
  start(chat);
  const std::vector<int32_t> stops = loaded().tok->stop_ids();
  ASSERT_FALSE(stops.empty());
  const std::string special = loaded().tok->decode({stops[0]});  // e.g. <|endoftext|>
  ASSERT_EQ(loaded().tok->encode(special, true).size(), 1u);
  const Reply r =
      http(port(), "POST", "/v1/chat/completions",
           json{{"messages", json::array({{{"role", "system"}, {"content", "Hi."}},
                                          {{"role", "user"}, {"content", "a " + special + " b"}}})}}
               .dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "messages[1].content") << r.body;
}

TEST_F(ServerHttp, Http10ClientsGetACloseDelimitedStream) {
  start(*loaded().tok);
  const Reply r = http(
      port(), "POST", "/v1/completions",
      json{{"prompt", "The jury"}, {"max_tokens", 5}, {"temperature", 0}, {"stream", true}}.dump(),
      "", "HTTP/1.0");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.find("chunked"), std::string::npos);
  std::string joined;
  for (const json& e : events(r.body)) joined += e["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(joined, loaded().tok->decode(greedy_ids(encode("The jury"), 5)));
}

// The command itself: `kda serve --port 0` prints where it listens, answers, and stops cleanly on
// Ctrl-C (SIGINT); bad flags fail with a message.
TEST(ServerCommand, ServesAndStopsOnInterrupt) {
  const testing::ScratchDir dir;
  const std::string log = dir.file("serve.log");
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const std::string binary = KDA_BINARY;
  std::vector<std::string> args = {binary,   "serve", "-m",         kModelDir,
                                   "--port", "0",     "--parallel", "2"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, binary.c_str(), &files, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&files);
  struct KillOnExit {  // a failed assertion must not leave the server running
    pid_t& pid;
    ~KillOnExit() {
      if (pid > 0) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
    }
  } kill_on_exit{pid};
  int port = 0;
  for (int i = 0; i < 300 && port == 0; ++i) {  // up to 30 s for the model to load
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    const size_t at = text.str().find("http://127.0.0.1:");
    if (at != std::string::npos) port = std::atoi(text.str().c_str() + at + 17);
  }
  ASSERT_GT(port, 0) << "no listening line in " << log;
  const Reply r = http(port, "POST", "/v1/completions",
                       R"({"prompt": "The jury said", "max_tokens": 6, "temperature": 0})");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"][0]["text"],
            loaded().tok->decode(greedy_ids(encode("The jury said"), 6)));
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  pid = 0;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  const testing::CommandResult bad = testing::run_kda("serve -m " + kModelDir + " --port 70000");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.output.find("--port must be in 0..65535"), std::string::npos) << bad.output;
  const testing::CommandResult none = testing::run_kda("serve -m " + dir.str());
  EXPECT_EQ(none.status, 1);
  EXPECT_NE(none.output.find("no tokenizer"), std::string::npos) << none.output;
}

}  // namespace
}  // namespace kda::server
