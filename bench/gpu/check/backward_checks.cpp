// Backward checks: the bf16 chunked backward (dq, dk, dv, dg, dbeta, dh0) against the CPU fp32
// chunked backward (delta_rule_chunk_backward) on the same rounded inputs, and the training pair
// (chunk_forward_for_backward, then chunk_backward from the kept arrays) against the recompute
// path (check_kept_forward, which the KDA layer's backward checks run too).
#include "bench/gpu/check/check_common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include "core/random.h"

namespace kda_gpu_check {

// Backward: GPU (bf16) against the CPU fp32 chunked backward on the same rounded inputs.
// The training pair on the inputs of a backward check: chunk_forward_for_backward, then
// chunk_backward from the arrays it kept. Its o and ht against chunk_forward's (held to 1e-3:
// the walks the two take may differ, e.g. in their sums' order), its gradients against the
// recompute path's `ref` (already run into the buffers of `ref_grads`): bit for bit, except the
// atomic sums dA_log / ddt_bias (1e-5).
void check_kept_forward(const std::string& name, const cuda::DeltaRuleDeviceInputs& d,
                        const void* d_o, const float* d_ht, const cuda::DeltaRuleDeviceGrads& ref,
                        int64_t tokens, int64_t N) {
  const DeltaRuleShape& s = d.shape;
  const auto bf = ElementType::bf16, f32 = ElementType::f32;
  const size_t n_o = size_t(tokens) * s.HV * s.V, n_h = size_t(N) * s.HV * s.K * s.V;
  DeviceBuffer o1(n_o * 2), o2(n_o * 2), h1(n_h * 4), h2(n_h * 4);
  const size_t fws_bytes = cuda::chunk_forward_workspace_bytes(s, d.cu_seqlens);
  const size_t bws_bytes = cuda::chunk_backward_workspace_bytes(s, d.cu_seqlens);
  DeviceBuffer fws(fws_bytes), bws(bws_bytes);
  for (auto* b : {&o1, &o2, &h1, &h2, &fws, &bws}) poison(*b);
  cuda::chunk_forward(d, o1.ptr, h1.as<float>(), fws.ptr, fws_bytes, nullptr);
  cuda::chunk_forward_for_backward(d, o2.ptr, h2.as<float>(), bws.ptr, bws_bytes, nullptr);

  struct Grad {
    const char* what;
    void* ref;
    size_t n;
    ElementType t;
    double tol;
  };
  // rel_rms tolerances far below any real mistake (a wrong kept array gives O(1)), above the
  // bf16 ulps by which smem float atomics' order can move a few elements
  const size_t n_q = size_t(tokens) * s.H * s.K, n_g = size_t(tokens) * s.HV * s.gate_width();
  const Grad list[] = {{"dq", ref.dq, n_q, bf, 1e-3},
                       {"dk", ref.dk, n_q, bf, 1e-3},
                       {"dv", ref.dv, n_o, bf, 1e-3},
                       {"dg", ref.dg, n_g, bf, 1e-3},
                       {"db", ref.dbeta, size_t(tokens) * s.HV, bf, 1e-3},
                       {"dh0", ref.dh0, n_h, f32, 1e-4},
                       {"dA", ref.dA_log, size_t(s.HV), f32, 1e-4},
                       {"ddt", ref.ddt_bias, size_t(s.HV) * s.K, f32, 1e-4}};
  // one backward into fresh poisoned buffers; returns them (empty where not computed)
  auto run = [&](cuda::ChunkBackwardFrom from, void* ws, size_t ws_bytes) {
    std::vector<DeviceBuffer> out;
    cuda::DeltaRuleDeviceGrads g = ref;
    void** fields[] = {&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta};
    for (size_t i = 0; i < std::size(list); ++i) {
      out.emplace_back(list[i].ref && list[i].n ? list[i].n * (list[i].t == bf ? 2 : 4) : 0);
      if (out.back().ptr) poison(out.back());
      if (i < 5 && *fields[i]) *fields[i] = out.back().ptr;
    }
    if (g.dh0) g.dh0 = out[5].as<float>();
    if (g.dA_log) g.dA_log = out[6].as<float>();
    if (g.ddt_bias) g.ddt_bias = out[7].as<float>();
    cuda::chunk_backward(d, d_o, d_ht, g, ws, ws_bytes, nullptr, from);
    ck(cudaDeviceSynchronize(), "kept-forward check backward");
    return out;
  };
  const std::vector<DeviceBuffer> mine =
      run(cuda::ChunkBackwardFrom::kept_forward, bws.ptr, bws_bytes);
  DeviceBuffer rws(bws_bytes);
  poison(rws);
  const std::vector<DeviceBuffer> again =
      run(cuda::ChunkBackwardFrom::recompute, rws.ptr, bws_bytes);

  const std::string kname = name + " kept-fwd";
  // Gated DeltaNet's plain forward may take the raw path (q, k scaled in the walk; on the wgmma
  // walk M formed there too) where the training forward reads prepare's Qt, Kd, M: two bf16
  // roundings of one function, measured 1.2e-3 .. 2.6e-3 apart; held to fla's forward bound
  const double fwd_tol = s.gate == Gate::scalar ? 5e-3 : 1e-3;
  report(kname, "o", rel_rms(download(o2.ptr, n_o, bf), download(o1.ptr, n_o, bf)), fwd_tol);
  if (N > 0)
    report(kname, "ht", rel_rms(download(h2.ptr, n_h, f32), download(h1.ptr, n_h, f32)), fwd_tol);
  for (size_t i = 0; i < std::size(list); ++i) {
    if (!list[i].ref || list[i].n == 0) continue;
    const std::vector<double> a = download(mine[i].ptr, list[i].n, list[i].t);
    const std::vector<double> r = download(again[i].ptr, list[i].n, list[i].t);
    const std::vector<double> b = download(list[i].ref, list[i].n, list[i].t);
    size_t differ = 0, differ_again = 0, nan = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      differ += a[j] != b[j];
      differ_again += r[j] != b[j];
      nan += std::isnan(a[j]);
    }
    // how far bit-identity holds, where it does not: elements that differ from the first
    // recompute's, for the kept path and for a second recompute (the kernels' smem atomics may
    // reorder sums run to run)
    if (differ + differ_again + nan > 0)
      std::printf(
          "NOTE %s %s: %zu / %zu elements differ (a second recompute: %zu, rel %.2e), %zu NaN\n",
          kname.c_str(), list[i].what, differ, a.size(), differ_again, rel_rms(r, b), nan);
    report(kname, list[i].what, rel_rms(a, b), list[i].tol);
  }
}

