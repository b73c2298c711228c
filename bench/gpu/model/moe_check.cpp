// Suite "moe": the routed experts of ops/moe/cuda/moe_cuda.h against the CPU ops (moe.h).
// Routing: ids must agree exactly (ties included: logits drawn from a few values), weights to
// 1e-6. Forward: the routed contribution y - y0 (y starts non-zero) against
// ops::moe_route_sigmoid + ops::moe_experts_accumulate on the weights and inputs the device sees
// (bf16-rounded for bf16 experts): fp32 to 1e-5, bf16 to 1e-2; the reference routes from the
// device's router logits (themselves checked against the CPU's to 1e-5) so a near tie cannot
// flip an expert between the two. Decode (T <= 16) and prefill (T > 16) paths, aligned and odd
// widths (the scalar paths), expert groups, and prefill run twice for bit-identical results.
// Bench: decode T = 1 and prefill T = 4096 at Kimi Linear's sizes (D 2304, I 1024, top-8),
// E = 64 bf16 experts.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/dtype.h"
#include "ops/moe/cuda/moe_cuda.h"
#include "ops/moe/moe.h"
#include "ops/nn/nn.h"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;

uint64_t fresh_seed() {
  static uint64_t next = 0x30e5eedull;
  return next += 7;
}

const char* type_name(ElementType t) {
  return t == ElementType::f32 ? "f32" : "bf16";
}

