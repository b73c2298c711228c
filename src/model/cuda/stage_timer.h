// Where a forward pass spends its time, by stage (KDA, MLA, MoE, ...): with KDA_CUDA_PROFILE set
// in the environment, each mark() synchronises the stream and charges the wall time since the
// previous mark to a stage; report() prints the totals to stderr. Off (no synchronisation, no
// cost) otherwise.
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

namespace kda::model::cuda {

class StageTimer {
 public:
  StageTimer() : enabled_(std::getenv("KDA_CUDA_PROFILE") != nullptr) {}
  bool enabled() const { return enabled_; }
  void start(cudaStream_t stream) {
    if (!enabled_) return;
    cudaStreamSynchronize(stream);
    last_ = Clock::now();
  }
  void mark(cudaStream_t stream, const char* stage) {
    if (!enabled_) return;
    cudaStreamSynchronize(stream);
    const auto now = Clock::now();
    Total& t = totals_[stage];
    t.ms += std::chrono::duration<double, std::milli>(now - last_).count();
    t.calls++;
    last_ = now;
  }
  void reset() { totals_.clear(); }  // e.g. after warm-up steps (lazy module loading)
  void report(const std::string& title) const {
    if (!enabled_ || totals_.empty()) return;
    std::fprintf(stderr, "PROFILE %s\n", title.c_str());
    for (const auto& [stage, t] : totals_)
      std::fprintf(stderr, "PROFILE   %-16s %10.3f ms  %8lld calls\n", stage.c_str(), t.ms,
                   (long long)t.calls);
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Total {
    double ms = 0;
    long long calls = 0;
  };
  bool enabled_ = false;
  Clock::time_point last_;
  std::map<std::string, Total> totals_;
};

}  // namespace kda::model::cuda