void check_backward(Gate gate, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                    std::vector<int64_t> cu, bool with_h0, bool with_dht, uint64_t seed,
                    int strong) {
  const auto bf = ElementType::bf16;
  DeltaRuleShape s{B, T, H, HV, K, V, gate, 0};
  const Inputs in = make_inputs(s, cu, with_h0, seed, strong);
  const Uploaded u = upload_all(in, bf);
  const int64_t N = in.N, gw = s.gate_width(), tokens = in.tokens;
  Random rng(seed + 7);
  std::vector<float> d_o(tokens * HV * V), d_ht;
  rng.fill_normal(d_o);
  const HostTensor dO = upload(d_o, bf);
  DeviceBuffer dht_dev;
  if (with_dht) {
    d_ht.resize(N * HV * K * V);
    rng.fill_normal(d_ht, 0.5f);
    dht_dev = DeviceBuffer(d_ht.size() * 4);
    ck(cudaMemcpy(dht_dev.ptr, d_ht.data(), d_ht.size() * 4, cudaMemcpyHostToDevice), "dht");
  }

  // CPU fp32 reference on the rounded values
  auto as_float = [](const std::vector<double>& x) {
    return std::vector<float>(x.begin(), x.end());
  };
  const std::vector<float> q = as_float(u.q.rounded), k = as_float(u.k.rounded),
                           v = as_float(u.v.rounded), beta = as_float(u.beta.rounded),
                           g = gw ? as_float(u.g.rounded) : std::vector<float>{}, h0 = in.h0,
                           dof = as_float(dO.rounded);
  std::vector<float> rq(q.size()), rk(k.size()), rv(v.size()), rg(g.size()), rb(beta.size()),
      rh0(N * HV * K * V);
  DeltaRuleInputs<float> x{s,
                           q.data(),
                           k.data(),
                           v.data(),
                           gw ? g.data() : nullptr,
                           beta.data(),
                           h0.empty() ? nullptr : h0.data(),
                           in.cu};
  DeltaRuleGrads<float> gr{rq.data(), rk.data(), rv.data(), gw ? rg.data() : nullptr,
                           rb.data(), rh0.data()};
  delta_rule_chunk_backward(x, dof.data(), with_dht ? d_ht.data() : nullptr, gr, 64);

  DeviceBuffer dq(q.size() * 2), dk(k.size() * 2), dv(v.size() * 2),
      dg(std::max<size_t>(g.size(), 1) * 2), db(beta.size() * 2), dh0(rh0.size() * 4);
  for (auto* b : {&dq, &dk, &dv, &dg, &db, &dh0}) poison(*b);
  const auto d = device_inputs(in, u, bf);
  cuda::DeltaRuleDeviceGrads grads;
  grads.dq = dq.ptr, grads.dk = dk.ptr, grads.dv = dv.ptr, grads.dbeta = db.ptr;
  grads.dg = gw ? dg.ptr : nullptr;
  grads.dh0 = dh0.as<float>();
  const size_t ws_bytes = cuda::chunk_backward_workspace_bytes(s, in.cu);
  DeviceBuffer ws(ws_bytes);
  poison(ws);
  cuda::chunk_backward(d, dO.device.ptr, with_dht ? dht_dev.as<float>() : nullptr, grads, ws.ptr,
                       ws_bytes, nullptr);
  ck(cudaDeviceSynchronize(), "backward");
  auto wide = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  char name[160];
  std::snprintf(name, sizeof name, "backward %s B%lld T%lld H%lld HV%lld K%lld V%lld%s%s%s%s",
                gate_name(gate), (long long)B, (long long)T, (long long)H, (long long)HV,
                (long long)K, (long long)V, cu.empty() ? "" : " varlen", with_h0 ? " h0" : "",
                with_dht ? " dht" : "",
                strong == 1   ? " strong-g"
                : strong == 2 ? " wide-decay"
                              : "");
  report(name, "dq", rel_rms(download(dq.ptr, q.size(), bf), wide(rq)), 8e-3);
  report(name, "dk", rel_rms(download(dk.ptr, k.size(), bf), wide(rk)), 8e-3);
  report(name, "dv", rel_rms(download(dv.ptr, v.size(), bf), wide(rv)), 8e-3);
  if (gw) report(name, "dg", rel_rms(download(dg.ptr, g.size(), bf), wide(rg)), 2e-2);
  report(name, "db", rel_rms(download(db.ptr, beta.size(), bf), wide(rb)), 2e-2);
  report(name, "dh0", rel_rms(download(dh0.ptr, rh0.size(), ElementType::f32), wide(rh0)), 8e-3);
  check_kept_forward(name, d, dO.device.ptr, with_dht ? dht_dev.as<float>() : nullptr, grads,
                     tokens, N);
}

}  // namespace kda_gpu_check
