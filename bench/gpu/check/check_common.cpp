// kda_gpu_check's shared helpers (declared in check_common.h): upload / download of host
// tensors, poison, rel_rms, random inputs and the float64 reference, the CHECK report, the
// kernel-lab knob helpers, and the device-side random fills and rotating slot sets.
#include "bench/gpu/check/check_common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "core/dtype.h"
#include "core/error.h"
#include "core/random.h"

namespace kda_gpu_check {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

HostTensor upload(std::vector<float> v, ElementType t) {
  HostTensor h;
  h.rounded.resize(v.size());
  if (t == ElementType::bf16) {
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      bits[i] = f32_to_bf16(v[i]);
      h.rounded[i] = bf16_to_f32(bits[i]);
    }
    h.device = DeviceBuffer(bits.size() * 2);
    ck(cudaMemcpy(h.device.ptr, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload");
  } else {
    for (size_t i = 0; i < v.size(); ++i) h.rounded[i] = v[i];
    h.device = DeviceBuffer(v.size() * 4);
    ck(cudaMemcpy(h.device.ptr, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload");
  }
  h.values = std::move(v);
  return h;
}

std::vector<double> download(const void* dev, size_t n, ElementType t) {
  std::vector<double> out(n);
  if (t == ElementType::bf16) {
    std::vector<uint16_t> bits(n);
    ck(cudaMemcpy(bits.data(), dev, n * 2, cudaMemcpyDeviceToHost), "download");
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(bits[i]);
  } else {
    std::vector<float> f(n);
    ck(cudaMemcpy(f.data(), dev, n * 4, cudaMemcpyDeviceToHost), "download");
    for (size_t i = 0; i < n; ++i) out[i] = f[i];
  }
  return out;
}

// NaN bytes (0xFF..) so unwritten outputs show up.
void poison(const DeviceBuffer& b) {
  ck(cudaMemset(b.ptr, 0xFF, b.bytes), "poison");
}

double rel_rms(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// gate_strength: 0 log(sigmoid(1 + 2z)); 1 (strong) fla's lower-bound gate -5 sigmoid(2z);
// 2 (wide decay, KDA) every other channel of the odd value heads -10 - 20 sigmoid(z), past
// chunk_prepare's split (the even heads' chunks stay inside it: every call mixes both kinds)
Inputs make_inputs(const DeltaRuleShape& s, std::vector<int64_t> cu, bool with_h0, uint64_t seed,
                   int gate_strength) {
  Inputs in;
  in.shape = s;
  in.cu = std::move(cu);
  in.N = in.cu.empty() ? s.B : int64_t(in.cu.size()) - 1;
  in.tokens = s.B * s.T;
  Random rng(seed);
  auto normal = [&](size_t n) {
    std::vector<float> x(n);
    rng.fill_normal(x);
    return x;
  };
  in.q = normal(in.tokens * s.H * s.K);
  in.k = normal(in.tokens * s.H * s.K);
  for (auto* x : {&in.q, &in.k})
    for (int64_t r = 0; r < in.tokens * s.H; ++r) {
      float* row = x->data() + r * s.K;
      double n2 = 0;
      for (int64_t c = 0; c < s.K; ++c) n2 += double(row[c]) * row[c];
      const float inv = float(1.0 / std::sqrt(std::max(n2, 1e-12)));
      for (int64_t c = 0; c < s.K; ++c) row[c] *= inv;
    }
  in.v = normal(in.tokens * s.HV * s.V);
  if (s.gate != Gate::none) {
    in.g.resize(in.tokens * s.HV * s.gate_width());
    for (size_t i = 0; i < in.g.size(); ++i) {
      const float z = rng.normal();
      in.g[i] = gate_strength == 1 ? -5.f / (1.f + std::exp(-2.f * z))
                                   : -std::log1p(std::exp(-(1.f + 2.f * z)));
      const bool odd_head = (i / size_t(s.gate_width())) % size_t(s.HV) % 2 == 1;
      if (gate_strength == 2 && i % 2 && odd_head) in.g[i] = -10.f - 20.f / (1.f + std::exp(-z));
    }
  }
  in.beta.resize(in.tokens * s.HV);
  for (float& x : in.beta) x = 1.f / (1.f + std::exp(-rng.normal()));
  if (with_h0) {
    in.h0 = normal(in.N * s.HV * s.K * s.V);
    for (float& x : in.h0) x *= 0.5f;
  }
  return in;
}

Reference reference(const Inputs& in, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& g,
                    const std::vector<double>& beta, const std::vector<double>& h0) {
  const DeltaRuleShape& s = in.shape;
  Reference r;
  r.o.resize(in.tokens * s.HV * s.V);
  r.ht.resize(in.N * s.HV * s.K * s.V);
  DeltaRuleInputs<double> x{s,
                            q.data(),
                            k.data(),
                            v.data(),
                            g.empty() ? nullptr : g.data(),
                            beta.data(),
                            h0.empty() ? nullptr : h0.data(),
                            in.cu};
  delta_rule_reference(x, r.o.data(), r.ht.data());
  return r;
}

int g_failures = 0;

void report(const std::string& name, const char* what, double err, double tol) {
  const bool ok = err <= tol;  // NaN / inf fail
  if (!ok) ++g_failures;
  std::printf("CHECK %-48s %-3s rel_rms %.3e  tol %.0e  %s\n", name.c_str(), what, err, tol,
              ok ? "PASS" : "FAIL");
  std::fflush(stdout);
}

Uploaded upload_all(const Inputs& in, ElementType t) {
  Uploaded u;
  u.q = upload(in.q, t);
  u.k = upload(in.k, t);
  u.v = upload(in.v, t);
  if (!in.g.empty()) u.g = upload(in.g, t);
  u.beta = upload(in.beta, t);
  if (!in.h0.empty()) {
    u.h0 = DeviceBuffer(in.h0.size() * 4);
    ck(cudaMemcpy(u.h0.ptr, in.h0.data(), in.h0.size() * 4, cudaMemcpyHostToDevice), "h0");
    u.h0_rounded.assign(in.h0.begin(), in.h0.end());
  }
  return u;
}

cuda::DeltaRuleDeviceInputs device_inputs(const Inputs& in, const Uploaded& u, ElementType t) {
  cuda::DeltaRuleDeviceInputs d;
  d.shape = in.shape;
  d.dtype = t;
  d.q = u.q.device.ptr;
  d.k = u.k.device.ptr;
  d.v = u.v.device.ptr;
  d.g = in.g.empty() ? nullptr : u.g.device.ptr;
  d.beta = u.beta.device.ptr;
  d.h0 = in.h0.empty() ? nullptr : u.h0.as<float>();
  d.cu_seqlens = in.cu;
  return d;
}

ForwardResult run_forward(const Inputs& in, const Uploaded& u, ElementType t, bool recurrent) {
  const DeltaRuleShape& s = in.shape;
  const size_t esize = t == ElementType::bf16 ? 2 : 4;
  DeviceBuffer o(in.tokens * s.HV * s.V * esize), ht(in.N * s.HV * s.K * s.V * 4);
  poison(o);
  poison(ht);
  const auto d = device_inputs(in, u, t);
  const size_t ws_bytes = recurrent ? cuda::recurrent_forward_workspace_bytes(in.cu)
                                    : cuda::chunk_forward_workspace_bytes(s, in.cu);
  DeviceBuffer ws(ws_bytes);
  if (ws_bytes) poison(ws);
  if (recurrent)
    cuda::recurrent_forward(d, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
  else
    cuda::chunk_forward(d, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
  ck(cudaDeviceSynchronize(), "forward");
  return {download(o.ptr, in.tokens * s.HV * s.V, t),
          download(ht.ptr, in.N * s.HV * s.K * s.V, ElementType::f32)};
}

// KDA_DECODE_PREFETCH=1: the decode checks and rows ask for DecodeArgs::prefetch_state (where
// their launches honour its contract; the library never turns it on by itself).
bool prefetch_requested() {
  const char* knob = std::getenv("KDA_DECODE_PREFETCH");
  return knob && knob[0] == '1';
}

const char* gate_name(Gate g) {
  return g == Gate::channel ? "kda" : g == Gate::scalar ? "gdn" : "delta";
}

// The kernel-lab knobs a check runs under, for its name (" state-nt=1"): empty when none is set.
std::string knob_tags() {
  std::string tags;
  if (const char* nt = std::getenv("KDA_STATE_NT")) tags += std::string(" state-nt=") + nt;
  return tags;
}

// Fills n bf16 values with uniform(lo, hi) noise (rows of `row` values normalised to unit
// length when asked): a 4M-value random block made on the host, repeated on the device (the
// benchmarks stream far more than the L2, so repetition does not help the cache).
void fill_device_random_bf16(const DeviceBuffer& b, size_t n, uint64_t seed, float lo, float hi,
                             bool normalize_rows, int row) {
  const size_t unit = std::max<size_t>(row, 1);
  const size_t block = std::min(n, (size_t(1) << 22) / unit * unit);
  std::vector<uint16_t> h(block);
  Random rng(seed);
  for (size_t i = 0; i < block; ++i) h[i] = f32_to_bf16(rng.uniform(lo, hi));
  if (normalize_rows) {
    for (size_t r = 0; r < block / row; ++r) {
      double n2 = 0;
      for (int c = 0; c < row; ++c) {
        const double x = bf16_to_f32(h[r * row + c]);
        n2 += x * x;
      }
      const double inv = 1.0 / std::sqrt(std::max(n2, 1e-12));
      for (int c = 0; c < row; ++c)
        h[r * row + c] = f32_to_bf16(float(bf16_to_f32(h[r * row + c]) * inv));
    }
  }
  uint16_t* dst = b.as<uint16_t>();
  ck(cudaMemcpy(dst, h.data(), block * 2, cudaMemcpyHostToDevice), "fill");
  for (size_t done = block; done < n;) {
    const size_t cnt = std::min(done, n - done);
    ck(cudaMemcpy(dst + done, dst, cnt * 2, cudaMemcpyDeviceToDevice), "fill");
    done += cnt;
  }
}

// `sets` slot sets of `per_set` distinct slots of [0, slots_n), consecutive sets (cyclically, as
// the timed steps use them) disjoint: a step may then read its states while the step before
// still writes its own (DecodeArgs::prefetch_state's contract).
std::vector<int32_t> rotating_slot_sets(int64_t slots_n, int64_t per_set, int sets, uint64_t seed) {
  require(sets >= 2 && 3 * per_set <= slots_n, "rotating_slot_sets: two sets or more, 3 x per set");
  Random rng(seed);
  std::vector<int32_t> out(size_t(sets) * per_set), perm(slots_n);
  std::vector<char> banned(slots_n);
  for (int si = 0; si < sets; ++si) {
    std::fill(banned.begin(), banned.end(), 0);
    auto ban = [&](int set) {
      for (int64_t j = 0; j < per_set; ++j) banned[out[size_t(set) * per_set + j]] = 1;
    };
    if (si > 0) ban(si - 1);
    if (si == sets - 1 && sets > 1) ban(0);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.engine());
    int64_t taken = 0;
    for (int32_t slot : perm)
      if (!banned[slot] && taken < per_set) out[size_t(si) * per_set + taken++] = slot;
  }
  return out;
}

}  // namespace kda_gpu_check
