#include "ops/delta_rule/cpu/chunk_math.h"

#include <algorithm>
#include <cmath>

#include "core/blas.h"
#include "core/fast_math.h"

namespace kda::ops::detail {

std::vector<int64_t> plan_chunks(const DeltaRuleInputs<float>& in, int64_t seq_start,
                                 int64_t length, int64_t hv, int max_chunk) {
  std::vector<int64_t> starts;
  const DeltaRuleShape& s = in.shape;
  const int64_t gw = s.gate_width();
  if (gw == 0) {
    for (int64_t t = 0; t < length; t += max_chunk) starts.push_back(t);
    starts.push_back(length);
    return starts;
  }
  std::vector<float> G(gw);
  int64_t t = 0;
  while (t < length) {
    starts.push_back(t);
    std::fill(G.begin(), G.end(), 0.0f);
    int64_t c = 0;
    while (c < max_chunk && t + c < length) {
      const float* g = in.g + ((seq_start + t + c) * s.HV + hv) * gw;
      float lowest = 0.0f, highest = 0.0f;  // min/max reductions vectorise; a branch would not
      for (int64_t i = 0; i < gw; ++i) {
        const float next = G[i] + g[i];
        lowest = std::min(lowest, next);
        highest = std::max(highest, next);
      }
      const bool fits = lowest >= -kMaxNegativeLogDecay && highest <= kMaxPositiveLogGrowth;
      if (!fits && c > 0) break;  // a single token always forms a chunk
      for (int64_t i = 0; i < gw; ++i) G[i] += g[i];
      ++c;
    }
    t += c;
  }
  starts.push_back(length);
  return starts;
}

ChunkWork::ChunkWork(int64_t K_, int64_t V_, int64_t cap_) : K(K_), V(V_), cap(cap_) {
  for (auto* b : {&q, &k, &G, &E, &Einv, &Qt, &Kt, &Ki, &Ktb, &W}) b->resize(cap * K);
  for (auto* b : {&v, &Vb, &U, &D}) b->resize(cap * V);
  for (auto* b : {&Akk, &Aqk, &Tm}) b->resize(cap * cap);
  beta.resize(cap);
  EC.resize(K);
}

void ChunkWork::load_and_prepare(const DeltaRuleInputs<float>& in, int64_t seq_start, int64_t t0,
                                 int64_t C_, int64_t h, int64_t hv) {
  C = C_;
  const DeltaRuleShape& s = in.shape;
  const int64_t H = s.H, HV = s.HV, gw = s.gate_width();
  for (int64_t i = 0; i < C; ++i) {
    const int64_t tok = seq_start + t0 + i;
    std::copy_n(in.q + (tok * H + h) * K, K, &q[i * K]);
    std::copy_n(in.k + (tok * H + h) * K, K, &k[i * K]);
    std::copy_n(in.v + (tok * HV + hv) * V, V, &v[i * V]);
    beta[i] = in.beta[tok * HV + hv];
    float* Gi = &G[i * K];
    const float* prev = i ? &G[(i - 1) * K] : nullptr;
    if (gw == 0) {
      std::fill_n(Gi, K, 0.0f);
    } else {
      const float* g = in.g + (tok * HV + hv) * gw;
      // plan_chunks keeps a chunk's G within [-60, 20] but for a chunk of one token, whose log
      // decay may pass fast_exp's clamp (-87): held there, E * Einv stays 1, and a decay of
      // e^-87 instead of a stronger one changes nothing fp32 can hold
      for (int64_t c = 0; c < K; ++c)
        Gi[c] = std::clamp((prev ? prev[c] : 0.0f) + g[gw == 1 ? 0 : c], -87.0f, 87.0f);
    }
  }
  {
    // separate restrict pointers: the members' buffers never alias, and saying so lets the
    // loop vectorise (with fast_exp inlined)
    const float* __restrict g = G.data();
    const float* __restrict qs = q.data();
    const float* __restrict ks = k.data();
    float* __restrict e = E.data();
    float* __restrict einv = Einv.data();
    float* __restrict qt = Qt.data();
    float* __restrict kt = Kt.data();
    float* __restrict ki = Ki.data();
#pragma omp simd
    for (int64_t i = 0; i < C * K; ++i) {
      const float ei = fast_exp(g[i]), inv = fast_exp(-g[i]);
      e[i] = ei;
      einv[i] = inv;
      qt[i] = qs[i] * ei;
      kt[i] = ks[i] * ei;
      ki[i] = ks[i] * inv;
    }
  }
  for (int64_t c = 0; c < K; ++c) EC[c] = E[(C - 1) * K + c];

  // pairwise-decayed products, masked to the causal triangle
  gemm_nt(int(C), int(C), int(K), 1.0f, Kt.data(), int(K), Ki.data(), int(K), 0.0f, Akk.data(),
          int(C));
  gemm_nt(int(C), int(C), int(K), 1.0f, Qt.data(), int(K), Ki.data(), int(K), 0.0f, Aqk.data(),
          int(C));
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = i; j < C; ++j) Akk[i * C + j] = 0.0f;
    for (int64_t j = i + 1; j < C; ++j) Aqk[i * C + j] = 0.0f;
  }

  // Tm = (I + diag(beta) Akk)^-1 by forward substitution, row by row:
  // Tm[i, :] = e_i - beta_i * sum_{m < i} Akk[i, m] Tm[m, :]
  std::fill_n(Tm.data(), C * C, 0.0f);
  for (int64_t i = 0; i < C; ++i) {
    float* row = &Tm[i * C];
    for (int64_t m = 0; m < i; ++m) {
      const float a = -beta[i] * Akk[i * C + m];
      if (a == 0.0f) continue;
      const float* src = &Tm[m * C];
      for (int64_t j = 0; j <= m; ++j) row[j] += a * src[j];
    }
    row[i] = 1.0f;
  }

  for (int64_t i = 0; i < C; ++i) {
    for (int64_t c = 0; c < V; ++c) Vb[i * V + c] = beta[i] * v[i * V + c];
    for (int64_t c = 0; c < K; ++c) Ktb[i * K + c] = beta[i] * Kt[i * K + c];
  }
  gemm_nn(int(C), int(V), int(C), 1.0f, Tm.data(), int(C), Vb.data(), int(V), 0.0f, U.data(),
          int(V));
  gemm_nn(int(C), int(K), int(C), 1.0f, Tm.data(), int(C), Ktb.data(), int(K), 0.0f, W.data(),
          int(K));
}