std::vector<float> narrow(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

void sync() {
  cu::check_cuda(cudaDeviceSynchronize(), "moe check sync");
}

std::vector<int32_t> download_ints(const void* p, size_t n) {
  std::vector<int32_t> out(n);
  cu::check_cuda(cudaMemcpy(out.data(), p, n * sizeof(int32_t), cudaMemcpyDeviceToHost),
                 "download ids");
  return out;
}

std::string routing_name(const ops::MoeRouting& r, bool bias) {
  std::string name = "E";
  name += std::to_string(r.num_experts);
  name += " k";
  name += std::to_string(r.top_k);
  if (r.num_groups > 1) {
    name += " groups";
    name += std::to_string(r.num_groups);
    name += "/";
    name += std::to_string(r.topk_groups);
  }
  if (bias) name += " bias";
  name += r.renormalize ? " renorm" : " raw";
  return name;
}

// ---- routing alone ----

void check_route(Tally& tally, const ops::MoeRouting& routing, int64_t T, bool with_bias,
                 bool ties) {
  const int64_t E = routing.num_experts, k = routing.top_k;
  std::vector<float> logits = random_values(size_t(T * E), fresh_seed(), 4.f);
  if (ties)  // a handful of distinct values: many exact ties in choice and in group scores
    for (float& v : logits) v = std::round(v) * 0.5f;
  const std::vector<float> bias = random_values(size_t(E), fresh_seed(), 0.1f);
  const float* bias_host = with_bias ? bias.data() : nullptr;
  std::vector<int32_t> ids_ref(size_t(T * k));
  std::vector<float> w_ref(size_t(T * k));
  ops::moe_route_sigmoid(routing, logits.data(), T, bias_host, ids_ref.data(), w_ref.data());

  DeviceArray logits_d = to_device(logits, ElementType::f32);
  DeviceArray bias_d = to_device(bias, ElementType::f32);
  DeviceBuffer ids_d(size_t(T * k) * 4), w_d(size_t(T * k) * 4);
  poison(ids_d.data(), ids_d.bytes());
  poison(w_d.data(), w_d.bytes());
  cu::moe_route(routing, logits_d.buffer.as<float>(), T,
                with_bias ? bias_d.buffer.as<float>() : nullptr, ids_d.as<int32_t>(),
                w_d.as<float>(), nullptr);
  sync();
  const std::vector<int32_t> ids = download_ints(ids_d.data(), size_t(T * k));
  int64_t mismatches = 0;
  for (size_t i = 0; i < ids.size(); ++i) mismatches += ids[i] != ids_ref[i];
  const std::string name = "moe route " + routing_name(routing, with_bias) + (ties ? " ties" : "") +
                           " T" + std::to_string(T);
  report(tally, name + " ids (mismatches)", double(mismatches), 0.0);
  const std::vector<double> w = from_device(w_d.data(), size_t(T * k), ElementType::f32);
  report(tally, name + " weights", rel_error(w, std::vector<double>(w_ref.begin(), w_ref.end())),
         1e-6);
}

// ---- the whole routed forward ----

struct MoeCase {
  ops::MoeRouting routing;
  int64_t D = 0, I = 0;
  bool bias = false;
};

// Host weights (fp32) and their device copies.
struct MoeModel {
  std::vector<float> router, bias, gate_up, down;
  DeviceArray router_d, bias_d, gate_up_d, down_d;
  cu::MoeDeviceWeights weights(const MoeCase& c, ElementType type) const {
    cu::MoeDeviceWeights w;
    w.D = c.D;
    w.I = c.I;
    w.router = router_d.buffer.as<float>();
    w.correction_bias = c.bias ? bias_d.buffer.as<float>() : nullptr;
    w.expert_type = type;
    w.gate_up = gate_up_d.data();
    w.down = down_d.data();
    return w;
  }
};

MoeModel make_model(const MoeCase& c, ElementType type) {
  const int64_t E = c.routing.num_experts, D = c.D, I = c.I;
  MoeModel m;
  m.router = random_values(size_t(E * D), fresh_seed(), 2.f / std::sqrt(float(D)));
  m.bias = random_values(size_t(E), fresh_seed(), 0.1f);
  m.gate_up = random_values(size_t(E * 2 * I * D), fresh_seed(), 2.f / std::sqrt(float(D)));
  m.down = random_values(size_t(E * D * I), fresh_seed(), 2.f / std::sqrt(float(I)));
  m.router_d = to_device(m.router, ElementType::f32);
  m.bias_d = to_device(m.bias, ElementType::f32);
  m.gate_up_d = to_device(m.gate_up, type);
  m.down_d = to_device(m.down, type);
  return m;
}

// Pre-sizes every workspace buffer and fills it with NaN, so a kernel that reads a value nobody
// wrote shows up in y.
void poison_workspace(cu::MoeDeviceWorkspace& ws, const MoeCase& c, int64_t T) {
  const size_t E = size_t(c.routing.num_experts), pairs = size_t(T * c.routing.top_k);
  const size_t D = size_t(c.D), I = size_t(c.I);
  const auto fill = [](DeviceBuffer& b, size_t bytes) {
    b.reserve(bytes);
    poison(b.data(), b.bytes());
  };
  fill(ws.logits, size_t(T) * E * 4);
  fill(ws.ids, pairs * 4);
  fill(ws.weights, pairs * 4);
  fill(ws.order, 2 * pairs * 4);
  fill(ws.counts, ((pairs / 512 + 1) * E + E + 1) * 4);
  fill(ws.rows, pairs * D * 4);
  fill(ws.hidden, pairs * 2 * I * 4);
  fill(ws.act, pairs * I * 4);
  fill(ws.out, pairs * D * 4);
}

void check_forward(Tally& tally, const MoeCase& c, int64_t T, ElementType type) {
  const ops::MoeRouting& routing = c.routing;
  const int64_t E = routing.num_experts, k = routing.top_k, D = c.D, I = c.I;
  const MoeModel m = make_model(c, type);
  const std::vector<float> x32 = random_values(size_t(T * D), fresh_seed());
  const std::vector<float> y0 = random_values(size_t(T * D), fresh_seed(), 0.1f);
  DeviceArray x32_d = to_device(x32, ElementType::f32);
  DeviceArray x_d = to_device(x32, type);
  DeviceArray y_d = to_device(y0, ElementType::f32);

  cudaStream_t stream = nullptr;
  cu::check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  cu::Gemm gemm(stream);
  cu::MoeDeviceWorkspace ws;
  poison_workspace(ws, c, T);
  const cu::MoeDeviceWeights w = m.weights(c, type);
  cu::moe_routed_forward(routing, w, x32_d.buffer.as<float>(), x_d.data(), T,
                         y_d.buffer.as<float>(), ws, gemm);
  cu::check_cuda(cudaStreamSynchronize(stream), "moe forward");
  const std::vector<double> y = from_device(y_d.data(), size_t(T * D), ElementType::f32);
  const std::vector<double> logits_dev =
      from_device(ws.logits.data(), size_t(T * E), ElementType::f32);

  const std::string name = std::string("moe forward ") + type_name(type) + " " +
                           routing_name(routing, c.bias) + " D" + std::to_string(D) + " I" +
                           std::to_string(I) + " T" + std::to_string(T) +
                           (T <= cu::kMoeGemvTokens ? " (decode)" : " (prefill)");

  // Router logits against the CPU's fp32 product.
  std::vector<float> logits_ref(size_t(T * E));
  ops::linear(x32.data(), T, D, m.router.data(), E, nullptr, logits_ref.data());
  report(tally, name + " logits",
         rel_error(logits_dev, std::vector<double>(logits_ref.begin(), logits_ref.end())), 1e-5);

  // The reference: route from the device's logits, experts on what the device sees.
  const std::vector<float> logits_used = narrow(logits_dev);
  std::vector<int32_t> ids(size_t(T * k));
  std::vector<float> route_w(size_t(T * k));
  ops::moe_route_sigmoid(routing, logits_used.data(), T, c.bias ? m.bias.data() : nullptr,
                         ids.data(), route_w.data());
  const std::vector<int32_t> ids_dev = download_ints(ws.ids.data(), size_t(T * k));
  int64_t mismatches = 0;
  for (size_t i = 0; i < ids.size(); ++i) mismatches += ids[i] != ids_dev[i];
  report(tally, name + " ids (mismatches)", double(mismatches), 0.0);

  const std::vector<float> gate_up = narrow(m.gate_up_d.rounded), down = narrow(m.down_d.rounded);
  const std::vector<float> x = narrow(x_d.rounded);
  std::vector<ops::SwigluWeights> experts(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    experts[size_t(e)] = {gate_up.data() + e * 2 * I * D, down.data() + e * D * I};
  std::vector<float> y_ref = y0;
  ops::MoeWorkspace cpu_ws;
  ops::moe_experts_accumulate(x.data(), T, D, I, experts, ids.data(), route_w.data(), k,
                              y_ref.data(), cpu_ws);
  std::vector<double> delta(y.size()), delta_ref(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    delta[i] = y[i] - double(y0[i]);
    delta_ref[i] = double(y_ref[i]) - double(y0[i]);
  }
  report(tally, name + " y", rel_error(delta, delta_ref), type == ElementType::f32 ? 1e-5 : 1e-2);

  // Run again from y0: the same bits (no atomics, fixed summation orders).
  y_d.buffer.upload(y0.data(), y0.size() * 4);
  cu::moe_routed_forward(routing, w, x32_d.buffer.as<float>(), x_d.data(), T,
                         y_d.buffer.as<float>(), ws, gemm);
  cu::check_cuda(cudaStreamSynchronize(stream), "moe forward (again)");
  const std::vector<double> y2 = from_device(y_d.data(), size_t(T * D), ElementType::f32);
  int64_t differ = 0;
  for (size_t i = 0; i < y.size(); ++i) differ += std::memcmp(&y[i], &y2[i], sizeof(double)) != 0;
  report(tally, name + " rerun identical (differing)", double(differ), 0.0);
  cudaStreamDestroy(stream);
}

ops::MoeRouting make_routing(int64_t E, int64_t k, int64_t groups, int64_t keep, bool renorm,
                             double scaling) {
  ops::MoeRouting r;
  r.num_experts = E;
  r.top_k = k;
  r.num_groups = groups;
  r.topk_groups = keep;
  r.renormalize = renorm;
  r.scaling = scaling;
  return r;
}

void run_checks(Tally& tally) {
  // Routing: plain, biased, grouped (E 16 in 4 groups, keep 2), raw weights, Kimi's 256 / 8,
  // and exact ties.
  for (bool renorm : {true, false})
    for (bool bias : {false, true}) {
      check_route(tally, make_routing(8, 2, 1, 1, renorm, 2.446), 37, bias, false);
      check_route(tally, make_routing(16, 4, 4, 2, renorm, 1.0), 53, bias, false);
    }
  check_route(tally, make_routing(256, 8, 1, 1, true, 2.446), 300, true, false);
  check_route(tally, make_routing(64, 6, 8, 3, true, 1.0), 100, true, false);
  check_route(tally, make_routing(16, 4, 4, 2, true, 1.0), 200, false, true);
  check_route(tally, make_routing(40, 8, 1, 1, false, 1.0), 200, false, true);

  // Forward: the tiny model's sizes; grouped with bias and raw weights; odd widths (scalar
  // paths, unaligned bf16 rows in the gather).
  const MoeCase tiny{make_routing(8, 2, 1, 1, true, 2.446), 128, 32, true};
  const MoeCase grouped{make_routing(16, 4, 4, 2, false, 1.5), 256, 64, true};
  const MoeCase odd{make_routing(6, 3, 1, 1, true, 1.0), 36, 12, false};
  for (ElementType type : {ElementType::f32, ElementType::bf16}) {
    for (int64_t T : {1, 3, 16, 17, 300}) check_forward(tally, tiny, T, type);
    for (int64_t T : {1, 16, 17, 300}) check_forward(tally, grouped, T, type);
    for (int64_t T : {3, 17}) check_forward(tally, odd, T, type);
  }
}

// ---- timings ----

// E experts at Kimi Linear's sizes, bf16; one expert's random weights copied to all of them
// (the routing still reads top_k distinct experts, and the host fills 14 MB, not 900).
void run_bench() {
  const int64_t D = 2304, I = 1024, E = 64, k = 8;
  const MoeCase c{make_routing(E, k, 1, 1, true, 2.446), D, I, true};
  const std::vector<float> one_gate_up = random_values(size_t(2 * I * D), 11, 0.02f);
  const std::vector<float> one_down = random_values(size_t(D * I), 12, 0.03f);
  std::vector<uint16_t> gate_up_bits(one_gate_up.size()), down_bits(one_down.size());
  for (size_t i = 0; i < one_gate_up.size(); ++i) gate_up_bits[i] = f32_to_bf16(one_gate_up[i]);
  for (size_t i = 0; i < one_down.size(); ++i) down_bits[i] = f32_to_bf16(one_down[i]);
  DeviceBuffer gate_up(size_t(E) * gate_up_bits.size() * 2), down(size_t(E) * down_bits.size() * 2);
  for (int64_t e = 0; e < E; ++e) {
    gate_up.upload(gate_up_bits.data(), gate_up_bits.size() * 2,
                   size_t(e) * gate_up_bits.size() * 2);
    down.upload(down_bits.data(), down_bits.size() * 2, size_t(e) * down_bits.size() * 2);
  }
  DeviceArray router = to_device(random_values(size_t(E * D), 13, 0.04f), ElementType::f32);
  DeviceArray bias = to_device(random_values(size_t(E), 14, 0.05f), ElementType::f32);
  cu::MoeDeviceWeights w;
  w.D = D;
  w.I = I;
  w.router = router.buffer.as<float>();
  w.correction_bias = bias.buffer.as<float>();
  w.expert_type = ElementType::bf16;
  w.gate_up = gate_up.data();
  w.down = down.data();

  cudaStream_t stream = nullptr;
  cu::check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  cu::Gemm gemm(stream);
  cu::MoeDeviceWorkspace ws;
  for (int64_t T : {int64_t(1), int64_t(4096)}) {
    const std::vector<float> x32 = random_values(size_t(T * D), 15 + uint64_t(T));
    DeviceArray x32_d = to_device(x32, ElementType::f32);
    DeviceArray x_d = to_device(x32, ElementType::bf16);
    DeviceBuffer y(size_t(T * D) * 4);
    cu::check_cuda(cudaMemset(y.data(), 0, y.bytes()), "cudaMemset");
    const double ms = time_ms(stream, [&] {
      cu::moe_routed_forward(c.routing, w, x32_d.buffer.as<float>(), x_d.data(), T, y.as<float>(),
                             ws, gemm);
    });
    if (T == 1) {
      const double bytes = double(k) * 3 * D * I * 2;
      std::printf("BENCH moe decode T=1 D=%lld I=%lld E=%lld top_k=%lld bf16 us=%.2f GB/s=%.0f\n",
                  (long long)D, (long long)I, (long long)E, (long long)k, ms * 1e3,
                  bytes / (ms * 1e-3) / 1e9);
    } else {
      const double flops = double(T) * k * 6 * D * I;
      std::printf(
          "BENCH moe prefill T=%lld D=%lld I=%lld E=%lld top_k=%lld bf16 ms=%.3f TFLOP/s=%.1f\n",
          (long long)T, (long long)D, (long long)I, (long long)E, (long long)k, ms,
          flops / (ms * 1e-3) / 1e12);
    }
    std::fflush(stdout);
  }
  cudaStreamDestroy(stream);
}

void run_suite(const SuiteOptions& options, Tally& tally) {
  if (options.check) run_checks(tally);
  if (options.bench) run_bench();
}

const bool registered = register_suite("moe", run_suite);

}  // namespace
}  // namespace kda::gpu_check
