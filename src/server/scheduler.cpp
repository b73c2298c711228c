#include "server/scheduler.h"

#include <chrono>
#include <exception>

#include "core/error.h"

namespace kda::server {
namespace {

Job::Event error_event(std::string message) {
  Job::Event e;
  e.last = true;
  e.error = std::move(message);
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
    // one unit of work for every active sequence, in turn
    for (size_t i = 0; i < active.size();) {
      Entry& e = active[i];
      bool finished = e.job->cancelled();
      if (finished) ++cancelled_;
      try {
        if (!finished) {
          std::string text = e.generation->step();
          const bool last = e.generation->done();
          if (!text.empty() || last) {
            Job::Event ev;
            ev.text = std::move(text);
            ev.last = last;
            if (last) {
              ev.finish = e.generation->finish_reason();
              ev.prompt_tokens = e.generation->prompt_tokens();
              ev.completion_tokens = e.generation->completion_tokens();
              ev.cached_tokens = e.generation->cached_tokens();
            }
            e.job->push(std::move(ev));
          }
          finished = last;
        }
      } catch (const std::exception& ex) {
        e.job->push(error_event(ex.what()));
        finished = true;
      }
      if (finished) {
        active.erase(active.begin() + std::ptrdiff_t(i));
        --in_flight_;
      } else {
        ++i;
      }
    }
  }
  for (Entry& e : active) e.job->push(error_event("the server is shutting down"));
  in_flight_ -= int64_t(active.size());
}

}  // namespace kda::server
