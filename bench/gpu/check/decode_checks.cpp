// Decode checks: decode steps after a chunked prefill into scattered slots (against the float64
// recurrence and the chunked pass), single steps and speculative multi-token steps from random
// states in scrambled slots (both decode kernels), and back-to-back steps with programmatic
// launch against the same steps one at a time (the race check of DecodeArgs::prefetch_state).
#include "bench/gpu/check/check_common.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "core/random.h"

namespace kda_gpu_check {
namespace {

const char* kernel_name(cuda::DecodeKernel k) {
  return k == cuda::DecodeKernel::tile ? "tile" : k == cuda::DecodeKernel::head ? "head" : "auto";
}

}  // namespace

// Prefill (chunked) the prompts into scattered slots of a pool, decode D tokens step by step,
// compare against the float64 recurrence and against one chunked pass over prompt + decoded.
void check_decode(Gate gate, int64_t H, int64_t HV, int64_t K, int64_t V, ElementType t,
                  uint64_t seed, cuda::DecodeKernel kernel) {
  const std::vector<int64_t> prompt = {1, 63, 64, 130, 7};
  const int64_t N = int64_t(prompt.size()), D = 4;
  std::vector<int64_t> cu_full = {0}, cu_prompt = {0};
  for (int64_t p : prompt) cu_full.push_back(cu_full.back() + p + D);
  for (int64_t p : prompt) cu_prompt.push_back(cu_prompt.back() + p);
  const int64_t T_full = cu_full.back();
  DeltaRuleShape s{1, T_full, H, HV, K, V, gate, 0};
  const Inputs full = make_inputs(s, cu_full, true, seed);
  const Uploaded uf = upload_all(full, t);
  const Reference ref = reference(full, uf.q.rounded, uf.k.rounded, uf.v.rounded,
                                  full.g.empty() ? std::vector<double>{} : uf.g.rounded,
                                  uf.beta.rounded, uf.h0_rounded);
  const ForwardResult chunk_full = run_forward(full, uf, t, t == ElementType::f32);

  // The prompts alone: gather their tokens out of the full packing.
  const int64_t gw = s.gate_width();
  Inputs pr = full;
  pr.shape.T = cu_prompt.back();
  pr.cu = cu_prompt;
  pr.tokens = pr.shape.T;
  // The first `count` tokens of each sequence of the full packing.
  auto gather = [&](const std::vector<float>& src, int64_t width) {
    std::vector<float> out;
    for (int64_t n = 0; n < N; ++n)
      out.insert(out.end(), src.begin() + cu_full[n] * width,
                 src.begin() + (cu_full[n] + prompt[n]) * width);
    return out;
  };
  pr.q = gather(full.q, H * K);
  pr.k = gather(full.k, H * K);
  pr.v = gather(full.v, HV * V);
  if (gw) pr.g = gather(full.g, HV * gw);
  pr.beta = gather(full.beta, HV);
  const Uploaded up = upload_all(pr, t);
  const ForwardResult chunk_prompt = run_forward(pr, up, t, t == ElementType::f32);

  // Pool of 3N slots filled with noise; sequence n lives in slot 3n + 1 (scrambled order).
  const int64_t slots_n = 3 * N, state = HV * K * V;
  std::vector<float> pool_host(slots_n * state);
  Random rng(seed + 99);
  rng.fill_normal(pool_host);
  std::vector<int32_t> slot(N);
  for (int64_t n = 0; n < N; ++n) slot[n] = int32_t(3 * ((n * 2 + 1) % N) + 1);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < state; ++i)
      pool_host[slot[n] * state + i] = float(chunk_prompt.ht[n * state + i]);
  DeviceBuffer pool(pool_host.size() * 4), slots_dev(N * 4);
  ck(cudaMemcpy(pool.ptr, pool_host.data(), pool.bytes, cudaMemcpyHostToDevice), "pool");
  ck(cudaMemcpy(slots_dev.ptr, slot.data(), N * 4, cudaMemcpyHostToDevice), "slots");

