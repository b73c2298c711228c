// SwiGLU experts: the dense MLP, and routed experts evaluated per expert over its tokens.
#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/moe/moe.h"
#include "ops/nn/nn.h"

namespace kda::ops {
namespace {

template <class V>
auto* grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// act [n, I] = silu(h[:, :I]) * h[:, I:] for h [n, 2I]
void swiglu_activate(const float* h, int64_t n, int64_t I, float* act) {
  for (int64_t r = 0; r < n; ++r) {
    const float* g = h + r * 2 * I;
    const float* u = g + I;
    float* a = act + r * I;
    for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

}  // namespace

void swiglu_mlp(const float* x, int64_t T, int64_t D, int64_t I, const SwigluWeights& w, float* y,
                MoeWorkspace& ws) {
  require(T >= 0 && D >= 1 && I >= 1, "swiglu_mlp: sizes must be positive");
  require(w.gate_up && w.down, "swiglu_mlp: null weights");
  if (T == 0) return;
  float* hidden = grow(ws.hidden, size_t(T * 2 * I));
  float* act = grow(ws.act, size_t(T * I));
  linear(x, T, D, w.gate_up, 2 * I, nullptr, hidden);
  swiglu_activate(hidden, T, I, act);
  linear(act, T, I, w.down, D, nullptr, y);
}

void moe_experts_accumulate(const float* x, int64_t T, int64_t D, int64_t I,
                            std::span<const SwigluWeights> experts, const int32_t* ids,
                            const float* weights, int64_t top_k, float* y, MoeWorkspace& ws) {
  const int64_t E = int64_t(experts.size());
  require(T >= 0 && D >= 1 && I >= 1 && top_k >= 1 && E >= 1,
          "moe_experts_accumulate: sizes must be positive");
  if (T == 0) return;
  const int64_t pairs = T * top_k;
  // Counting sort of the (token, slot) pairs by expert.
  int32_t* count = grow(ws.count, size_t(E));
  int32_t* offset = grow(ws.offset, size_t(E + 1));
  int32_t* token = grow(ws.token, size_t(pairs));
  int32_t* slot = grow(ws.slot, size_t(pairs));
  std::fill_n(count, E, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    require(ids[p] >= 0 && ids[p] < E,
            "moe_experts_accumulate: expert id " + std::to_string(ids[p]) + " out of range");
    ++count[ids[p]];
  }
  offset[0] = 0;
  for (int64_t e = 0; e < E; ++e) offset[e + 1] = offset[e] + count[e];
  std::fill_n(count, E, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int32_t e = ids[p];
    const int32_t at = offset[e] + count[e]++;
    token[at] = int32_t(p / top_k);
    slot[at] = int32_t(p);
  }
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max<int64_t>(most, offset[e + 1] - offset[e]);
  float* rows = grow(ws.rows, size_t(most * D));
  float* hidden = grow(ws.hidden, size_t(most * 2 * I));
  float* act = grow(ws.act, size_t(most * I));
  float* out = grow(ws.out, size_t(most * D));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = offset[e + 1] - offset[e];
    if (n == 0) continue;
    require(experts[e].gate_up && experts[e].down, "moe_experts_accumulate: null expert weights");
    const int32_t* tok = token + offset[e];
    const float* in = x + int64_t(tok[0]) * D;
    if (n > 1) {  // gather this expert's tokens into contiguous rows
      for (int64_t r = 0; r < n; ++r) std::copy_n(x + int64_t(tok[r]) * D, D, rows + r * D);
      in = rows;
    }
    linear(in, n, D, experts[e].gate_up, 2 * I, nullptr, hidden);
    swiglu_activate(hidden, n, I, act);
    linear(act, n, I, experts[e].down, D, nullptr, out);
    for (int64_t r = 0; r < n; ++r) {
      const float w = weights[slot[offset[e] + r]];
      float* yt = y + int64_t(tok[r]) * D;
      const float* o = out + r * D;
      for (int64_t d = 0; d < D; ++d) yt[d] += w * o[d];
    }
  }
}

}  // namespace kda::ops
