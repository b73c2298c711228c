// Chunked fp32 backward of the delta-rule family. For each (sequence, value head): a forward
// walk stores every chunk's entering state S0, then a backward walk carries dS (the gradient
// of the state leaving the chunk) and differentiates the chunk algebra of chunk_math.h:
//
//   dD  = Aqk^T dO' + Kg dS                       (dO' = scale dO, Kg = K exp(G_C - G))
//   dS0 = diag(E_C) dS + Qt^T dO' - W^T dD         (the previous chunk's dS)
//   dTm = dD (beta V)^T - dD S0^T (beta Kt)^T,    dL = -Tm^T dTm Tm^T
//
// and the pairwise decays exp(G_i - G_j) give dG = Qt.dQt + Kt.dKt - Ki.dKi (all "totals"),
// reverse-cumsummed into dg. Parallel over (sequence, q/k head): the value heads of a group
// share dq and dk, so they run in one job.
#include <algorithm>
#include <vector>

#include "core/blas.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/common/sequences.h"
#include "ops/delta_rule/cpu/chunk_math.h"
#include "ops/delta_rule/cpu/validate.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops {
namespace {

struct BackwardWork {
  std::vector<float> dO, dD, dAqk, dQt, dKg, Kg, dW, dTm, dVb, dKtb, tmp, dL, dAkk, dKt, dKi, dG,
      dS0, dGC;
  BackwardWork(int64_t K, int64_t V, int64_t cap) {
    for (auto* b : {&dO, &dD, &dVb}) b->resize(cap * V);
    for (auto* b : {&dQt, &dKg, &Kg, &dW, &dKtb, &dKt, &dKi, &dG}) b->resize(cap * K);
    for (auto* b : {&dAqk, &dTm, &tmp, &dL, &dAkk}) b->resize(cap * cap);
    dS0.resize(K * V);
    dGC.resize(K);
  }
};

// Gradients of one chunk. `dS` is the gradient of the state leaving the chunk; on return
// `bw.dS0` holds the gradient of the state entering it.
void chunk_backward(const DeltaRuleInputs<float>& in, detail::ChunkWork& w, BackwardWork& bw,
                    const float* S0, const float* dS, const float* d_o, int64_t seq_start,
                    int64_t t0, int64_t h, int64_t hv, float scale,
                    const DeltaRuleGrads<float>& gr) {
  const DeltaRuleShape& s = in.shape;
  const int C = int(w.C), K = int(w.K), V = int(w.V);
  const int64_t H = s.H, HV = s.HV, gw = s.gate_width();

  for (int i = 0; i < C; ++i) {
    const float* src = d_o + ((seq_start + t0 + i) * HV + hv) * V;
    for (int j = 0; j < V; ++j) bw.dO[i * V + j] = scale * src[j];
    for (int c = 0; c < K; ++c) bw.Kg[i * K + c] = w.Ki[i * K + c] * w.EC[c];
  }
  // dD = Aqk^T dO' + Kg dS
  gemm_tn(C, V, C, 1.0f, w.Aqk.data(), C, bw.dO.data(), V, 0.0f, bw.dD.data(), V);
  gemm_nn(C, V, K, 1.0f, bw.Kg.data(), K, dS, V, 1.0f, bw.dD.data(), V);
  // dS0 = diag(E_C) dS + Qt^T dO' - W^T dD
  for (int c = 0; c < K; ++c)
    for (int j = 0; j < V; ++j) bw.dS0[c * V + j] = w.EC[c] * dS[c * V + j];
  gemm_tn(K, V, C, 1.0f, w.Qt.data(), K, bw.dO.data(), V, 1.0f, bw.dS0.data(), V);
  gemm_tn(K, V, C, -1.0f, w.W.data(), K, bw.dD.data(), V, 1.0f, bw.dS0.data(), V);
  // gradients of the output and state-update products
  gemm_nt(C, C, V, 1.0f, bw.dO.data(), V, w.D.data(), V, 0.0f, bw.dAqk.data(), C);
  for (int i = 0; i < C; ++i)
    for (int j = i + 1; j < C; ++j) bw.dAqk[i * C + j] = 0.0f;
  gemm_nt(C, K, V, 1.0f, bw.dO.data(), V, S0, V, 0.0f, bw.dQt.data(), K);
  gemm_nt(C, K, V, 1.0f, w.D.data(), V, dS, V, 0.0f, bw.dKg.data(), K);
  for (int c = 0; c < K; ++c) {
    float acc = 0.0f;
    for (int j = 0; j < V; ++j) acc += dS[c * V + j] * S0[c * V + j];
    bw.dGC[c] = w.EC[c] * acc;
  }
  // D = U - W S0 with U = Tm Vb, W = Tm Ktb
  gemm_nt(C, K, V, -1.0f, bw.dD.data(), V, S0, V, 0.0f, bw.dW.data(), K);
  gemm_nt(C, C, V, 1.0f, bw.dD.data(), V, w.Vb.data(), V, 0.0f, bw.dTm.data(), C);
  gemm_nt(C, C, K, 1.0f, bw.dW.data(), K, w.Ktb.data(), K, 1.0f, bw.dTm.data(), C);
  gemm_tn(C, V, C, 1.0f, w.Tm.data(), C, bw.dD.data(), V, 0.0f, bw.dVb.data(), V);
  gemm_tn(C, K, C, 1.0f, w.Tm.data(), C, bw.dW.data(), K, 0.0f, bw.dKtb.data(), K);
  // Tm = (I + L)^-1  =>  dL = -Tm^T dTm Tm^T, strictly lower
  gemm_tn(C, C, C, 1.0f, w.Tm.data(), C, bw.dTm.data(), C, 0.0f, bw.tmp.data(), C);
  gemm_nt(C, C, C, -1.0f, bw.tmp.data(), C, w.Tm.data(), C, 0.0f, bw.dL.data(), C);
  for (int i = 0; i < C; ++i) {
    float db = 0.0f;
    for (int j = 0; j < i; ++j) {
      db += bw.dL[i * C + j] * w.Akk[i * C + j];
      bw.dAkk[i * C + j] = w.beta[i] * bw.dL[i * C + j];
    }
    for (int j = i; j < C; ++j) bw.dAkk[i * C + j] = 0.0f;
    float* dv = gr.dv + ((seq_start + t0 + i) * HV + hv) * V;
    for (int j = 0; j < V; ++j) {
      db += bw.dVb[i * V + j] * w.v[i * V + j];
      dv[j] = w.beta[i] * bw.dVb[i * V + j];
    }
    for (int c = 0; c < K; ++c) {
      db += bw.dKtb[i * K + c] * w.Kt[i * K + c];
      bw.dKt[i * K + c] = w.beta[i] * bw.dKtb[i * K + c];
    }
    gr.dbeta[(seq_start + t0 + i) * HV + hv] = db;
  }
  // totals through the pairwise products Akk = Kt Ki^T, Aqk = Qt Ki^T
  gemm_nn(C, K, C, 1.0f, bw.dAkk.data(), C, w.Ki.data(), K, 1.0f, bw.dKt.data(), K);
  gemm_nn(C, K, C, 1.0f, bw.dAqk.data(), C, w.Ki.data(), K, 1.0f, bw.dQt.data(), K);
  gemm_tn(C, K, C, 1.0f, bw.dAqk.data(), C, w.Qt.data(), K, 0.0f, bw.dKi.data(), K);
  gemm_tn(C, K, C, 1.0f, bw.dAkk.data(), C, w.Kt.data(), K, 1.0f, bw.dKi.data(), K);

  for (int i = 0; i < C; ++i) {
    const int64_t tok = seq_start + t0 + i;
    float* dq = gr.dq + (tok * H + h) * K;
    float* dk = gr.dk + (tok * H + h) * K;
    for (int c = 0; c < K; ++c) {
      const int64_t x = int64_t(i) * K + c;
      dq[c] += bw.dQt[x] * w.E[x];
      dk[c] += bw.dKt[x] * w.E[x] + (bw.dKi[x] + bw.dKg[x] * w.EC[c]) * w.Einv[x];
      const float kg = bw.Kg[x];
      bw.dG[x] = bw.dQt[x] * w.Qt[x] + bw.dKt[x] * w.Kt[x] - bw.dKi[x] * w.Ki[x] - bw.dKg[x] * kg;
      bw.dGC[c] += bw.dKg[x] * kg;
    }
  }
  if (gw == 0 || !gr.dg) return;
  // G_i = sum_{t <= i} g_t and G_C = G_{C-1}: dg_t = dG_C + sum_{i >= t} dG_i
  std::vector<float>& run = bw.dGC;  // reused as the running suffix sum
  for (int i = C - 1; i >= 0; --i) {
    float* dg = gr.dg + ((seq_start + t0 + i) * HV + hv) * gw;
    float total = 0.0f;
    for (int c = 0; c < K; ++c) {
      run[c] += bw.dG[int64_t(i) * K + c];
      total += run[c];
      if (gw != 1) dg[c] = run[c];
    }
    if (gw == 1) dg[0] = total;
  }
}

}  // namespace