void ChunkWork::compute_d(const float* S0) {
  std::copy_n(U.data(), C * V, D.data());
  gemm_nn(int(C), int(V), int(K), -1.0f, W.data(), int(K), S0, int(V), 1.0f, D.data(), int(V));
}

void ChunkWork::compute_output(const float* S0, float scale, float* o, int64_t ld_o) const {
  gemm_nn(int(C), int(V), int(K), scale, Qt.data(), int(K), S0, int(V), 0.0f, o, int(ld_o));
  gemm_nn(int(C), int(V), int(C), scale, Aqk.data(), int(C), D.data(), int(V), 1.0f, o, int(ld_o));
}

void ChunkWork::advance_state(float* S) const {
  for (int64_t c = 0; c < K; ++c) {
    for (int64_t j = 0; j < V; ++j) S[c * V + j] *= EC[c];
  }
  // Kg = Ki * E_C (rows scaled channel-wise): K * exp(G_C - G) <= 1 for decaying gates
  thread_local std::vector<float> Kg;
  Kg.resize(C * K);
  for (int64_t i = 0; i < C; ++i)
    for (int64_t c = 0; c < K; ++c) Kg[i * K + c] = Ki[i * K + c] * EC[c];
  gemm_tn(int(K), int(V), int(C), 1.0f, Kg.data(), int(K), D.data(), int(V), 1.0f, S, int(V));
}

}  // namespace kda::ops::detail
