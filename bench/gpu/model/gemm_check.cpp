// Suite "gemm": Gemm::linear_add (ops/gemm/cuda/gemm_cuda.h), y = alpha x W^T + beta c with the
// addend c read from its own array, against a float64 reference on the values the device sees
// (bf16-rounded for bf16 inputs): fp32 accumulation over K <= 2048 holds 2e-5. Every shape runs
// through cuBLASLt and through the copy + cublasGemmEx fallback (set_lt(false)); y starts
// poisoned (NaN) out of place, c must come back bit for bit, and the row padding of a strided y
// must stay as it was. Edges: M = 1, odd N and K, strided rows (odd strides; c's and y's differ
// out of place), pointers off their allocation's alignment, in place (c == y), alpha and beta
// other than 1, beta 0. The trainer's shape must take the cuBLASLt path (no fallback) and repeat
// bit for bit (the cached plan). Bad arguments throw. Bench: the lineage trainer's residual adds
// (R = 16384, d = 768, K = 768 and 2048), copy + linear against linear_add.
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "ops/gemm/cuda/gemm_cuda.h"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;

uint64_t fresh_seed() {
  static uint64_t next = 0x6e33add5ull;
  return next += 11;
}

void sync() {
  cu::check_cuda(cudaDeviceSynchronize(), "gemm check sync");
}

struct AddCase {
  std::string name;
  ElementType in = ElementType::bf16;
  int64_t M = 0, N = 0, K = 0;
  int64_t pad = 0;    // extra elements at the end of every row of x, W, c and y
  int64_t shift = 0;  // elements every pointer sits after its allocation's (aligned) start
  bool in_place = false;
  float alpha = 1.f, beta = 1.f;
};

// A random [rows, ld] array (padding included) `shift` elements into a device allocation.
struct Strided {
  DeviceArray array;
  int64_t ld = 0, shift = 0;
  std::vector<float> host;  // what was uploaded, shift included
  void* at() const {
    return static_cast<char*>(array.data()) + shift * int64_t(cu::element_bytes(array.type));
  }
  double value(int64_t row, int64_t col) const {
    return array.rounded[size_t(shift + row * ld + col)];
  }
};

Strided random_strided(int64_t rows, int64_t ld, int64_t shift, ElementType type) {
  Strided s;
  s.ld = ld;
  s.shift = shift;
  s.host = random_values(size_t(shift + rows * ld), fresh_seed());
  s.array = to_device(s.host, type);
  return s;
}

std::string case_name(const AddCase& c, bool lt) {
  return std::string("linear_add ") + (c.in == ElementType::f32 ? "f32 " : "bf16 ") + c.name +
         " M" + std::to_string(c.M) + " N" + std::to_string(c.N) + " K" + std::to_string(c.K) +
         (c.in_place ? " in place" : "") + (lt ? " cublasLt" : " fallback");
}

void run_case(cu::Gemm& gemm, const AddCase& c, bool lt, Tally& tally) {
  const int64_t ldx = c.K + c.pad, ldw = c.K + c.pad, ldc = c.N + c.pad;
  const Strided x = random_strided(c.M, ldx, c.shift, c.in);
  const Strided W = random_strided(c.N, ldw, c.shift, c.in);
  const Strided addend = random_strided(c.M, ldc, c.shift, ElementType::f32);
  // out of place, a strided y gets its own stride (cuBLASLt's C and D layouts differ)
  const int64_t ldy = c.in_place || c.pad == 0 ? ldc : ldc + 2;
  const size_t y_floats = size_t(c.shift + c.M * ldy);
  DeviceBuffer y_buffer(c.in_place ? 0 : y_floats * 4);
  if (!c.in_place) poison(y_buffer.data(), y_buffer.bytes());
  float* y = c.in_place ? static_cast<float*>(addend.at())
                        : static_cast<float*>(y_buffer.data()) + c.shift;
  gemm.set_lt(lt);
  gemm.linear_add(c.in, c.M, c.N, c.K, {x.at(), ldx}, {W.at(), ldw}, {addend.at(), ldc},
                  {y, ElementType::f32, ldy}, c.alpha, c.beta);
  sync();
  gemm.set_lt(true);
  const std::vector<float> y_all =
      download(static_cast<float*>(y) - c.shift, y_floats);  // the whole allocation
  std::vector<double> out(size_t(c.M * c.N)), ref(out.size());
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < c.K; ++k) dot += x.value(i, k) * W.value(j, k);
      ref[size_t(i * c.N + j)] = double(c.alpha) * dot + double(c.beta) * addend.value(i, j);
      out[size_t(i * c.N + j)] = y_all[size_t(c.shift + i * ldy + j)];
    }
  const std::string name = case_name(c, lt);
  report(tally, name, rel_error(out, ref), 2e-5);
  // Everything outside the [M, N] block is as it was: the shift, the row padding (poison out of
  // place, c's own values in place)
  bool untouched = true;
  for (size_t e = 0; e < y_floats; ++e) {
    const int64_t col = (int64_t(e) - c.shift) % ldy;
    if (int64_t(e) >= c.shift && col < c.N) continue;
    uint32_t bits;
    std::memcpy(&bits, &y_all[e], 4);
    if (c.in_place ? std::memcmp(&y_all[e], &addend.host[e], 4) != 0 : bits != 0xFFFFFFFFu)
      untouched = false;
  }
  if (c.pad > 0 || c.shift > 0) report_same(tally, name + " padding untouched", untouched);
  if (!c.in_place)
    report_same(tally, name + " c unchanged",
                same_bits(download(addend.array.data(), addend.host.size()), addend.host));
}