void delta_rule_chunk_backward(const DeltaRuleInputs<float>& in, const float* d_o,
                               const float* d_ht, const DeltaRuleGrads<float>& gr, int chunk) {
  const SequenceLayout seqs = detail::validate_inputs(in, chunk);
  const DeltaRuleShape& s = in.shape;
  require(d_o && gr.dq && gr.dk && gr.dv && gr.dbeta,
          "delta rule backward: d_o, dq, dk, dv and dbeta are required");
  require_finite(d_o, s.B * s.T * s.HV * s.V, "d_o");
  const int64_t N = seqs.num_sequences();
  if (d_ht) require_finite(d_ht, N * s.HV * s.K * s.V, "d_ht");
  const int64_t K = s.K, V = s.V, H = s.H, HV = s.HV, group = HV / H;
  const float scale = float(s.effective_scale());

  parallel_for(N * H, [&](int64_t job) {
    const int64_t n = job / H, h = job % H, start = seqs.start(n), len = seqs.length(n);
    for (int64_t t = 0; t < len; ++t) {
      std::fill_n(gr.dq + ((start + t) * H + h) * K, K, 0.0f);
      std::fill_n(gr.dk + ((start + t) * H + h) * K, K, 0.0f);
    }
    detail::ChunkWork w(K, V, chunk);
    BackwardWork bw(K, V, chunk);
    std::vector<float> dS(K * V);
    for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) {
      const std::vector<int64_t> cuts = detail::plan_chunks(in, start, len, hv, chunk);
      const size_t num_chunks = cuts.size() - 1;
      // forward walk: the state entering every chunk
      std::vector<float> states((num_chunks + 1) * K * V, 0.0f);
      if (in.h0) std::copy_n(in.h0 + (n * HV + hv) * K * V, K * V, states.data());
      for (size_t c = 0; c < num_chunks; ++c) {
        float* next = &states[(c + 1) * K * V];
        std::copy_n(&states[c * K * V], K * V, next);
        w.load_and_prepare(in, start, cuts[c], cuts[c + 1] - cuts[c], h, hv);
        w.compute_d(&states[c * K * V]);
        w.advance_state(next);
      }
      // backward walk
      if (d_ht) {
        std::copy_n(d_ht + (n * HV + hv) * K * V, K * V, dS.data());
      } else {
        std::fill(dS.begin(), dS.end(), 0.0f);
      }
      for (size_t c = num_chunks; c-- > 0;) {
        w.load_and_prepare(in, start, cuts[c], cuts[c + 1] - cuts[c], h, hv);
        w.compute_d(&states[c * K * V]);
        chunk_backward(in, w, bw, &states[c * K * V], dS.data(), d_o, start, cuts[c], h, hv, scale,
                       gr);
        std::copy(bw.dS0.begin(), bw.dS0.end(), dS.begin());
      }
      if (gr.dh0) std::copy_n(dS.data(), K * V, gr.dh0 + (n * HV + hv) * K * V);
    }
  });
}

}  // namespace kda::ops