  std::vector<double> dec_o, ref_o, chunk_o;
  for (int64_t d = 0; d < D; ++d) {
    auto step = [&](const std::vector<float>& src, int64_t width) {
      std::vector<float> out;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t tok = cu_full[n] + prompt[n] + d;
        out.insert(out.end(), src.begin() + tok * width, src.begin() + (tok + 1) * width);
      }
      return out;
    };
    const HostTensor q = upload(step(full.q, H * K), t), k = upload(step(full.k, H * K), t),
                     v = upload(step(full.v, HV * V), t), beta = upload(step(full.beta, HV), t);
    HostTensor g;
    if (gw) g = upload(step(full.g, HV * gw), t);
    const size_t esize = t == ElementType::bf16 ? 2 : 4;
    DeviceBuffer o(N * HV * V * esize);
    poison(o);
    cuda::DecodeArgs a;
    a.shape = DeltaRuleShape{N, 1, H, HV, K, V, gate, 0};
    a.dtype = t;
    a.q = q.device.ptr, a.k = k.device.ptr, a.v = v.device.ptr;
    a.g = gw ? g.device.ptr : nullptr;
    a.beta = beta.device.ptr;
    a.state_pool = pool.as<float>();
    a.slots = slots_dev.as<int32_t>();
    a.num_slots = slots_n;
    a.o = o.ptr;
    a.kernel = kernel;
    a.prefetch_state = prefetch_requested();  // one step at a time: the contract holds
    cuda::decode_step(a, nullptr);
    ck(cudaDeviceSynchronize(), "decode");
    const auto od = download(o.ptr, N * HV * V, t);
    dec_o.insert(dec_o.end(), od.begin(), od.end());
    for (int64_t n = 0; n < N; ++n) {
      const int64_t tok = cu_full[n] + prompt[n] + d;
      ref_o.insert(ref_o.end(), ref.o.begin() + tok * HV * V, ref.o.begin() + (tok + 1) * HV * V);
      chunk_o.insert(chunk_o.end(), chunk_full.o.begin() + tok * HV * V,
                     chunk_full.o.begin() + (tok + 1) * HV * V);
    }
  }
  const auto pool_after = download(pool.ptr, slots_n * state, ElementType::f32);
  std::vector<double> dec_ht, untouched_now, untouched_before;
  for (int64_t n = 0; n < N; ++n)
    dec_ht.insert(dec_ht.end(), pool_after.begin() + slot[n] * state,
                  pool_after.begin() + (slot[n] + 1) * state);
  for (int64_t sl = 0; sl < slots_n; ++sl) {
    if (std::find(slot.begin(), slot.end(), int32_t(sl)) != slot.end()) continue;
    untouched_now.insert(untouched_now.end(), pool_after.begin() + sl * state,
                         pool_after.begin() + (sl + 1) * state);
    untouched_before.insert(untouched_before.end(), pool_host.begin() + sl * state,
                            pool_host.begin() + (sl + 1) * state);
  }
  char name[160];
  std::snprintf(name, sizeof name, "decode %s %s %s H%lld HV%lld K%lld V%lld x%lld steps",
                kernel_name(kernel), gate_name(gate), t == ElementType::bf16 ? "bf16" : "fp32",
                (long long)H, (long long)HV, (long long)K, (long long)V, (long long)D);
  const double tol = t == ElementType::bf16 ? 5e-3 : 1e-4;
  report(std::string(name) + " vs f64", "o", rel_rms(dec_o, ref_o), tol);
  report(std::string(name) + " vs f64", "ht", rel_rms(dec_ht, ref.ht), tol);
  report(std::string(name) + " vs chunk", "o", rel_rms(dec_o, chunk_o), tol);
  report(std::string(name) + " vs chunk", "ht", rel_rms(dec_ht, chunk_full.ht), tol);
  report(std::string(name) + " other slots", "==", rel_rms(untouched_now, untouched_before), 0.0);
}