void check_linear_add(Tally& tally) {
  cudaStream_t stream;
  cu::check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  {
    cu::Gemm gemm(stream);
    const std::vector<AddCase> cases = {
        {"aligned", ElementType::bf16, 64, 96, 128},
        {"aligned", ElementType::bf16, 64, 96, 128, 0, 0, true},
        {"trainer d", ElementType::bf16, 256, 768, 768},
        {"trainer F", ElementType::bf16, 64, 768, 2048},
        {"one row", ElementType::bf16, 1, 7, 5},
        {"odd", ElementType::bf16, 33, 29, 37, 0, 0, false, 0.75f, -1.25f},
        {"odd", ElementType::bf16, 33, 29, 37, 0, 0, true, 0.75f, -1.25f},
        {"strided odd", ElementType::bf16, 17, 40, 24, 3, 0, false},
        {"strided odd", ElementType::bf16, 17, 40, 24, 3, 0, true},
        {"misaligned", ElementType::bf16, 19, 64, 64, 0, 1, false, 1.5f, 0.5f},
        {"misaligned", ElementType::bf16, 19, 64, 64, 0, 1, true},
        {"strided misaligned", ElementType::bf16, 9, 31, 33, 5, 3, false},
        {"beta 0", ElementType::bf16, 16, 32, 48, 0, 0, false, 1.f, 0.f},
        {"aligned", ElementType::f32, 64, 96, 128},
        {"aligned", ElementType::f32, 64, 96, 128, 0, 0, true},
        {"one row", ElementType::f32, 1, 7, 5},
        {"odd", ElementType::f32, 33, 29, 37, 0, 0, false, 0.75f, -1.25f},
        {"strided misaligned", ElementType::f32, 9, 31, 33, 5, 1, true},
        {"strided misaligned", ElementType::f32, 9, 31, 33, 5, 1, false},
    };
    for (const AddCase& c : cases) {
      run_case(gemm, c, true, tally);
      run_case(gemm, c, false, tally);
    }
    std::printf(
        "INFO linear_add: %lld of the cuBLASLt-path calls above fell back to cublasGemmEx\n",
        static_cast<long long>(gemm.lt_fallbacks() - int64_t(cases.size())));

    // The trainer's layout (bf16 [R, K] x [d, K]^T + fp32 [R, d], 256-byte aligned): cuBLASLt
    // itself, the same bits on a repeat (the cached plan), c read and never written
    const int64_t M = 512, N = 768, K = 768;
    const DeviceArray x = to_device(random_values(size_t(M * K), fresh_seed()), ElementType::bf16);
    const DeviceArray W = to_device(random_values(size_t(N * K), fresh_seed()), ElementType::bf16);
    const DeviceArray c = to_device(random_values(size_t(M * N), fresh_seed()), ElementType::f32);
    DeviceBuffer y1(size_t(M * N) * 4), y2(size_t(M * N) * 4);
    poison(y1.data(), y1.bytes());
    poison(y2.data(), y2.bytes());
    const int64_t before = gemm.lt_fallbacks();
    gemm.linear_add(ElementType::bf16, M, N, K, {x.data()}, {W.data()}, {c.data()},
                    {y1.data(), ElementType::f32});
    gemm.linear_add(ElementType::bf16, M, N, K, {x.data()}, {W.data()}, {c.data()},
                    {y2.data(), ElementType::f32});
    sync();
    report_same(tally, "linear_add bf16 trainer layout runs on cuBLASLt (no fallback)",
                gemm.lt_fallbacks() == before);
    report_same(tally, "linear_add bf16 trainer layout repeats bit for bit",
                same_bits(download(y1.data(), size_t(M * N)), download(y2.data(), size_t(M * N))));

    float* y = static_cast<float*>(y1.data());
    report_throws(tally, "linear_add in place with c.ld != y.ld", [&] {
      gemm.linear_add(ElementType::bf16, 4, 8, 8, {x.data()}, {W.data()}, {y, 16},
                      {y, ElementType::f32, 8});
    });
    report_throws(tally, "linear_add c and y overlapping", [&] {
      gemm.linear_add(ElementType::bf16, 4, 8, 8, {x.data()}, {W.data()}, {y},
                      {y + 1, ElementType::f32});
    });
    report_throws(tally, "linear_add bf16 output", [&] {
      gemm.linear_add(ElementType::bf16, 4, 8, 8, {x.data()}, {W.data()}, {c.data()},
                      {y, ElementType::bf16});
    });
    report_throws(tally, "linear_add row stride shorter than the row", [&] {
      gemm.linear_add(ElementType::bf16, 4, 8, 8, {x.data(), 4}, {W.data()}, {c.data()},
                      {y, ElementType::f32});
    });
  }
  cu::check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
}

