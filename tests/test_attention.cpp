// Causal softmax attention: the float64 reference against PyTorch's fixture, the flash forward
// and backward against the reference (and float64 finite differences), the KV cache's decode
// and prefill against one whole prefill, and the bad arguments that must throw.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "ops/attention/attention.h"

namespace kda {
namespace {

using ops::AttentionGrads;
using ops::AttentionInputs;
using ops::AttentionShape;
using ops::FlashBlocks;
using ops::KvCache;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ||ours - ref|| / ||ref|| over the whole tensor; infinity if anything is not finite.
template <class A, class B>
double relative_error(const std::vector<A>& ours, const std::vector<B>& ref) {
  if (ours.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    const double d = double(ours[i]) - double(ref[i]);
    diff += d * d;
    norm += double(ref[i]) * double(ref[i]);
  }
  const double error = std::sqrt(diff / norm);
  return std::isfinite(error) ? error : std::numeric_limits<double>::infinity();
}

std::vector<float> random_vector(Random& rng, int64_t n, float stddev = 1.0f) {
  std::vector<float> out(static_cast<size_t>(n));
  rng.fill_normal(out, stddev);
  return out;
}

std::vector<double> to_double(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

std::vector<float> poisoned(int64_t n) {
  return std::vector<float>(static_cast<size_t>(n), kNaN);
}

// Random inputs of one attention problem, in fp32 and float64.
struct Problem {
  AttentionShape shape;
  std::vector<int64_t> cu_seqlens;
  std::vector<float> q, k, v;
  std::vector<double> q64, k64, v64;

  Problem(const AttentionShape& s, std::vector<int64_t> cu, uint64_t seed, float q_stddev = 1.0f)
      : shape(s), cu_seqlens(std::move(cu)) {
    Random rng(seed);
    q = random_vector(rng, s.B * s.T * s.H * s.D, q_stddev);
    k = random_vector(rng, s.B * s.T * s.HKV * s.D);
    v = random_vector(rng, s.B * s.T * s.HKV * s.DV);
    q64 = to_double(q), k64 = to_double(k), v64 = to_double(v);
  }
  int64_t tokens() const { return shape.B * shape.T; }
  int64_t o_size() const { return tokens() * shape.H * shape.DV; }
  AttentionInputs<float> inputs() const {
    return {shape, q.data(), k.data(), v.data(), cu_seqlens};
  }
  AttentionInputs<double> inputs64() const {
    return {shape, q64.data(), k64.data(), v64.data(), cu_seqlens};
  }
  std::vector<double> reference(std::vector<double>* lse = nullptr) const {
    std::vector<double> o(static_cast<size_t>(o_size()));
    if (lse) lse->assign(static_cast<size_t>(tokens() * shape.H), 0.0);
    ops::attention_reference(inputs64(), o.data(), lse ? lse->data() : nullptr);
    return o;
  }
};

AttentionShape make_shape(int64_t B, int64_t T, int64_t H, int64_t HKV, int64_t D, int64_t DV,
                          double scale = 0) {
  AttentionShape s;
  s.B = B, s.T = T, s.H = H, s.HKV = HKV, s.D = D, s.DV = DV, s.scale = scale;
  return s;
}

std::string describe(const AttentionShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) +
         " HKV=" + std::to_string(s.HKV) + " D=" + std::to_string(s.D) +
         " DV=" + std::to_string(s.DV);
}

// ---------------------------------------------------------------- golden fixture (PyTorch)

struct Fixture {
  SafetensorsFile file =
      SafetensorsFile::open(std::string(KDA_SHARED_DIR) + "/fixtures/ops/softmax_gqa.safetensors");
  AttentionShape shape;
  std::vector<float> get(const std::string& name) const {
    const Tensor t = file.load(name);
    return {t.f32(), t.f32() + t.numel()};
  }
  int64_t meta(const std::string& key) const { return std::stoll(file.metadata().at(key)); }
  Fixture() {
    shape = make_shape(meta("B"), meta("T"), meta("H"), meta("HKV"), meta("D"), meta("D"),
                       std::stod(file.metadata().at("scale")));
  }
};

TEST(AttentionFixture, ReferenceMatchesTorch) {
  const Fixture f;
  const std::vector<double> q = to_double(f.get("q")), k = to_double(f.get("k")),
                            v = to_double(f.get("v"));
  std::vector<double> o(f.get("o").size(), double(kNaN));
  ops::attention_reference({f.shape, q.data(), k.data(), v.data()}, o.data());
  EXPECT_LE(relative_error(o, f.get("o")), 1e-5);
}

TEST(AttentionFixture, FlashForwardAndBackwardMatchTorch) {
  const Fixture f;
  const AttentionShape& s = f.shape;
  const std::vector<float> q = f.get("q"), k = f.get("k"), v = f.get("v"), d_o = f.get("do_out");
  const AttentionInputs<float> in{s, q.data(), k.data(), v.data()};
  std::vector<float> o = poisoned(s.B * s.T * s.H * s.DV), lse = poisoned(s.B * s.T * s.H);
  ops::attention_flash_forward(in, o.data(), lse.data());
  EXPECT_LE(relative_error(o, f.get("o")), 1e-5);

  std::vector<float> dq = poisoned(int64_t(q.size())), dk = poisoned(int64_t(k.size())),
                     dv = poisoned(int64_t(v.size()));
  ops::attention_flash_backward(in, o.data(), lse.data(), d_o.data(),
                                {dq.data(), dk.data(), dv.data()});
  EXPECT_LE(relative_error(dq, f.get("dq")), 1e-4);
  EXPECT_LE(relative_error(dk, f.get("dk")), 1e-4);
  EXPECT_LE(relative_error(dv, f.get("dv")), 1e-4);
}

// ---------------------------------------------------------------- flash forward vs reference

void expect_flash_matches_reference(const Problem& p, FlashBlocks blocks, double tolerance) {
  std::vector<double> lse_ref;
  const std::vector<double> o_ref = p.reference(&lse_ref);
  std::vector<float> o = poisoned(p.o_size()), lse = poisoned(p.tokens() * p.shape.H);
  ops::attention_flash_forward(p.inputs(), o.data(), lse.data(), blocks);
  EXPECT_LE(relative_error(o, o_ref), tolerance)
      << describe(p.shape) << " blocks " << blocks.query_rows << "/" << blocks.key_block;
  EXPECT_LE(relative_error(lse, lse_ref), tolerance) << describe(p.shape);
}

TEST(AttentionFlash, MatchesReferenceOnShapes) {
  const std::vector<AttentionShape> shapes = {
      make_shape(1, 1, 2, 1, 16, 16),       make_shape(3, 1, 4, 2, 32, 8),
      make_shape(2, 63, 4, 2, 32, 32),      make_shape(1, 64, 4, 4, 64, 48),
      make_shape(1, 65, 2, 2, 16, 24),      make_shape(2, 200, 4, 2, 32, 32),
      make_shape(1, 200, 6, 2, 24, 40),     make_shape(1, 300, 4, 1, 128, 128),
      make_shape(1, 130, 2, 2, 16, 16, 0.3)};
  uint64_t seed = 100;
  for (const AttentionShape& s : shapes) {
    expect_flash_matches_reference(Problem(s, {}, ++seed), {}, 1e-5);
  }
}

TEST(AttentionFlash, OddTileSizes) {
  // Tiles that do not divide each other leave rows with no visible key in a key tile.
  const Problem p(make_shape(2, 200, 4, 2, 16, 24), {}, 7);
  for (const FlashBlocks blocks : {FlashBlocks{16, 48}, FlashBlocks{7, 5}, FlashBlocks{64, 64},
                                   FlashBlocks{1, 1}, FlashBlocks{256, 512}}) {
    expect_flash_matches_reference(p, blocks, 1e-5);
  }
}

TEST(AttentionFlash, PeakedSoftmax) {
  // Large scores: the running max moves a lot between key tiles.
  const Problem p(make_shape(1, 257, 2, 1, 32, 32), {}, 8, 3.0f);
  expect_flash_matches_reference(p, {32, 32}, 1e-5);
}

TEST(AttentionFlash, VarlenWithLengthOneSequence) {
  const std::vector<int64_t> cu = {0, 1, 70, 71, 200, 264};
  const Problem p(make_shape(1, 264, 4, 2, 32, 16), cu, 9);
  expect_flash_matches_reference(p, {}, 1e-5);
  expect_flash_matches_reference(p, {16, 32}, 1e-5);

  // The packed reference equals the reference of one sequence alone (no leak across sequences).
  const std::vector<double> packed = p.reference();
  const AttentionShape& s = p.shape;
  const int64_t first = 71, length = 129;
  const AttentionShape alone = make_shape(1, length, s.H, s.HKV, s.D, s.DV);
  std::vector<double> o(static_cast<size_t>(length * s.H * s.DV));
  ops::attention_reference(
      {alone, p.q64.data() + first * s.H * s.D, p.k64.data() + first * s.HKV * s.D,
       p.v64.data() + first * s.HKV * s.DV},
      o.data());
  for (size_t i = 0; i < o.size(); ++i) ASSERT_EQ(o[i], packed[first * s.H * s.DV + i]) << i;
}

TEST(AttentionFlash, ForwardFlops) {
  const AttentionShape s = make_shape(2, 100, 4, 2, 64, 32);
  EXPECT_DOUBLE_EQ(ops::attention_forward_flops(s), 2.0 * 2 * (100.0 * 101 / 2) * 4 * 96);
  const std::vector<int64_t> cu = {0, 1, 11};
  EXPECT_DOUBLE_EQ(ops::attention_forward_flops(make_shape(1, 11, 1, 1, 8, 8), cu),
                   2.0 * (1 + 55) * 16);
}

// ---------------------------------------------------------------- backward vs finite differences

// d/dx of sum(o * d_o) through the float64 reference by central differences, at `coords`.
std::vector<double> finite_differences(const Problem& p, const std::vector<double>& d_o,
                                       std::vector<double> Problem::*input,
                                       const std::vector<size_t>& coords) {
  Problem work = p;
  auto loss = [&]() {
    const std::vector<double> o = work.reference();
    double sum = 0;
    for (size_t i = 0; i < o.size(); ++i) sum += o[i] * d_o[i];
    return sum;
  };
  constexpr double eps = 1e-5;
  std::vector<double> grad;
  for (size_t c : coords) {
    double& x = (work.*input)[c];
    const double saved = x;
    x = saved + eps;
    const double up = loss();
    x = saved - eps;
    const double down = loss();
    x = saved;
    grad.push_back((up - down) / (2 * eps));
  }
  return grad;
}

// Flash backward against finite differences on `samples` random coordinates of each input
// (every coordinate when samples is 0).
void expect_backward_matches_finite_differences(const Problem& p, FlashBlocks forward_blocks,
                                                FlashBlocks backward_blocks, int samples,
                                                uint64_t seed) {
  const AttentionShape& s = p.shape;
  Random rng(seed);
  const std::vector<float> d_o = random_vector(rng, p.o_size());
  std::vector<float> o = poisoned(p.o_size()), lse = poisoned(p.tokens() * s.H);
  ops::attention_flash_forward(p.inputs(), o.data(), lse.data(), forward_blocks);
  std::vector<float> dq = poisoned(int64_t(p.q.size())), dk = poisoned(int64_t(p.k.size())),
                     dv = poisoned(int64_t(p.v.size()));
  ops::attention_flash_backward(p.inputs(), o.data(), lse.data(), d_o.data(),
                                {dq.data(), dk.data(), dv.data()}, backward_blocks);

  const std::vector<double> d_o64 = to_double(d_o);
  struct Check {
    const char* name;
    std::vector<double> Problem::*input;
    const std::vector<float>* grad;
  };
  for (const Check& check : {Check{"dq", &Problem::q64, &dq}, Check{"dk", &Problem::k64, &dk},
                             Check{"dv", &Problem::v64, &dv}}) {
    const size_t n = check.grad->size();
    std::vector<size_t> coords;
    if (samples == 0) {
      for (size_t i = 0; i < n; ++i) coords.push_back(i);
    } else {
      for (int i = 0; i < samples; ++i) coords.push_back(size_t(rng.integer(0, int64_t(n) - 1)));
    }
    const std::vector<double> expected = finite_differences(p, d_o64, check.input, coords);
    std::vector<float> ours;
    for (size_t c : coords) ours.push_back((*check.grad)[c]);
    EXPECT_LE(relative_error(ours, expected), 1e-4) << check.name << " " << describe(s);
    // Every element written (no NaN left from the poison), also outside the sample.
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite((*check.grad)[i])) << check.name;
  }
}

TEST(AttentionBackward, FullGradientMatchesFiniteDifferences) {
  // Tiny shapes, every coordinate; small tiles so several query and key tiles meet.
  const Problem batched(make_shape(2, 9, 4, 2, 5, 6), {}, 21);
  expect_backward_matches_finite_differences(batched, {4, 3}, {4, 3}, 0, 22);
  const Problem packed(make_shape(1, 11, 2, 1, 4, 3), {0, 1, 6, 11}, 23);
  expect_backward_matches_finite_differences(packed, {}, {2, 3}, 0, 24);
}

TEST(AttentionBackward, SampledGradientMatchesFiniteDifferences) {
  // Longer than one tile with the default tile sizes, T not a multiple of the tile.
  const Problem p(make_shape(1, 130, 4, 2, 8, 12), {}, 31);
  expect_backward_matches_finite_differences(p, {}, {}, 24, 32);
}

// ---------------------------------------------------------------- KV cache: decode and prefill

// Rows of token `t` of sequence `n` (packed by cu) of a [tokens, heads, width] tensor.
template <class F>
const F* token_rows(const std::vector<F>& x, const std::vector<int64_t>& cu, int64_t n, int64_t t,
                    int64_t heads, int64_t width) {
  return x.data() + (cu[n] + t) * heads * width;
}

TEST(AttentionKvCache, DecodeTokenByTokenMatchesPrefill) {
  // Three sequences of the same length decoded together from empty slots.
  const AttentionShape s = make_shape(3, 70, 4, 2, 32, 24);
  const Problem p(s, {}, 41);
  std::vector<float> prefill = poisoned(p.o_size());
  ops::attention_flash_forward(p.inputs(), prefill.data(), nullptr);
  const std::vector<double> reference = p.reference();

  for (int64_t keys_per_split : {int64_t(0), int64_t(5)}) {
    KvCache cache(s.B, s.HKV, s.D, s.DV);
    std::vector<float> decoded = poisoned(p.o_size());
    AttentionShape step = s;
    step.T = 1;
    for (int64_t t = 0; t < s.T; ++t) {
      std::vector<float> q(static_cast<size_t>(s.B * s.H * s.D));
      std::vector<float> k(static_cast<size_t>(s.B * s.HKV * s.D));
      std::vector<float> v(static_cast<size_t>(s.B * s.HKV * s.DV));
      for (int64_t b = 0; b < s.B; ++b) {
        const int64_t token = b * s.T + t;
        std::copy_n(p.q.data() + token * s.H * s.D, s.H * s.D, q.data() + b * s.H * s.D);
        std::copy_n(p.k.data() + token * s.HKV * s.D, s.HKV * s.D, k.data() + b * s.HKV * s.D);
        std::copy_n(p.v.data() + token * s.HKV * s.DV, s.HKV * s.DV, v.data() + b * s.HKV * s.DV);
      }
      std::vector<float> o = poisoned(s.B * s.H * s.DV);
      ops::attention_decode_step(step, cache, q.data(), k.data(), v.data(), o.data(), {},
                                 keys_per_split);
      for (int64_t b = 0; b < s.B; ++b) {
        std::copy_n(o.data() + b * s.H * s.DV, s.H * s.DV,
                    decoded.data() + (b * s.T + t) * s.H * s.DV);
      }
    }
    EXPECT_EQ(cache.length(2), s.T);
    EXPECT_LE(relative_error(decoded, prefill), 1e-5) << "keys_per_split " << keys_per_split;
    EXPECT_LE(relative_error(decoded, reference), 1e-5) << "keys_per_split " << keys_per_split;
  }
}

TEST(AttentionKvCache, PrefillThenDecodeMatchesFullPrefill) {
  // Sequences of 41, 70 and 31 tokens: prefill packed prompts of 11, 40 and 1 tokens into
  // permuted slots in two chunks (the third sequence sits the second chunk out), then decode
  // the last 30 tokens of each one step at a time.
  const std::vector<int64_t> cu = {0, 41, 111, 142};
  const std::vector<int64_t> prompt_lengths = {11, 40, 1}, slots = {2, 0, 1};
  const AttentionShape s = make_shape(1, 142, 6, 2, 16, 24);
  const Problem p(s, cu, 51);
  const std::vector<double> reference = p.reference();
  const int64_t N = 3;

  // Gathers tokens [first, first + count) of every sequence into a packed [sum, heads, width].
  auto gather = [&](const std::vector<float>& x, int64_t heads, int64_t width,
                    const std::vector<int64_t>& firsts, const std::vector<int64_t>& counts) {
    std::vector<float> out;
    for (int64_t n = 0; n < N; ++n) {
      const float* rows = token_rows(x, cu, n, firsts[n], heads, width);
      out.insert(out.end(), rows, rows + counts[n] * heads * width);
    }
    return out;
  };
  KvCache cache(3, s.HKV, s.D, s.DV);
  std::vector<float> ours = poisoned(p.o_size());
  // Prefill in two chunks: the first half of each prompt (at least one token), then the rest.
  std::vector<int64_t> done(N, 0);
  for (int chunk = 0; chunk < 2; ++chunk) {
    std::vector<int64_t> counts(N);
    for (int64_t n = 0; n < N; ++n) {
      counts[n] = chunk == 0 ? (prompt_lengths[n] + 1) / 2 : prompt_lengths[n] - done[n];
    }
    // A sequence with nothing left this chunk is left out of the packed batch.
    std::vector<int64_t> live_slots, live_cu = {0}, live_n;
    for (int64_t n = 0; n < N; ++n) {
      if (counts[n] == 0) continue;
      live_slots.push_back(slots[n]);
      live_cu.push_back(live_cu.back() + counts[n]);
      live_n.push_back(n);
    }
    const std::vector<float> q = gather(p.q, s.H, s.D, done, counts);
    const std::vector<float> k = gather(p.k, s.HKV, s.D, done, counts);
    const std::vector<float> v = gather(p.v, s.HKV, s.DV, done, counts);
    AttentionShape chunk_shape = s;
    chunk_shape.T = live_cu.back();
    std::vector<float> o = poisoned(chunk_shape.T * s.H * s.DV);
    ops::attention_prefill({chunk_shape, q.data(), k.data(), v.data(), live_cu}, cache, o.data(),
                           nullptr, live_slots, {16, 16});
    for (size_t i = 0; i < live_n.size(); ++i) {
      const int64_t n = live_n[i];
      std::copy_n(o.data() + live_cu[i] * s.H * s.DV, counts[n] * s.H * s.DV,
                  ours.data() + (cu[n] + done[n]) * s.H * s.DV);
      done[n] += counts[n];
    }
  }
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(cache.length(slots[n]), prompt_lengths[n]);

  // Decode: all three sequences step together (each has the same number of tokens left).
  AttentionShape step = s;
  step.B = N;
  for (int64_t i = 0; i < 30; ++i) {
    std::vector<int64_t> firsts(N), ones(N, 1);
    for (int64_t n = 0; n < N; ++n) firsts[n] = prompt_lengths[n] + i;
    const std::vector<float> q = gather(p.q, s.H, s.D, firsts, ones);
    const std::vector<float> k = gather(p.k, s.HKV, s.D, firsts, ones);
    const std::vector<float> v = gather(p.v, s.HKV, s.DV, firsts, ones);
    std::vector<float> o = poisoned(N * s.H * s.DV);
    ops::attention_decode_step(step, cache, q.data(), k.data(), v.data(), o.data(), slots);
    for (int64_t n = 0; n < N; ++n) {
      std::copy_n(o.data() + n * s.H * s.DV, s.H * s.DV,
                  ours.data() + (cu[n] + firsts[n]) * s.H * s.DV);
    }
  }
  EXPECT_LE(relative_error(ours, reference), 1e-5);
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(cache.length(slots[n]), cu[n + 1] - cu[n]);
}

TEST(AttentionKvCache, GrowsKeepsContentsAndReportsBytes) {
  KvCache cache(2, 2, 4, 3);
  EXPECT_EQ(cache.bytes_per_token(), 2 * (4 + 3) * 4);
  EXPECT_EQ(cache.bytes_reserved(), 0);
  Random rng(61);
  const std::vector<float> k = random_vector(rng, 100 * 2 * 4), v = random_vector(rng, 100 * 2 * 3);
  for (int64_t t = 0; t < 100;) {
    const int64_t n = std::min<int64_t>(1 + t % 7, 100 - t);
    cache.append(1, k.data() + t * 8, v.data() + t * 6, n);
    t += n;
  }
  EXPECT_EQ(cache.length(1), 100);
  EXPECT_GE(cache.capacity(1), 100);
  EXPECT_EQ(cache.length(0), 0);
  EXPECT_TRUE(std::equal(k.begin(), k.end(), cache.keys(1)));
  EXPECT_TRUE(std::equal(v.begin(), v.end(), cache.values(1)));
  EXPECT_EQ(cache.bytes_used(), 100 * cache.bytes_per_token());
  EXPECT_EQ(cache.bytes_reserved(), cache.capacity(1) * cache.bytes_per_token());
  cache.clear(1);
  EXPECT_EQ(cache.length(1), 0);
  EXPECT_GE(cache.capacity(1), 100);
  cache.release(1);
  EXPECT_EQ(cache.bytes_reserved(), 0);

  // A bounded cache refuses to pass max_tokens and leaves the slot as it was.
  KvCache bounded(1, 2, 4, 3, 10);
  bounded.append(0, k.data(), v.data(), 8);
  EXPECT_THROW(bounded.append(0, k.data(), v.data(), 3), Error);
  EXPECT_EQ(bounded.length(0), 8);
  EXPECT_LE(bounded.capacity(0), 10);
  bounded.append(0, k.data(), v.data(), 2);
  EXPECT_EQ(bounded.length(0), 10);
  EXPECT_THROW(bounded.reserve(0, 11), Error);
  EXPECT_THROW(bounded.length(1), Error);
}

// ---------------------------------------------------------------- bad arguments

TEST(AttentionErrors, BadArgumentsThrow) {
  const Problem p(make_shape(1, 10, 4, 2, 8, 8), {}, 71);
  std::vector<float> o = poisoned(p.o_size()), lse = poisoned(p.tokens() * 4);
  std::vector<double> o64(o.size());

  AttentionInputs<float> in = p.inputs();
  in.shape.HKV = 3;  // H = 4 is not a multiple
  EXPECT_THROW(ops::attention_flash_forward(in, o.data(), lse.data()), Error);
  AttentionInputs<double> in64 = p.inputs64();
  in64.shape.HKV = 3;
  EXPECT_THROW(ops::attention_reference(in64, o64.data()), Error);
  EXPECT_THROW(KvCache(1, 0, 8, 8), Error);

  for (const std::vector<int64_t>& cu :
       {std::vector<int64_t>{0, 5, 5, 10}, std::vector<int64_t>{0, 6, 4, 10},
        std::vector<int64_t>{0, 5, 9}, std::vector<int64_t>{1, 5, 10}, std::vector<int64_t>{0}}) {
    in = p.inputs();
    in.cu_seqlens = cu;
    EXPECT_THROW(ops::attention_flash_forward(in, o.data(), lse.data()), Error);
    in64 = p.inputs64();
    in64.cu_seqlens = cu;
    EXPECT_THROW(ops::attention_reference(in64, o64.data()), Error);
  }

  // Non-finite inputs, in each of q, k, v, for every entry point.
  ops::attention_flash_forward(p.inputs(), o.data(), lse.data());
  const std::vector<float> d_o(o.size(), 1.0f);
  std::vector<float> dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
  const AttentionGrads<float> grads{dq.data(), dk.data(), dv.data()};
  for (int which = 0; which < 3; ++which) {
    Problem bad = p;
    std::vector<float>& x = which == 0 ? bad.q : which == 1 ? bad.k : bad.v;
    x[x.size() / 2] = which == 1 ? std::numeric_limits<float>::infinity() : kNaN;
    bad.q64 = to_double(bad.q), bad.k64 = to_double(bad.k), bad.v64 = to_double(bad.v);
    EXPECT_THROW(ops::attention_reference(bad.inputs64(), o64.data()), Error);
    EXPECT_THROW(ops::attention_flash_forward(bad.inputs(), o.data(), lse.data()), Error);
    EXPECT_THROW(
        ops::attention_flash_backward(bad.inputs(), o.data(), lse.data(), d_o.data(), grads),
        Error);
    KvCache cache(1, 2, 8, 8);
    EXPECT_THROW(ops::attention_prefill(bad.inputs(), cache, o.data(), nullptr), Error);
    EXPECT_EQ(cache.length(0), 0);  // nothing appended by a failed call
    AttentionShape step = p.shape;
    step.T = 1;
    const int64_t t = 5;  // the token holding the bad value
    EXPECT_THROW(
        ops::attention_decode_step(step, cache, bad.q.data() + t * 4 * 8, bad.k.data() + t * 2 * 8,
                                   bad.v.data() + t * 2 * 8, o.data()),
        Error);
    EXPECT_EQ(cache.length(0), 0);
  }
  std::vector<float> bad_d_o = d_o;
  bad_d_o[3] = kNaN;
  EXPECT_THROW(
      ops::attention_flash_backward(p.inputs(), o.data(), lse.data(), bad_d_o.data(), grads),
      Error);

  // Decode against a cache of other sizes, bad or repeated slots.
  AttentionShape step = p.shape;
  step.B = 2;
  KvCache wrong(2, 2, 16, 8), cache(2, 2, 8, 8);
  EXPECT_THROW(
      ops::attention_decode_step(step, wrong, p.q.data(), p.k.data(), p.v.data(), o.data()), Error);
  const std::vector<int64_t> repeated = {1, 1}, out_of_range = {0, 2}, too_few = {0};
  for (const auto& slots : {repeated, out_of_range, too_few}) {
    EXPECT_THROW(ops::attention_decode_step(step, cache, p.q.data(), p.k.data(), p.v.data(),
                                            o.data(), slots),
                 Error);
  }
  EXPECT_EQ(cache.length(0) + cache.length(1), 0);
  // A full bounded slot: neither slot takes the token.
  KvCache bounded(2, 2, 8, 8, 1);
  bounded.append(1, p.k.data(), p.v.data(), 1);
  EXPECT_THROW(
      ops::attention_decode_step(step, bounded, p.q.data(), p.k.data(), p.v.data(), o.data()),
      Error);
  EXPECT_EQ(bounded.length(0), 0);
}

}  // namespace
}  // namespace kda