namespace {

// A decode step of B sequences of T tokens each (T > 1: speculative decoding), from random states
// in scrambled slots of a pool (noise in the other slots), against the float64 recurrence: o of
// every token, and either the state after every token (token_slots) or the final state in place;
// slots that nothing should write, bit for bit (with token_slots, every sequence's own slot).
void check_decode_tokens(Gate gate, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K,
                         ElementType t, bool keep_every_token, cuda::DecodeKernel kernel,
                         uint64_t seed) {
  const int64_t V = 128;
  const DeltaRuleShape s{B, T, H, HV, K, V, gate, 0};
  const Inputs in = make_inputs(s, {}, true, seed);
  const Uploaded u = upload_all(in, t);
  const std::vector<double> g_rounded = in.g.empty() ? std::vector<double>{} : u.g.rounded;
  // the float64 recurrence over each prefix of 1 .. T tokens
  auto prefix = [&](const std::vector<double>& x, int64_t per_token, int64_t t1) {
    std::vector<double> y;
    for (int64_t b = 0; b < B; ++b)
      y.insert(y.end(), x.begin() + (b * T) * per_token, x.begin() + (b * T + t1) * per_token);
    return y;
  };
  const int64_t gw = gate == Gate::channel ? HV * K : gate == Gate::scalar ? HV : 0;
  std::vector<Reference> refs;
  for (int64_t t1 = 1; t1 <= T; ++t1) {
    Inputs pin = in;
    pin.shape.T = t1;
    pin.tokens = B * t1;
    refs.push_back(reference(pin, prefix(u.q.rounded, H * K, t1), prefix(u.k.rounded, H * K, t1),
                             prefix(u.v.rounded, HV * V, t1),
                             gw ? prefix(g_rounded, gw, t1) : std::vector<double>{},
                             prefix(u.beta.rounded, HV, t1), u.h0_rounded));
  }
  // B sequence slots, then B x T token slots, from 2B + BT + 3 slots in shuffled order
  const int64_t token_n = keep_every_token ? B * T : 0, slots_n = 2 * B + token_n + 3;
  const int64_t state = HV * K * V;
  Random rng(seed + 7);
  std::vector<int32_t> order(slots_n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng.engine());
  const std::vector<int32_t> slot(order.begin(), order.begin() + B);
  const std::vector<int32_t> token_slot(order.begin() + B, order.begin() + B + token_n);
  std::vector<float> pool_host(slots_n * state);
  rng.fill_normal(pool_host);
  for (int64_t b = 0; b < B; ++b)
    std::copy(in.h0.begin() + b * state, in.h0.begin() + (b + 1) * state,
              pool_host.begin() + slot[b] * state);
  DeviceBuffer pool(pool_host.size() * 4), slots_dev(B * 4), token_slots_dev(token_n * 4 + 4);
  ck(cudaMemcpy(pool.ptr, pool_host.data(), pool.bytes, cudaMemcpyHostToDevice), "pool");
  ck(cudaMemcpy(slots_dev.ptr, slot.data(), B * 4, cudaMemcpyHostToDevice), "slots");
  if (token_n)
    ck(cudaMemcpy(token_slots_dev.ptr, token_slot.data(), token_n * 4, cudaMemcpyHostToDevice),
       "token slots");
  DeviceBuffer o(B * T * HV * V * (t == ElementType::bf16 ? 2 : 4));
  poison(o);
  cuda::DecodeArgs a;
  a.shape = s;
  a.dtype = t;
  a.q = u.q.device.ptr, a.k = u.k.device.ptr, a.v = u.v.device.ptr;
  a.g = in.g.empty() ? nullptr : u.g.device.ptr;
  a.beta = u.beta.device.ptr;
  a.state_pool = pool.as<float>();
  a.slots = slots_dev.as<int32_t>();
  a.num_slots = slots_n;
  a.o = o.ptr;
  a.tokens = int(T);
  a.token_slots = token_n ? token_slots_dev.as<int32_t>() : nullptr;
  a.kernel = kernel;
  a.prefetch_state = prefetch_requested();  // one step at a time: the contract holds
  cuda::decode_step(a, nullptr);
  ck(cudaDeviceSynchronize(), "speculative decode step");
  const auto pool_after = download(pool.ptr, slots_n * state, ElementType::f32);
  auto state_at = [&](const auto& p, int64_t at) {
    return std::vector<double>(p.begin() + at * state, p.begin() + (at + 1) * state);
  };
  char name[200];
  if (T == 1 && !keep_every_token)  // the plain decode step (check_decode_step)
    std::snprintf(name, sizeof name, "decode step %s %s %s B%lld H%lld HV%lld K%lld",
                  kernel_name(kernel), gate_name(gate), t == ElementType::bf16 ? "bf16" : "fp32",
                  (long long)B, (long long)H, (long long)HV, (long long)K);
  else
    std::snprintf(name, sizeof name, "decode tokens %s %s %s B%lld T%lld H%lld HV%lld K%lld %s",
                  kernel_name(kernel), gate_name(gate), t == ElementType::bf16 ? "bf16" : "fp32",
                  (long long)B, (long long)T, (long long)H, (long long)HV, (long long)K,
                  keep_every_token ? "every token's state" : "in place");
  report(name, "o", rel_rms(download(o.ptr, B * T * HV * V, t), refs.back().o),
         t == ElementType::bf16 ? 5e-3 : 1e-5);
  std::vector<double> got, want, untouched_now, untouched_before;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t1 = 1; t1 <= T; ++t1) {
      if (!keep_every_token && t1 < T) continue;
      const int64_t at = keep_every_token ? token_slot[b * T + t1 - 1] : slot[b];
      const auto now = state_at(pool_after, at);
      got.insert(got.end(), now.begin(), now.end());
      const auto& ht = refs[t1 - 1].ht;
      want.insert(want.end(), ht.begin() + b * state, ht.begin() + (b + 1) * state);
    }
  }
  report(name, "states", rel_rms(got, want), 1e-5);
  // untouched: the noise slots, and with token_slots every sequence's own slot
  for (int64_t sl = keep_every_token ? 0 : B; sl < slots_n; ++sl) {
    if (sl >= B && sl < B + token_n) continue;
    const auto now = state_at(pool_after, order[sl]), before = state_at(pool_host, order[sl]);
    untouched_now.insert(untouched_now.end(), now.begin(), now.end());
    untouched_before.insert(untouched_before.end(), before.begin(), before.end());
  }
  report(name, "==", rel_rms(untouched_now, untouched_before), 0.0);
}

