// Serves many sequences at once on one model: requests queue, up to `max_active` run at a time,
// and one worker thread advances every active sequence by one unit of work per round (a piece of
// its prompt, or one token), so a long prompt or a long answer never holds the others up. The
// round's decode steps go to the model as one batch (CausalLM::decode_batch: on the CPU Kimi
// Linear one matrix product per weight for all of them, the weights read once); prompt pieces
// are fed one sequence at a time. Each sequence has its own session (fixed KDA states, growing
// MLA cache); the weights are shared.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "model/causal_lm.h"
#include "server/generation.h"
#include "tokenizer/tokenizer.h"

namespace kda::server {

// What a request's handler reads back: text pieces as they come, then the end.
class Job {
 public:
  struct Event {
    std::string text;
    bool last = false;
    std::string error;  // set on the last event when generation failed
    FinishReason finish = FinishReason::running;
    int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  };
  // Blocks until the next event.
  Event next();
  // The next event, or nothing when none came within `ms` milliseconds.
  std::optional<Event> next_for(int64_t ms);
  // The client went away: the scheduler drops the sequence at its next turn.
  void cancel();
  bool cancelled() const;

 private:
  friend class Scheduler;
  void push(Event e);
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Event> events_;
  bool cancelled_ = false;
};

// submit()'s refusal when the queue is full or the scheduler is stopping: the server's 503.
struct Unavailable : Error {
  using Error::Error;
};

struct SchedulerOptions {
  int64_t max_active = 4;     // sequences generating at once; more wait in the queue
  int64_t context = 0;        // per-sequence context limit (0: the model's)
  int64_t prefix_cache = 16;  // snapshots kept for prompts that start alike (0: none)
  int64_t max_waiting = 64;   // requests queued beyond max_active; more get Unavailable
};

class Scheduler {
 public:
  Scheduler(const model::CausalLM& lm, const tokenizer::Tokenizer& tok, SchedulerOptions options);
  ~Scheduler();  // shutdown()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Checks the request (throws kda::Error: empty or too long a prompt, bad settings; Unavailable
  // when the queue is full or the scheduler stopping) and queues it; the caller reads the job's
  // events. The sequence's memory is allocated only once it is admitted.
  std::shared_ptr<Job> submit(GenerationRequest request);
  // Stops the worker: queued and running jobs end with an error event, later submits throw.
  void shutdown();
  const SchedulerOptions& options() const { return options_; }
  // Requests queued or generating (for tests and monitoring).
  int64_t in_flight() const { return in_flight_; }
  // Sequences dropped because their client went away.
  int64_t cancelled() const { return cancelled_; }

 private:
  struct Entry {
    std::shared_ptr<Job> job;
    std::unique_ptr<Generation> generation;
  };
  void run();

  const model::CausalLM& lm_;
  const tokenizer::Tokenizer& tok_;
  SchedulerOptions options_;
  int64_t context_limit_ = 0;  // what a session made with options_.context holds
  std::mutex mutex_;           // the queue and stopping_
  PrefixCache prefix_cache_;   // the worker's alone, as the model is
  std::condition_variable wake_;
  std::deque<Entry> waiting_;
  bool stopping_ = false;
  std::atomic<int64_t> in_flight_{0}, cancelled_{0};
  std::thread worker_;
};

}  // namespace kda::server
