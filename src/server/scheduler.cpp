#include "server/scheduler.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <optional>
#include <vector>

#include "core/error.h"

namespace kda::server {
namespace {

Job::Event error_event(std::string message) {
  Job::Event e;
  e.last = true;
  e.error = std::move(message);
  return e;
}

// The text a step made final; the last one carries the finish reason and the token counts.
Job::Event text_event(std::string text, const Generation& g) {
  Job::Event e;
  e.text = std::move(text);
  e.last = g.done();
  if (e.last) {
    e.finish = g.finish_reason();
    e.prompt_tokens = g.prompt_tokens();
    e.completion_tokens = g.completion_tokens();
    e.cached_tokens = g.cached_tokens();
  }
  return e;
}

}  // namespace

Job::Event Job::next() {
  std::unique_lock<std::mutex> lock(mutex_);
  ready_.wait(lock, [&] { return !events_.empty(); });
  Event e = std::move(events_.front());
  events_.pop_front();
  return e;
}

std::optional<Job::Event> Job::next_for(int64_t ms) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!ready_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return !events_.empty(); }))
    return std::nullopt;
  Event e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void Job::cancel() {
  std::lock_guard<std::mutex> lock(mutex_);
  cancelled_ = true;
}

bool Job::cancelled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cancelled_;
}

void Job::push(Event e) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(std::move(e));
  }
  ready_.notify_one();
}

Scheduler::Scheduler(const model::CausalLM& lm, const tokenizer::Tokenizer& tok,
                     SchedulerOptions options)
    : lm_(lm), tok_(tok), options_(options), prefix_cache_(options.prefix_cache) {
  require(options_.max_active >= 1, "the scheduler needs at least one active sequence");
  require(options_.max_waiting >= 0, "the scheduler's queue bound must be >= 0");
  context_limit_ = Generation::context_limit(lm, options_.context);  // a bad --ctx fails here
  worker_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() {
  shutdown();
}

void Scheduler::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  for (Entry& e : waiting_) e.job->push(error_event("the server is shutting down"));
  in_flight_ -= int64_t(waiting_.size());
  waiting_.clear();
}

std::shared_ptr<Job> Scheduler::submit(GenerationRequest request) {
  // checked here, on the caller's thread, so that a bad request fails before it is queued
  auto generation = std::make_unique<Generation>(lm_, tok_, std::move(request), options_.context,
                                                 context_limit_, &prefix_cache_);
  auto job = std::make_shared<Job>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw Unavailable("the server is shutting down");
    if (in_flight_ >= options_.max_active + options_.max_waiting)
      throw Unavailable("too many requests (" + std::to_string(in_flight_) +
                        " generating or waiting); try again later");
    waiting_.push_back({job, std::move(generation)});
    ++in_flight_;
  }
  wake_.notify_one();
  return job;
}

void Scheduler::run() {
  std::vector<Entry> active;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !waiting_.empty() || !active.empty(); });
      if (stopping_) break;
      while (!waiting_.empty() && int64_t(active.size()) < options_.max_active) {
        active.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
    }
    // one unit of work for every active sequence: prefill pieces in turn, then every sequence's
    // decode step in one model call
    std::vector<bool> finished(active.size(), false);
    std::vector<model::Session*> sessions;
    std::vector<int32_t> ids;
    std::vector<size_t> fed;  // active index of each batch row
    for (size_t i = 0; i < active.size(); ++i) {
      Entry& e = active[i];
      if (e.job->cancelled()) {
        ++cancelled_;
        finished[i] = true;
        continue;
      }
      try {
        std::string text = e.generation->advance();
        const bool last = e.generation->done();
        if (!text.empty() || last) e.job->push(text_event(std::move(text), *e.generation));
        finished[i] = last;
        if (const std::optional<int32_t> id = e.generation->pending_token()) {
          sessions.push_back(&e.generation->session());
          ids.push_back(*id);
          fed.push_back(i);
        }
      } catch (const std::exception& ex) {
        e.job->push(error_event(ex.what()));
        finished[i] = true;
      }
    }
    if (!sessions.empty()) {
      try {
        const Tensor logits = lm_.decode_batch(sessions, ids);
        const int64_t vocab = logits.dim(1);
        for (size_t r = 0; r < fed.size(); ++r) {
          Tensor row(DType::f32, {1, vocab});
          std::copy_n(logits.f32() + int64_t(r) * vocab, vocab, row.f32());
          active[fed[r]].generation->accept_logits(std::move(row));
        }
      } catch (const std::exception& ex) {
        // past decode_batch's checks (which the generations' own limits keep from failing) an
        // error leaves every session of the batch half-advanced: all of them end
        for (const size_t i : fed) {
          active[i].job->push(error_event(ex.what()));
          finished[i] = true;
        }
      }
    }
    for (size_t i = active.size(); i-- > 0;) {
      if (!finished[i]) continue;
      active.erase(active.begin() + std::ptrdiff_t(i));
      --in_flight_;
    }
  }
  for (Entry& e : active) e.job->push(error_event("the server is shutting down"));
  in_flight_ -= int64_t(active.size());
}

}  // namespace kda::server