// Back-to-back decode steps as a model's decode loop or the benchmark issues them: steps over two
// alternating, disjoint slot sets (each step reads the slots the step two back wrote), with
// programmatic launch and the early state fetch when KDA_DECODE_PREFETCH=1 (else the plain
// launch), queued without synchronising, against the same steps one at a time with a
// synchronisation after each: the pool and every output bit for bit. The race check of
// DecodeArgs::prefetch_state's contract.
void check_decode_chain(Gate gate, int64_t B, int64_t H, cuda::DecodeKernel kernel, uint64_t seed) {
  const int64_t K = 128, V = 128, steps = 6, slots_n = 4 * B + 8;
  const int64_t state = H * K * V;
  const std::vector<int32_t> sets = rotating_slot_sets(slots_n, B, 2, seed);
  DeviceBuffer slots_dev(sets.size() * 4);
  ck(cudaMemcpy(slots_dev.ptr, sets.data(), slots_dev.bytes, cudaMemcpyHostToDevice), "slots");
  std::vector<float> pool_host(slots_n * state);
  Random rng(seed + 1);
  rng.fill_normal(pool_host);
  for (float& x : pool_host) x *= 0.1f;
  const int64_t gw = gate == Gate::channel ? K : 1;
  std::vector<DecodeBenchTokens> tokens;
  for (int64_t i = 0; i < steps; ++i) tokens.emplace_back(B, H, K, V, gw, seed + 10 * (i + 1));
  auto run = [&](bool chained) {
    DeviceBuffer pool(pool_host.size() * 4);
    ck(cudaMemcpy(pool.ptr, pool_host.data(), pool.bytes, cudaMemcpyHostToDevice), "pool");
    std::vector<double> all;
    cuda::DecodeArgs a;
    a.shape = DeltaRuleShape{B, 1, H, H, K, V, gate, 0};
    a.state_pool = pool.as<float>();
    a.num_slots = slots_n;
    a.kernel = kernel;
    a.overlap_launch = chained;
    a.prefetch_state = chained && prefetch_requested();
    for (int64_t i = 0; i < steps; ++i) {
      tokens[i].bind(a);
      a.slots = slots_dev.as<int32_t>() + (i % 2) * B;
      cuda::decode_step(a, nullptr);
      if (!chained) ck(cudaDeviceSynchronize(), "decode step");
    }
    ck(cudaDeviceSynchronize(), "decode chain");
    for (int64_t i = 0; i < steps; ++i) {
      const auto o = download(tokens[i].o.ptr, B * H * V, ElementType::bf16);
      all.insert(all.end(), o.begin(), o.end());
    }
    const auto p = download(pool.ptr, slots_n * state, ElementType::f32);
    all.insert(all.end(), p.begin(), p.end());
    return all;
  };
  const std::vector<double> serial = run(false), chained = run(true);
  char name[160];
  std::snprintf(name, sizeof name, "decode chain %s %s B%lld H%lld x%lld steps%s",
                kernel_name(kernel), gate_name(gate), (long long)B, (long long)H, (long long)steps,
                prefetch_requested() ? " (state before the wait)" : "");
  report(name, "==", rel_rms(chained, serial), 0.0);
}

}  // namespace

