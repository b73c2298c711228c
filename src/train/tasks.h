// Synthetic recall tasks, generated from a seed. Train and test streams come from disjoint seed
// spaces and test examples are never emitted by the train stream (checked by hash).
//   MQAR (Zoology's multi-query associative recall): key-value pairs, then each key queried
//     once at a power-law gap; only the answers are scored.
//   Palindrome: a random string, a separator, then the string reversed (the reversal scored).
//   Stack: push/pop operations; each pop must predict the token on top (pops scored).
#pragma once
#include <cstdint>
#include <future>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

namespace kda::train {

enum class Task { mqar, palindrome, stack };
Task parse_task(const std::string& name);
std::string task_name(Task task);

struct TaskSpec {
  Task task = Task::mqar;
  int64_t vocab = 8192;
  int64_t seq_len = 256;
  int64_t num_kv = 0;  // MQAR pairs (0: seq_len / 8)
};

// One batch: inputs and targets [B, T] (target -1 = not scored).
struct Batch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs, targets;
};

// The index that std::discrete_distribution<int64_t>(weight.begin(), weight.end())(rng) draws
// with libstdc++ (the same uniform draw, the same sums in the same order, so the same examples),
// without building its normalised table: MQAR samples its query gaps one at a time without
// replacement, 256 draws an example at length 2048, and building that table for each draw took
// a batch of 32 from ~13 to ~28 ms (`kda bench tasks`, docs/PERF.md).
int64_t draw_discrete(const std::vector<double>& weight, std::mt19937_64& rng);

// Draws without replacement from fixed weights, one index at a time: the draws of
// draw_discrete over the weights with each drawn index zeroed (the same uniform per draw, the
// first index whose cumulative weight reaches it), in O(log n) a draw on a Fenwick tree instead
// of O(n) sums. Only the summation order differs, so a draw could differ where the uniform lands
// within a rounding of a boundary (a test holds ~10^5 draws equal). MQAR's query gaps at length
// 2048 took most of its ~13 ms a batch this way (docs/PERF.md).
class DrawWithoutReplacement {
 public:
  explicit DrawWithoutReplacement(const std::vector<double>& weight);
  int64_t draw(std::mt19937_64& rng);

 private:
  std::vector<double> tree_;  // 1-based Fenwick sums of the weights not yet drawn
  std::vector<uint8_t> drawn_;
  int64_t n_, top_;  // top_: the highest power of two <= n_
};

class TaskStream {
 public:
  // split 0 = train, 1 = test.
  TaskStream(const TaskSpec& spec, uint64_t seed, int split);
  Batch next(int64_t batch_size);
  // Never yield an example whose hash is in `forbidden` (the test set's).
  void forbid(const std::unordered_set<uint64_t>& hashes) { forbidden_ = hashes; }
  static uint64_t hash_example(const int32_t* inputs, int64_t T);
  // Where the stream stands (for checkpoints) and going back there (for --resume).
  uint64_t position() const { return state_; }
  void seek(uint64_t position) { state_ = position; }

 private:
  // One example from its engine seed (examples of a split step their seeds by
  // kExampleSeedStep, which keeps train seeds even and test seeds odd).
  void make_example(uint64_t seed, int32_t* inputs, int32_t* targets) const;
  static constexpr uint64_t kExampleSeedStep = 0x9E3779B97F4A7C15ull * 2;
  // Threads that make a batch's examples (a few: recall runs train several cells at once).
  static constexpr int64_t kMaxTaskThreads = 4;
  TaskSpec spec_;
  std::vector<double> gap_weight_;  // MQAR: the power-law weight of each query slot
  uint64_t state_;
  std::unordered_set<uint64_t> forbidden_;
};

// A TaskStream whose next batch is made on a second thread while the caller trains on the
// current one (MQAR's generator took ~13 ms a batch of 32 at length 2048 on one thread before
// DrawWithoutReplacement, 1.5-3 ms on two now; the recall models' GPU step is ~8-10 ms).
// The stream is touched by one thread at a time, in order, so the batches are those of the
// stream itself; position() is where the batch not yet handed out starts (for checkpoints).
class PrefetchingStream {
 public:
  PrefetchingStream(TaskStream& stream, int64_t batch_size)
      : stream_(stream), batch_size_(batch_size) {}
  Batch next() {
    Batch b = pending_.valid() ? pending_.get() : stream_.next(batch_size_);
    pending_from_ = stream_.position();
    pending_ = std::async(std::launch::async, [this] { return stream_.next(batch_size_); });
    return b;
  }
  uint64_t position() const { return pending_.valid() ? pending_from_ : stream_.position(); }

 private:
  TaskStream& stream_;
  int64_t batch_size_;
  std::future<Batch> pending_;
  uint64_t pending_from_ = 0;
};

// A fixed test set and the hashes of its examples.
struct TestSet {
  Batch batch;
  std::unordered_set<uint64_t> hashes;
};
TestSet make_test_set(const TaskSpec& spec, uint64_t seed, int64_t examples);

}  // namespace kda::train