// The lineage trainer's two residual adds a layer: copy + linear(beta 1) against linear_add
void bench_linear_add() {
  cudaStream_t stream;
  cu::check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  {
    cu::Gemm gemm(stream);
    const int64_t R = 16384, d = 768;
    for (const int64_t K : {int64_t(768), int64_t(2048)}) {
      const DeviceArray x =
          to_device(random_values(size_t(R * K), fresh_seed()), ElementType::bf16);
      const DeviceArray W =
          to_device(random_values(size_t(d * K), fresh_seed()), ElementType::bf16);
      const DeviceArray c = to_device(random_values(size_t(R * d), fresh_seed()), ElementType::f32);
      DeviceBuffer y(size_t(R * d) * 4);
      const size_t bytes = size_t(R * d) * 4;
      const double copy_ms = time_ms(stream, [&] {
        cu::check_cuda(cudaMemcpyAsync(y.data(), c.data(), bytes, cudaMemcpyDeviceToDevice, stream),
                       "copy");
      });
      const double old_ms = time_ms(stream, [&] {
        cu::check_cuda(cudaMemcpyAsync(y.data(), c.data(), bytes, cudaMemcpyDeviceToDevice, stream),
                       "copy");
        gemm.linear(ElementType::bf16, R, d, K, {x.data()}, {W.data()}, {y.data()}, 1.f, 1.f);
      });
      const double new_ms = time_ms(stream, [&] {
        gemm.linear_add(ElementType::bf16, R, d, K, {x.data()}, {W.data()}, {c.data()},
                        {y.data(), ElementType::f32});
      });
      const double flops = 2.0 * double(R) * double(d) * double(K);
      std::printf(
          "BENCH gemm residual add bf16 R=%lld N=%lld K=%lld: copy %.3f ms + linear(beta 1) "
          "= %.3f ms, linear_add %.3f ms (%.1f TFLOP/s), saves %.3f ms\n",
          static_cast<long long>(R), static_cast<long long>(d), static_cast<long long>(K), copy_ms,
          old_ms, new_ms, flops / new_ms * 1e-9, old_ms - new_ms);
    }
  }
  cu::check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
}

void run_suite(const SuiteOptions& options, Tally& tally) {
  if (options.check) check_linear_add(tally);
  if (options.bench) bench_linear_add();
}

const bool registered = register_suite("gemm", run_suite);

}  // namespace
}  // namespace kda::gpu_check