// One decode step for B sequences (one token each) from random states in scrambled slots of a
// pool (noise in the other slots) against the float64 recurrence: o, the updated states, and the
// untouched slots bit for bit. Covers both decode kernels at the production head count.
void check_decode_step(Gate gate, int64_t B, int64_t H, int64_t HV, int64_t K, ElementType t,
                       cuda::DecodeKernel kernel, uint64_t seed) {
  check_decode_tokens(gate, B, 1, H, HV, K, t, false, kernel, seed);
}

// Decode against the float64 recurrence (own seeds): D steps after a chunked prefill into
// scattered slots (both kernels on the same inputs; grouped value heads), and one step from
// random states in scrambled slots for both kernels: B = 1, 16 (H = 32), 128 (grouped value
// heads), fp32 inputs, K = 64 and 32, DeltaNet.
void run_decode_checks() {
  const auto bf = ElementType::bf16, f32 = ElementType::f32;
  const auto tile = cuda::DecodeKernel::tile, head = cuda::DecodeKernel::head;
  uint64_t ds = 7000;
  for (Gate gate : {Gate::channel, Gate::scalar}) {
    for (auto kernel : {tile, head}) {
      check_decode(gate, 2, 4, 128, 128, bf, ds + 1, kernel);
      check_decode_step(gate, 1, 32, 32, 128, bf, kernel, ds + 2);
      check_decode_step(gate, 16, 32, 32, 128, bf, kernel, ds + 3);
      check_decode_step(gate, 128, 2, 4, 128, bf, kernel, ds + 4);
      check_decode_step(gate, 16, 32, 32, 128, f32, kernel, ds + 5);
      check_decode_step(gate, 9, 2, 4, 64, f32, kernel, ds + 6);
    }
    check_decode(gate, 2, 4, 64, 64, f32, ds + 7);  // V = 64: the tile kernel
    ds += 10;
  }
  check_decode_step(Gate::channel, 5, 2, 4, 32, bf, head, ++ds);
  check_decode_step(Gate::none, 16, 4, 8, 128, bf, head, ++ds);
  check_decode_step(Gate::none, 16, 4, 8, 128, bf, tile, ds);
  // a few tokens per sequence (speculative decoding): every token's state kept or in place, the
  // production head count and grouped value heads, fp32 inputs, K = 64; one token with token
  // slots on both kernels
  const auto automatic = cuda::DecodeKernel::automatic;
  for (Gate gate : {Gate::channel, Gate::scalar, Gate::none}) {
    check_decode_tokens(gate, 16, 4, 32, 32, 128, bf, true, automatic, ++ds);
    check_decode_tokens(gate, 3, 5, 2, 4, 128, bf, false, automatic, ++ds);
  }
  check_decode_tokens(Gate::channel, 7, 3, 2, 4, 64, f32, true, automatic, ++ds);
  check_decode_tokens(Gate::channel, 16, 1, 4, 8, 128, bf, true, head, ++ds);
  check_decode_tokens(Gate::channel, 16, 1, 4, 8, 128, bf, true, tile, ds);
  // back-to-back steps with programmatic launch (and the early state fetch, when asked for)
  for (Gate gate : {Gate::channel, Gate::scalar})
    for (auto kernel : {tile, head}) check_decode_chain(gate, 16, 32, kernel, ++ds);
}

}  // namespace kda_gpu_check
