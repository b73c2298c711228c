#include "train/tasks.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/parallel.h"

namespace kda::train {

Task parse_task(const std::string& name) {
  if (name == "mqar") return Task::mqar;
  if (name == "palindrome") return Task::palindrome;
  if (name == "stack") return Task::stack;
  throw Error("unknown task '" + name + "' (mqar, palindrome, stack)");
}

std::string task_name(Task task) {
  switch (task) {
    case Task::mqar:
      return "mqar";
    case Task::palindrome:
      return "palindrome";
    case Task::stack:
      return "stack";
  }
  return "?";
}

int64_t draw_discrete(const std::vector<double>& weight, std::mt19937_64& rng) {
  // libstdc++'s discrete_distribution: fewer than two weights draw nothing
  if (weight.size() < 2) return 0;
  double sum = 0;
  for (double w : weight) sum += w;  // std::accumulate's order
  const double u = std::generate_canonical<double, std::numeric_limits<double>::digits>(rng);
  // the first index whose cumulative probability (weights divided by the sum, summed in order,
  // the last one 1) reaches u: lower_bound over the table, stopped where it is found
  double cumulative = 0;
  const size_t last = weight.size() - 1;
  for (size_t i = 0; i < last; ++i) {
    cumulative += weight[i] / sum;
    if (cumulative >= u) return int64_t(i);
  }
  return int64_t(last);
}

DrawWithoutReplacement::DrawWithoutReplacement(const std::vector<double>& weight)
    : tree_(weight.size() + 1, 0.0), drawn_(weight.size(), 0), n_(int64_t(weight.size())) {
  for (int64_t i = 1; i <= n_; ++i) {  // O(n) build: each node passes its sum to its parent
    tree_[i] += weight[i - 1];
    const int64_t parent = i + (i & -i);
    if (parent <= n_) tree_[parent] += tree_[i];
  }
  top_ = 1;
  while (top_ * 2 <= n_) top_ *= 2;
}

int64_t DrawWithoutReplacement::draw(std::mt19937_64& rng) {
  if (n_ < 2) return 0;  // as draw_discrete: fewer than two weights draw nothing
  double total = 0;
  for (int64_t i = n_; i > 0; i -= i & -i) total += tree_[i];
  const double u = std::generate_canonical<double, std::numeric_limits<double>::digits>(rng);
  // the smallest index whose prefix sum reaches u * total: descend the tree's powers of two
  double rest = u * total;
  int64_t pos = 0;
  for (int64_t step = top_; step > 0; step >>= 1) {
    if (pos + step <= n_ && tree_[pos + step] < rest) {
      pos += step;
      rest -= tree_[pos];
    }
  }
  // pos is 0-based now; past the end (rounding) or on a drawn index (a residue of the sums): the
  // nearest index not yet drawn, forward first
  int64_t index = std::min(pos, n_ - 1);
  if (drawn_[size_t(index)]) {
    int64_t next = index;
    while (next < n_ && drawn_[size_t(next)]) ++next;
    if (next == n_) {
      next = index;
      while (next > 0 && drawn_[size_t(next)]) --next;
    }
    index = next;
  }
  drawn_[size_t(index)] = 1;
  double weight = 0;  // the index's weight: its prefix sum minus the previous one
  for (int64_t i = index + 1; i > 0; i -= i & -i) weight += tree_[i];
  for (int64_t i = index; i > 0; i -= i & -i) weight -= tree_[i];
  for (int64_t i = index + 1; i <= n_; i += i & -i) tree_[i] -= weight;
  return index;
}

TaskStream::TaskStream(const TaskSpec& spec, uint64_t seed, int split) : spec_(spec) {
  require(spec.seq_len >= 8, "task: seq_len must be at least 8");
  require(spec.vocab >= 4, "task: vocab must be at least 4");
  if (spec_.task == Task::mqar) {
    if (spec_.num_kv == 0) spec_.num_kv = spec_.seq_len / 8;
    require(4 * spec_.num_kv <= spec_.seq_len, "mqar: 4 x num_kv must fit in seq_len");
    require(spec_.num_kv <= spec_.vocab / 2 - 1, "mqar: more pairs than keys in the vocabulary");
    // query gaps: slots of the query region, power-law weights (short gaps likelier)
    const int64_t space = (spec_.seq_len + 1 - 2 * spec_.num_kv) / 2;
    const double alpha = 0.01;
    gap_weight_.resize(size_t(space));
    for (int64_t s = 0; s < space; ++s)
      gap_weight_[size_t(s)] = alpha * std::pow(double(s + 1), alpha - 1);
  }
  // disjoint seed spaces for train and test
  state_ = seed * 2 + uint64_t(split);
}

uint64_t TaskStream::hash_example(const int32_t* inputs, int64_t T) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t t = 0; t < T; ++t) {
    h ^= uint64_t(uint32_t(inputs[t]));
    h *= 1099511628211ull;
  }
  return h;
}

