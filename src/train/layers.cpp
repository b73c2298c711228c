#include "train/layers.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/blas.h"
#include "core/error.h"
#include "core/fast_math.h"
#include "core/parallel.h"

namespace kda::train {

void linear_forward(const float* x, int64_t rows, int64_t in, const float* W, int64_t out,
                    float* y) {
  gemm_nt(int(rows), int(out), int(in), 1.0f, x, int(in), W, int(in), 0.0f, y, int(out));
}

void linear_backward(const float* x, const float* dy, int64_t rows, int64_t in, const float* W,
                     int64_t out, float* dx, float* dW, bool accumulate_dx) {
  if (dx) {
    gemm_nn(int(rows), int(in), int(out), 1.0f, dy, int(out), W, int(in),
            accumulate_dx ? 1.0f : 0.0f, dx, int(in));
  }
  gemm_tn(int(out), int(in), int(rows), 1.0f, dy, int(out), x, int(in), 1.0f, dW, int(in));
}

void rms_norm_forward(const float* x, int64_t rows, int64_t D, const float* w, float eps, float* y,
                      float* inv_rms) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / double(D) + eps));
    inv_rms[r] = inv;
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = xr[i] * inv * w[i];
  }
}

void rms_norm_backward(const float* x, const float* dy, int64_t rows, int64_t D, const float* w,
                       const float* inv_rms, float* dx, float* dw) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float* dyr = dy + r * D;
    const float inv = inv_rms[r];
    double dot = 0;  // sum_i dy_i w_i x_i
    for (int64_t i = 0; i < D; ++i) {
      dot += double(dyr[i]) * w[i] * xr[i];
      dw[i] += dyr[i] * xr[i] * inv;
    }
    const float c = float(dot / double(D)) * inv * inv * inv;
    for (int64_t i = 0; i < D; ++i) dx[r * D + i] = dyr[i] * w[i] * inv - xr[i] * c;
  }
}

void residual_rms_norm_backward(const float* x, const float* d_normed, int64_t rows, int64_t D,
                                const float* w, const float* inv_rms, float* dw, float* dh,
                                float* scratch) {
  rms_norm_backward(x, d_normed, rows, D, w, inv_rms, scratch, dw);
  for (int64_t i = 0; i < rows * D; ++i) dh[i] += scratch[i];
}

void embedding_forward(const float* table, int64_t vocab, int64_t D, const int32_t* ids,
                       int64_t rows, float* out, const char* who) {
  for (int64_t r = 0; r < rows; ++r) {
    require(
        ids[r] >= 0 && ids[r] < vocab,
        std::string(who) + ": token id " + std::to_string(ids[r]) + " is out of the vocabulary");
    std::copy_n(table + int64_t(ids[r]) * D, D, out + r * D);
  }
}

void embedding_backward(const int32_t* ids, const float* dy, int64_t rows, int64_t D,
                        float* dtable) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < D; ++i) dtable[int64_t(ids[r]) * D + i] += dy[r * D + i];
}

void swiglu_forward(const float* a, const float* b, int64_t n, float* h) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-a[i]));
    h[i] = a[i] * s * b[i];
  }
}

void swiglu_backward(const float* a, const float* b, const float* dh, int64_t n, float* da,
                     float* db) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-a[i]));
    const float silu = a[i] * s;
    db[i] = dh[i] * silu;
    da[i] = dh[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
  }
}

double cross_entropy(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                     float* dlogits, int64_t* scored, int64_t* correct) {
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) n += targets[r] >= 0;
  const float inv_n = n ? 1.0f / float(n) : 0.0f;
  // Per row: softmax with one exp per logit (fast_exp, 2 ulp; vectorised), kept in dlogits
  // and rescaled in place. Row losses are summed in row order afterwards: the same loss for
  // any thread count.
  std::vector<double> row_loss(size_t(rows), 0.0);
  std::vector<uint8_t> row_hit(size_t(rows), 0);
  parallel_for(
      rows,
      [&](int64_t r) {
        const float* l = logits + r * vocab;
        float* d = dlogits + r * vocab;
        if (targets[r] < 0) {
          std::fill(d, d + vocab, 0.0f);
          return;
        }
        const int64_t best = std::max_element(l, l + vocab) - l;
        const float m = l[best];
        for (int64_t v = 0; v < vocab; ++v) d[v] = fast_exp(l[v] - m);
        double sum = 0;
        for (int64_t v = 0; v < vocab; ++v) sum += d[v];
        row_loss[size_t(r)] = double(m) + std::log(sum) - double(l[targets[r]]);
        row_hit[size_t(r)] = best == targets[r];
        const float scale = float(1.0 / sum) * inv_n;
        for (int64_t v = 0; v < vocab; ++v) d[v] *= scale;
        d[targets[r]] -= inv_n;
      },
      6.0 * double(vocab));
  double loss = 0;
  int64_t hits = 0;
  for (int64_t r = 0; r < rows; ++r) {
    loss += row_loss[size_t(r)];
    hits += row_hit[size_t(r)];
  }
  if (scored) *scored = n;
  if (correct) *correct = hits;
  return n ? loss / double(n) : 0.0;
}

double lm_head_cross_entropy(const float* h, const int32_t* targets, int64_t rows, int64_t D,
                             const float* W, int64_t vocab, float* dh, float* dW, int64_t* scored,
                             int64_t* correct) {
  std::vector<int64_t> kept;
  for (int64_t r = 0; r < rows; ++r)
    if (targets[r] >= 0) kept.push_back(r);
  const int64_t R = int64_t(kept.size());
  if (dh) std::fill(dh, dh + rows * D, 0.0f);
  if (R == 0) {
    if (scored) *scored = 0;
    if (correct) *correct = 0;
    return 0.0;
  }
  // every row scored: no copies
  const bool all = R == rows;
  std::vector<float> h_kept;
  std::vector<int32_t> t_kept;
  if (!all) {
    h_kept.resize(size_t(R * D));
    t_kept.resize(size_t(R));
    for (int64_t i = 0; i < R; ++i) {
      std::copy_n(h + kept[size_t(i)] * D, D, h_kept.data() + i * D);
      t_kept[size_t(i)] = targets[kept[size_t(i)]];
    }
  }
  const float* hr = all ? h : h_kept.data();
  const int32_t* tr = all ? targets : t_kept.data();
  std::vector<float> logits(size_t(R * vocab)), dlogits(size_t(R * vocab));
  linear_forward(hr, R, D, W, vocab, logits.data());
  const double loss = cross_entropy(logits.data(), tr, R, vocab, dlogits.data(), scored, correct);
  if (!dh) return loss;
  logits = {};
  if (all) {
    linear_backward(hr, dlogits.data(), R, D, W, vocab, dh, dW);
    return loss;
  }
  std::vector<float> dh_kept(size_t(R * D));
  linear_backward(hr, dlogits.data(), R, D, W, vocab, dh_kept.data(), dW);
  for (int64_t i = 0; i < R; ++i) std::copy_n(dh_kept.data() + i * D, D, dh + kept[size_t(i)] * D);
  return loss;
}

}  // namespace kda::train