Batch TaskStream::next(int64_t batch_size) {
  Batch b;
  b.B = batch_size;
  b.T = spec_.seq_len;
  const int64_t T = b.T;
  b.inputs.resize(b.B * T);
  b.targets.resize(b.B * T);
  // An example depends on its engine seed only, so the candidates for the next seeds are made
  // in parallel and then kept in order, skipping forbidden ones: the stream a one-thread loop
  // makes (MQAR at length 2048 takes ~0.4 ms an example, most of it in draw_discrete's sums).
  std::vector<int32_t> inputs, targets;
  for (int64_t filled = 0; filled < b.B;) {
    const int64_t n = b.B - filled;
    inputs.resize(n * T);
    targets.resize(n * T);
    const uint64_t first = state_;
    const int64_t threads = std::min<int64_t>({n, kMaxTaskThreads, hardware_threads()});
    std::vector<std::thread> workers;
    auto make_share = [&](int64_t w) {
      for (int64_t j = w; j < n; j += threads)
        make_example(first + uint64_t(j) * kExampleSeedStep, &inputs[j * T], &targets[j * T]);
    };
    for (int64_t w = 1; w < threads; ++w) workers.emplace_back(make_share, w);
    make_share(0);
    for (std::thread& t : workers) t.join();
    state_ = first + uint64_t(n) * kExampleSeedStep;
    for (int64_t j = 0; j < n; ++j) {
      if (!forbidden_.empty() && forbidden_.count(hash_example(&inputs[j * T], T))) continue;
      std::copy_n(&inputs[j * T], T, &b.inputs[filled * T]);
      std::copy_n(&targets[j * T], T, &b.targets[filled * T]);
      ++filled;
    }
  }
  return b;
}

void TaskStream::make_example(uint64_t seed, int32_t* inputs, int32_t* targets) const {
  std::mt19937_64 rng(seed);
  const int64_t T = spec_.seq_len, V = spec_.vocab;
  std::fill(targets, targets + T, -1);
  // sequences are built one longer than T, then shifted: inputs = seq[:-1], targets = seq[1:]
  std::vector<int32_t> seq(T + 1, 0), label(T + 1, -1);
  auto uniform = [&](int64_t lo, int64_t hi) {  // [lo, hi)
    return int32_t(std::uniform_int_distribution<int64_t>(lo, hi - 1)(rng));
  };
  if (spec_.task == Task::mqar) {
    const int64_t n = spec_.num_kv, context = 2 * n;
    std::vector<int32_t> keys(V / 2 - 1), values(V - V / 2);
    std::iota(keys.begin(), keys.end(), 1);
    std::iota(values.begin(), values.end(), int32_t(V / 2));
    std::shuffle(keys.begin(), keys.end(), rng);
    std::shuffle(values.begin(), values.end(), rng);
    for (int64_t i = 0; i < n; ++i) {
      seq[2 * i] = keys[i];
      seq[2 * i + 1] = values[i];
    }
    // query gaps: distinct slots in the query region (gap_weight_)
    DrawWithoutReplacement slots(gap_weight_);
    std::vector<int64_t> gaps;
    for (int64_t i = 0; i < n; ++i) gaps.push_back(slots.draw(rng));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = context + 2 * gaps[i];
      seq[pos] = keys[i];
      label[pos + 1] = values[i];
    }
  } else if (spec_.task == Task::palindrome) {
    // tokens from [2, V); 1 is the separator
    const int64_t n = T / 2;
    for (int64_t i = 0; i < n; ++i) seq[i] = uniform(2, V);
    seq[n] = 1;
    for (int64_t i = 0; i < T - n; ++i) {
      const int64_t pos = n + 1 + i;
      if (pos > T) break;
      seq[pos] = i < n ? seq[n - 1 - i] : 0;
      if (i < n) label[pos] = seq[pos];
    }
  } else {
    // push = a value token in [2, V); pop = token 1, whose target is the popped value
    std::vector<int32_t> stack;
    for (int64_t pos = 0; pos <= T; ++pos) {
      const bool pop = !stack.empty() && (uniform(0, 2) == 0 || pos + int64_t(stack.size()) > T);
      if (pop) {
        seq[pos] = 1;
        if (pos + 1 <= T) {
          label[pos + 1] = stack.back();  // the token after a pop reveals the popped value
          seq[pos + 1] = stack.back();
        }
        stack.pop_back();
        ++pos;
      } else {
        seq[pos] = uniform(2, V);
        stack.push_back(seq[pos]);
      }
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    inputs[t] = seq[t];
    targets[t] = label[t + 1];
  }
}

TestSet make_test_set(const TaskSpec& spec, uint64_t seed, int64_t examples) {
  TestSet set;
  TaskStream stream(spec, seed, 1);
  set.batch = stream.next(examples);
  for (int64_t i = 0; i < examples; ++i)
    set.hashes.insert(TaskStream::hash_example(&set.batch.inputs[i * spec.seq_len], spec.seq_len));
  return set;
}

}  // namespace kda::train
