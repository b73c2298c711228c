// The safetensors reader must never crash on a bad file: every truncation, random mutation and
// hand-written bad header either opens (and then every view lies inside the file and shows its
// bytes) or throws kda::Error naming the path. The writer must never show a partial file and
// must fail with kda::Error where it cannot write.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "scratch_dir.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::string_literals;
using namespace std::string_view_literals;

using testing::ScratchDir;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A plain (non-atomic) write: the fuzz loops rewrite one file thousands of times. It replaces
// the file rather than truncating it, since ext4 flushes a truncated-and-rewritten file to disk
// on close (auto_da_alloc), which costs milliseconds per write.
void write_bytes(const std::string& path, std::string_view bytes) {
  ::unlink(path.c_str());
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  out.close();
  if (!out) throw std::runtime_error("test setup: cannot write " + path);
}

uint64_t header_length(std::string_view bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[i]);
  return n;
}

void set_header_length(std::string& bytes, uint64_t n) {
  for (int i = 0; i < 8; ++i) bytes[i] = char((n >> (8 * i)) & 0xff);
}

// A file made of a length prefix that says `header_len`, then `rest`.
std::string with_prefix(uint64_t header_len, std::string_view rest) {
  std::string bytes(8, '\0');
  set_header_length(bytes, header_len);
  bytes += rest;
  return bytes;
}

// A file whose prefix matches `header`, followed by `data_bytes` bytes of data.
std::string file_with_header(std::string_view header, size_t data_bytes = 64) {
  std::string data(data_bytes, '\0');
  for (size_t i = 0; i < data_bytes; ++i) data[i] = char(0x41 + i % 26);
  return with_prefix(header.size(), std::string(header) + data);
}

// Printable start of a file's header, for failure messages.
std::string printable_header(std::string_view bytes, size_t limit = 400) {
  std::string out;
  for (size_t i = 8; i < bytes.size() && out.size() < limit; ++i) {
    const auto c = uint8_t(bytes[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return out;
}

// --- valid files to start from -------------------------------------------------------------

Tensor random_f32(Shape shape, std::mt19937_64& rng) {
  Tensor t(DType::f32, std::move(shape));
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  for (float& x : t.span_f32()) x = uniform(rng);
  return t;
}

Tensor random_i64(Shape shape, std::mt19937_64& rng) {
  Tensor t(DType::i64, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int64_t>()[i] = int64_t(rng() % 50000) - 100;
  return t;
}

// Several tensors (F32, BF16, I64, a scalar, an empty one) and metadata; `scale` grows them.
struct SampleFile {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;

  void write(const std::string& path) const {
    std::vector<NamedTensor> named;
    for (const auto& [name, tensor] : tensors) named.push_back({name, &tensor});
    write_safetensors(path, named, metadata);
  }
};

SampleFile make_sample(int scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  SampleFile sample;
  sample.tensors.emplace_back("weight", random_f32({3 * scale, 4}, rng));
  sample.tensors.emplace_back("embedding", random_f32({5, 2 * scale}, rng).to(DType::bf16));
  sample.tensors.emplace_back("token_ids", random_i64({6 * scale}, rng));
  sample.tensors.emplace_back("scale", random_f32({}, rng));
  sample.tensors.emplace_back("empty", Tensor(DType::f32, {0, 3}));
  sample.metadata = {{"format", "pt"}, {"config", R"({"B": 2, "T": 64})"}};
  return sample;
}

std::string sample_bytes(const ScratchDir& dir, const SampleFile& sample) {
  const std::string path = dir.file("sample.safetensors");
  sample.write(path);
  std::string bytes = read_bytes(path);
  fs::remove(path);
  return bytes;
}

// --- the property every candidate file must satisfy --------------------------------------

enum class Outcome { opened, rejected };

// A file that opened: every view must lie inside the data section, show the file's bytes, have
// a shape that fits int64, not overlap another view, and load (as itself and converted to f32).
std::string check_views(const SafetensorsFile& file, const std::string& bytes) {
  const std::span<const std::byte> whole = file.file_bytes();
  if (whole.size() != bytes.size()) return "the mapping's size differs from the file's";
  if (bytes.size() < 8) return "opened a file shorter than its length prefix";
  const uint64_t header_len = header_length(bytes);
  if (header_len > bytes.size() - 8) return "opened a header that runs past the end of the file";
  const std::byte* data_begin = whole.data() + 8 + header_len;
  const std::byte* file_end = whole.data() + whole.size();
  const std::vector<std::string> names = file.names();
  if (!std::is_sorted(names.begin(), names.end())) return "names() is not sorted";
  std::vector<std::pair<const std::byte*, const std::byte*>> ranges;
  for (const std::string& name : names) {
    const std::string where = "tensor '" + name + "': ";
    if (!file.contains(name)) return where + "listed but not contained";
    const TensorView view = file.view(name);
    // Strides multiply the nonzero dimensions, even when another dimension is 0.
    uint64_t numel = 1, nonzero_product = 1;
    for (int64_t d : view.shape) {
      if (d < 0) return where + "negative dimension";
      if (d == 0) {
        numel = 0;
        continue;
      }
      if (nonzero_product > uint64_t(INT64_MAX) / uint64_t(d)) return where + "shape overflows";
      nonzero_product *= uint64_t(d);
      numel *= uint64_t(d);
    }
    if (view.strides != contiguous_strides(view.shape)) return where + "not contiguous";
    const size_t nbytes = view.nbytes();
    const auto* begin = static_cast<const std::byte*>(view.data);
    if (begin < data_begin || begin > file_end || size_t(file_end - begin) < nbytes) {
      return where + "lies outside the data section";
    }
    if (std::memcmp(begin, bytes.data() + (begin - whole.data()), nbytes) != 0) {
      return where + "does not show the file's bytes";
    }
    if (nbytes) ranges.emplace_back(begin, begin + nbytes);
    const Tensor copy = file.load(name, view.dtype);
    if (copy.nbytes() != nbytes || (nbytes && std::memcmp(copy.raw(), begin, nbytes) != 0)) {
      return where + "load() differs from the view";
    }
    if (file.load(name).numel() != int64_t(numel)) return where + "load() as f32 lost elements";
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return "two views overlap";
  }
  return "";
}

// Opens `path` (whose contents are `bytes`): either it opens and check_views holds, or it throws
// kda::Error naming the path. Returns what went wrong, or "" when all is well.
std::string check_open(const std::string& path, const std::string& bytes, Outcome* outcome) {
  try {
    const SafetensorsFile file = SafetensorsFile::open(path);
    *outcome = Outcome::opened;
    return check_views(file, bytes);
  } catch (const Error& e) {
    *outcome = Outcome::rejected;
    const std::string message = e.what();
    if (message.find(path) == std::string::npos) return "kda::Error without the path: " + message;
    return "";
  } catch (const std::exception& e) {
    return "escaped "s + typeid(e).name() + ": " + e.what();
  } catch (...) {
    return "escaped an exception that is not a std::exception";
  }
}

// Expects `bytes` to be refused with a kda::Error naming the path and containing `reason`.
void expect_rejected(const ScratchDir& dir, const std::string& label, const std::string& bytes,
                     std::string_view reason) {
  SCOPED_TRACE(label + ", header: " + printable_header(bytes, 200));
  const std::string path = dir.file("case.safetensors");
  write_bytes(path, bytes);
  try {
    const SafetensorsFile file = SafetensorsFile::open(path);
    ADD_FAILURE() << "opened; it must be refused (" << reason << ")";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(reason), std::string::npos) << "wanted '" << reason << "': " << message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "escaped " << typeid(e).name() << ": " << e.what();
  }
}

// Expects `bytes` to open and pass check_views.
void expect_opens(const ScratchDir& dir, const std::string& label, const std::string& bytes,
                  size_t expected_tensors) {
  SCOPED_TRACE(label);
  const std::string path = dir.file("case.safetensors");
  write_bytes(path, bytes);
  try {
    const SafetensorsFile file = SafetensorsFile::open(path);
    EXPECT_EQ(check_views(file, bytes), "");
    EXPECT_EQ(file.names().size(), expected_tensors);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "refused a valid file: " << e.what();
  }
}

// --- truncation ---------------------------------------------------------------------------

TEST(SafetensorsRobustness, SmallFileTruncatedAtEveryLength) {
  ScratchDir dir;
  const std::string bytes = sample_bytes(dir, make_sample(1, 11));
  const std::string path = dir.file("cut.safetensors");
  for (size_t length = 0; length <= bytes.size(); ++length) {
    const std::string cut = bytes.substr(0, length);
    write_bytes(path, cut);
    Outcome outcome{};
    ASSERT_EQ(check_open(path, cut, &outcome), "") << "cut at " << length << " bytes";
    // Every shorter cut loses at least the end of the last tensor's bytes.
    EXPECT_EQ(outcome == Outcome::opened, length == bytes.size()) << "cut at " << length;
  }
}

TEST(SafetensorsRobustness, LargerFileTruncatedAtRandomLengths) {
  ScratchDir dir;
  const std::string bytes = sample_bytes(dir, make_sample(300, 12));
  ASSERT_GT(bytes.size(), 20000u);
  const size_t data_start = 8 + header_length(bytes);
  std::vector<size_t> lengths = {
      0, 1, 7, 8, 9, data_start - 1, data_start, data_start + 1, bytes.size() - 1, bytes.size()};
  std::mt19937_64 rng(13);
  for (int i = 0; i < 300; ++i) lengths.push_back(rng() % bytes.size());
  const std::string path = dir.file("cut.safetensors");
  for (size_t length : lengths) {
    const std::string cut = bytes.substr(0, length);
    write_bytes(path, cut);
    Outcome outcome{};
    ASSERT_EQ(check_open(path, cut, &outcome), "") << "cut at " << length << " bytes";
    EXPECT_EQ(outcome == Outcome::opened, length == bytes.size()) << "cut at " << length;
  }
}

// --- random mutations ---------------------------------------------------------------------

size_t pick(std::mt19937_64& rng, size_t n) {
  return std::uniform_int_distribution<size_t>(0, n - 1)(rng);
}

// The header bytes that a mutation may touch: the prefix's claim, clamped to the file.
size_t header_region(const std::string& bytes) {
  return size_t(std::min<uint64_t>(header_length(bytes), bytes.size() - 8));
}

// One byte of the header: a flipped bit, a random byte, or a byte that means something to JSON.
void mutate_header_byte(std::string& bytes, std::mt19937_64& rng) {
  static constexpr std::string_view kJsonBytes = "{}[]\":,-+.0123456789eE \\tfnu\0\xff"sv;
  const size_t region = header_region(bytes);
  if (region == 0) return;
  char& c = bytes[8 + pick(rng, region)];
  switch (pick(rng, 3)) {
    case 0:
      c = char(uint8_t(c) ^ (1u << pick(rng, 8)));
      break;
    case 1:
      c = char(rng());
      break;
    default:
      c = kJsonBytes[pick(rng, kJsonBytes.size())];
  }
}

// Replaces the header (prefix usually fixed to match, data kept, 8-byte alignment sometimes).
void replace_header(std::string& bytes, std::string header, std::mt19937_64& rng) {
  const size_t old_len = header_region(bytes);
  if (pick(rng, 2)) {
    while ((8 + header.size()) % 8) header.push_back(' ');
  }
  bytes.replace(8, old_len, header);
  if (pick(rng, 8) != 0) set_header_length(bytes, header.size());
}

// Edge values for a number in the header: a JSON number is where the overflow checks live.
std::string edge_number(const std::string& bytes, std::mt19937_64& rng) {
  static const std::vector<std::string> kEdges = {"0",
                                                  "1",
                                                  "2",
                                                  "3",
                                                  "7",
                                                  "8",
                                                  "16",
                                                  "-1",
                                                  "-0",
                                                  "1.0",
                                                  "0.5",
                                                  "1e2",
                                                  "1e400",
                                                  "-9223372036854775808",
                                                  "2147483648",
                                                  "4294967296",
                                                  "4611686018427387904",
                                                  "9223372036854775807",
                                                  "9223372036854775808",
                                                  "18446744073709551615",
                                                  "18446744073709551616",
                                                  "340282366920938463463374607431768211456"};
  const uint64_t data_size = bytes.size() - 8 - header_region(bytes);
  switch (pick(rng, 3)) {
    case 0:
      return kEdges[pick(rng, kEdges.size())];
    case 1:
      return std::to_string(data_size + pick(rng, 3) - 1);
    default:
      return std::to_string(pick(rng, data_size + 2));
  }
}

// Rewrites one number or one dtype of the header, so that the file stays JSON and hits the
// semantic checks (shapes, offsets, byte counts, overlaps) rather than the parser.
void mutate_header_value(std::string& bytes, std::mt19937_64& rng) {
  static const std::vector<std::string> kDtypes = {"F32", "F64", "BF16", "F16", "I64", "I32",
                                                   "I8",  "U8",  "BOOL", "F8",  "",    "f32"};
  std::string header = bytes.substr(8, header_region(bytes));
  std::vector<std::pair<size_t, size_t>> numbers, dtypes;  // (start, length)
  for (size_t i = 0; i < header.size();) {
    if (std::isdigit(uint8_t(header[i]))) {
      const size_t start = i;
      while (i < header.size() && std::isdigit(uint8_t(header[i]))) ++i;
      numbers.emplace_back(start, i - start);
    } else {
      ++i;
    }
  }
  for (size_t at = header.find("\"dtype\":\""); at != std::string::npos;
       at = header.find("\"dtype\":\"", at + 1)) {
    const size_t start = at + 9;
    const size_t end = header.find('"', start);
    if (end != std::string::npos) dtypes.emplace_back(start, end - start);
  }
  if (!dtypes.empty() && (numbers.empty() || pick(rng, 5) == 0)) {
    const auto [start, length] = dtypes[pick(rng, dtypes.size())];
    header.replace(start, length, kDtypes[pick(rng, kDtypes.size())]);
  } else if (!numbers.empty()) {
    const auto [start, length] = numbers[pick(rng, numbers.size())];
    header.replace(start, length, edge_number(bytes, rng));
  } else {
    return;
  }
  replace_header(bytes, std::move(header), rng);
}

// Deletes or repeats a short span of the header.
void mutate_header_span(std::string& bytes, std::mt19937_64& rng) {
  std::string header = bytes.substr(8, header_region(bytes));
  if (header.empty()) return;
  const size_t start = pick(rng, header.size());
  const size_t length = std::min(header.size() - start, 1 + pick(rng, 12));
  if (pick(rng, 2)) {
    header.erase(start, length);
  } else {
    header.insert(start, header.substr(start, length));
  }
  replace_header(bytes, std::move(header), rng);
}

// The 8-byte length prefix: a flipped bit, a random byte, or a whole edge value.
void mutate_length_prefix(std::string& bytes, std::mt19937_64& rng) {
  const uint64_t len = header_length(bytes);
  const uint64_t size = bytes.size();
  switch (pick(rng, 3)) {
    case 0:
      bytes[pick(rng, 8)] ^= char(1u << pick(rng, 8));
      break;
    case 1:
      bytes[pick(rng, 8)] = char(rng());
      break;
    default: {
      const uint64_t edges[] = {0,
                                1,
                                2,
                                len - 1,
                                len + 1,
                                len + 8,
                                size - 9,
                                size - 8,
                                size - 7,
                                size,
                                100ull << 20,
                                (100ull << 20) + 1,
                                1ull << 31,
                                1ull << 32,
                                (1ull << 63) - 1,
                                1ull << 63,
                                UINT64_MAX - 7,
                                UINT64_MAX,
                                rng()};
      set_header_length(bytes, edges[pick(rng, std::size(edges))]);
    }
  }
}

using Mutation = std::function<void(std::string&, std::mt19937_64&)>;

// Opens mutants of `original` until the time budget is spent and at least `min_mutants` were
// tried (so a slow, loaded machine takes longer rather than testing less). Each mutant has its
// own seed, so a failure names the iteration that reproduces it.
void fuzz(const ScratchDir& dir, const std::string& original, uint64_t seed,
          std::chrono::milliseconds budget, int min_mutants, const Mutation& mutate) {
  const std::string path = dir.file("mutant.safetensors");
  const auto deadline = Clock::now() + budget;
  int iterations = 0, opened = 0, unchanged = 0;
  for (; Clock::now() < deadline || iterations < min_mutants; ++iterations) {
    std::mt19937_64 rng(seed + 0x9E3779B97F4A7C15ull * uint64_t(iterations + 1));
    std::string mutant = original;
    mutate(mutant, rng);
    unchanged += mutant == original;
    write_bytes(path, mutant);
    Outcome outcome{};
    const std::string problem = check_open(path, mutant, &outcome);
    if (!problem.empty()) {
      ADD_FAILURE() << problem << "\n  seed " << seed << ", iteration " << iterations << ", prefix "
                    << header_length(mutant) << ", size " << mutant.size()
                    << ", header: " << printable_header(mutant);
      return;
    }
    opened += outcome == Outcome::opened;
  }
  std::printf("[ fuzz     ] %d mutants (%d unchanged), %d opened, %d refused\n", iterations,
              unchanged, opened, iterations - opened);
}

TEST(SafetensorsRobustness, RandomHeaderMutationsNeverCrash) {
  ScratchDir dir;
  const std::string original = sample_bytes(dir, make_sample(2, 21));
  fuzz(dir, original, 21, std::chrono::milliseconds(2000), 2000,
       [](std::string& bytes, std::mt19937_64& rng) {
         for (size_t n = 1 + pick(rng, 3); n-- > 0;) {
           switch (pick(rng, 5)) {
             case 0:
             case 1:
               mutate_header_byte(bytes, rng);
               break;
             case 2:
             case 3:
               mutate_header_value(bytes, rng);
               break;
             default:
               mutate_header_span(bytes, rng);
           }
         }
       });
}

TEST(SafetensorsRobustness, RandomLengthPrefixMutationsNeverCrash) {
  ScratchDir dir;
  const std::string original = sample_bytes(dir, make_sample(2, 22));
  fuzz(dir, original, 22, std::chrono::milliseconds(700), 1000,
       [](std::string& bytes, std::mt19937_64& rng) {
         mutate_length_prefix(bytes, rng);
         if (pick(rng, 4) == 0) mutate_header_byte(bytes, rng);
       });
}

// --- hand-written bad files ---------------------------------------------------------------

TEST(SafetensorsRobustness, RefusesBadLengthPrefixes) {
  ScratchDir dir;
  expect_rejected(dir, "empty file", "", "fewer than the 8");
  for (size_t n = 1; n < 8; ++n) {
    expect_rejected(dir, std::to_string(n) + "-byte file", std::string(n, '\x02'),
                    "fewer than the 8");
  }
  expect_rejected(dir, "only the prefix, length 0", with_prefix(0, ""), "not JSON");
  expect_rejected(dir, "only the prefix, length 2", with_prefix(2, ""), "past the end");
  expect_rejected(dir, "prefix 0 before a header", with_prefix(0, "{}"), "not JSON");
  expect_rejected(dir, "header longer than the file",
                  with_prefix(1000, "{}" + std::string(64, ' ')), "past the end");
  expect_rejected(dir, "header cut short by the prefix", with_prefix(5, R"({"a":{"dtype":"F32"}})"),
                  "not JSON");
  expect_rejected(dir, "header of exactly 100 MiB in a small file", with_prefix(100ull << 20, "{}"),
                  "past the end");
  expect_rejected(dir, "header over 100 MiB", with_prefix((100ull << 20) + 1, "{}"), "100 MiB");
  expect_rejected(dir, "header of 2^63 bytes", with_prefix(1ull << 63, "{}"), "100 MiB");
  expect_rejected(dir, "header of 2^64 - 1 bytes", with_prefix(UINT64_MAX, "{}"), "100 MiB");
}

TEST(SafetensorsRobustness, RefusesHeadersThatAreNotAnObjectOfTensors) {
  ScratchDir dir;
  const std::vector<std::pair<std::string, std::string>> not_json = {
      {"not JSON", "hello"},
      {"empty header", ""},
      {"unfinished JSON", R"({"t":{"dtype":"F32")"},
      {"trailing garbage", "{} x"},
      {"NUL byte", "{\0}"s},
      {"invalid UTF-8 in a key", "{\"\xff\xfe\":1}"},
      {"number out of range", R"({"t":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})"},
  };
  for (const auto& [label, header] : not_json) {
    expect_rejected(dir, label, file_with_header(header), "not JSON");
  }
  for (const std::string header : {"[1,2,3]", "[]", "\"x\"", "null", "7", "true"}) {
    expect_rejected(dir, "JSON " + header, file_with_header(header), "not a JSON object");
  }
  expect_rejected(dir, "tensor entry not an object", file_with_header(R"({"t":5})"),
                  "is not an object");
  expect_rejected(dir, "tensor entry an array", file_with_header(R"({"t":[0,4]})"),
                  "is not an object");
  // A valid header is three levels deep; a deep one must not cost memory or stack.
  const std::string deep =
      R"({"t":)" + std::string(1'000'000, '[') + std::string(1'000'000, ']') + "}";
  expect_rejected(dir, "a million nested arrays", file_with_header(deep), "deep");
  expect_rejected(dir, "the same tensor twice",
                  file_with_header(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                   R"("t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})"),
                  "repeats");
}

TEST(SafetensorsRobustness, RefusesBadDtypesAndShapes) {
  ScratchDir dir;
  const auto tensor = [](const std::string& fields) { return "{\"t\":{" + fields + "}}"; };
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"missing dtype", R"("shape":[2],"data_offsets":[0,8])", "no dtype"},
      {"dtype not a string", R"("dtype":7,"shape":[2],"data_offsets":[0,8])", "no dtype"},
      {"unknown dtype", R"("dtype":"F33","shape":[2],"data_offsets":[0,8])", "unknown dtype"},
      {"lower-case dtype", R"("dtype":"f32","shape":[2],"data_offsets":[0,8])", "unknown dtype"},
      {"missing shape", R"("dtype":"F32","data_offsets":[0,8])", "no shape"},
      {"shape a string", R"("dtype":"F32","shape":"2","data_offsets":[0,8])", "no shape"},
      {"shape an object", R"("dtype":"F32","shape":{"n":2},"data_offsets":[0,8])", "no shape"},
      {"negative shape", R"("dtype":"F32","shape":[-2],"data_offsets":[0,8])", "shape entry"},
      {"negative zero", R"("dtype":"F32","shape":[-0,2],"data_offsets":[0,0])", "shape entry"},
      {"float shape", R"("dtype":"F32","shape":[2.0],"data_offsets":[0,8])", "shape entry"},
      {"fractional shape", R"("dtype":"F32","shape":[0.5],"data_offsets":[0,8])", "shape entry"},
      {"string in shape", R"("dtype":"F32","shape":["2"],"data_offsets":[0,8])", "shape entry"},
      {"null in shape", R"("dtype":"F32","shape":[null],"data_offsets":[0,8])", "shape entry"},
      {"nested shape", R"("dtype":"F32","shape":[[2]],"data_offsets":[0,8])", "shape entry"},
      {"shape 2^63", R"("dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8])",
       "too large"},
      {"shape 2^64 - 1", R"("dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8])",
       "too large"},
      {"shape 2^64 (parses as a float)",
       R"("dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,8])", "shape entry"},
      {"shape product overflows uint64",
       R"("dtype":"U8","shape":[4294967296,4294967296,2],"data_offsets":[0,8])", "too large"},
      {"shape product overflows int64",
       R"("dtype":"U8","shape":[4294967296,4294967295],"data_offsets":[0,8])", "too large"},
      // numel = 0, but the strides of the other dimensions would overflow int64
      {"zero hides an overflowing product",
       R"("dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0])",
       "too large"},
      {"zero after an overflowing product",
       R"("dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0])",
       "too large"},
      // 2^61 x 8 bytes wraps to 0 in uint64, which would match data_offsets [0, 0]
      {"bytes wrap to zero", R"("dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0])",
       "bytes"},
      {"bytes wrap to eight", R"("dtype":"I64","shape":[2305843009213693953],"data_offsets":[0,8])",
       "bytes"},
  };
  for (const auto& [label, fields, reason] : cases) {
    expect_rejected(dir, label, file_with_header(tensor(fields)), reason);
  }
}

TEST(SafetensorsRobustness, RefusesBadDataOffsets) {
  ScratchDir dir;
  const auto tensor = [](const std::string& offsets) {
    return R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":)" + offsets + "}}";
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"offsets missing", "", "data_offsets"},
      {"offsets not an array", "16", "data_offsets"},
      {"one offset", "[16]", "data_offsets"},
      {"three offsets", "[0,16,32]", "data_offsets"},
      {"negative offset", "[-16,0]", "data_offsets"},
      {"float offset", "[0,16.0]", "data_offsets"},
      {"string offset", R"(["0",16])", "data_offsets"},
      {"begin after end", "[16,0]", "begin after end"},
      {"end past the data", "[56,72]", "ends at byte"},
      {"end 2^64 - 1", "[18446744073709551599,18446744073709551615]", "ends at byte"},
      {"too few bytes", "[0,15]", "bytes"},
      {"too many bytes", "[0,17]", "bytes"},
      {"no bytes", "[0,0]", "bytes"},
  };
  for (const auto& [label, offsets, reason] : cases) {
    const std::string header =
        offsets.empty() ? std::string(R"({"t":{"dtype":"F32","shape":[2,2]}})") : tensor(offsets);
    expect_rejected(dir, label, file_with_header(header), reason);
  }
  expect_rejected(dir, "BF16 counted as F32",
                  file_with_header(R"({"t":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,16]}})"),
                  "bytes");
  expect_rejected(dir, "I64 counted as F32",
                  file_with_header(R"({"t":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})"),
                  "bytes");
  expect_rejected(dir, "empty tensor past the data",
                  file_with_header(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[65,65]}})"),
                  "ends at byte");
}

TEST(SafetensorsRobustness, RefusesOverlappingTensors) {
  ScratchDir dir;
  const auto two = [](const std::string& a, const std::string& b) {
    return R"({"a":{"dtype":"F32","shape":[4],"data_offsets":)" + a +
           R"(},"b":{"dtype":"F32","shape":[4],"data_offsets":)" + b + "}}";
  };
  expect_rejected(dir, "partial overlap", file_with_header(two("[0,16]", "[8,24]")), "overlap");
  expect_rejected(dir, "same range", file_with_header(two("[16,32]", "[16,32]")), "overlap");
  expect_rejected(dir, "one byte shared", file_with_header(two("[0,16]", "[15,31]")), "overlap");
  expect_rejected(dir, "one inside another",
                  file_with_header(R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},)"
                                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})"),
                  "overlap");
  // Touching ranges and empty tensors anywhere are fine.
  expect_opens(dir, "adjacent ranges", file_with_header(two("[16,32]", "[0,16]")), 2);
  expect_opens(dir, "empty tensor inside another",
               file_with_header(R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},)"
                                R"("b":{"dtype":"F32","shape":[0,5],"data_offsets":[8,8]}})"),
               2);
}

TEST(SafetensorsRobustness, RefusesBadMetadata) {
  ScratchDir dir;
  for (const std::string value : {"\"pt\"", "[]", "5", "null", "true"}) {
    expect_rejected(dir, "__metadata__ = " + value,
                    file_with_header(R"({"__metadata__":)" + value + "}"), "is not an object");
  }
  for (const std::string value : {"1", "null", "{}", "[\"a\"]", "true", "1.5"}) {
    expect_rejected(dir, "metadata value " + value,
                    file_with_header(R"({"__metadata__":{"format":"pt","k":)" + value + "}}"),
                    "not a string");
  }
  expect_rejected(dir, "metadata key twice",
                  file_with_header(R"({"__metadata__":{"k":"a","k":"b"}})"), "repeats");
  expect_rejected(dir, "__metadata__ twice",
                  file_with_header(R"({"__metadata__":{"k":"a"},"__metadata__":{"k":"b"}})"),
                  "repeats");
}

TEST(SafetensorsRobustness, OpensValidEdgeCases) {
  ScratchDir dir;
  expect_opens(dir, "empty object, no data", with_prefix(2, "{}"), 0);
  expect_opens(dir, "empty object padded with spaces", with_prefix(8, "{}      "), 0);
  expect_opens(dir, "only metadata", file_with_header(R"({"__metadata__":{"a":"b"}})", 0), 0);
  expect_opens(dir, "scalar",
               file_with_header(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[60,64]}})"), 1);
  expect_opens(dir, "empty tensor at the very end",
               file_with_header(R"({"e":{"dtype":"I64","shape":[3,0],"data_offsets":[64,64]}})"),
               1);
  expect_opens(dir, "zero dimension next to a large one",
               file_with_header(
                   R"({"e":{"dtype":"U8","shape":[0,9223372036854775807],"data_offsets":[0,0]}})"),
               1);
  expect_opens(dir, "unaligned BOOL and I8",
               file_with_header(R"({"b":{"dtype":"BOOL","shape":[3],"data_offsets":[1,4]},)"
                                R"("i":{"dtype":"I8","shape":[1],"data_offsets":[63,64]}})"),
               2);
}

TEST(SafetensorsRobustness, RefusesPathsThatAreNotFiles) {
  ScratchDir dir;
  const auto expect_error_naming = [](const std::string& path, std::string_view reason) {
    SCOPED_TRACE(path);
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << "opened";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path), std::string::npos) << message;
      EXPECT_NE(message.find(reason), std::string::npos) << message;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "escaped " << typeid(e).name() << ": " << e.what();
    }
  };
  fs::create_directory(dir.file("folder.safetensors"));
  expect_error_naming(dir.file("folder.safetensors"), "not a regular file");
  expect_error_naming(dir.file("missing.safetensors"), "cannot open");
  expect_error_naming(dir.file("missing/model.safetensors"), "cannot open");
  expect_error_naming("", "cannot open");
  expect_error_naming("/dev/null", "not a regular file");
  write_bytes(dir.file("plain"), with_prefix(2, "{}"));
  expect_error_naming(dir.file("plain") + "/model.safetensors", "cannot open");

  // A FIFO with no writer must be refused at once, not block forever in open().
  const std::string fifo = dir.file("fifo.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto opening = std::async(std::launch::async, [&] { expect_error_naming(fifo, "regular"); });
  if (opening.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ADD_FAILURE() << "open() of a FIFO blocks";
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // unblocks the reader
    opening.wait();
    if (writer >= 0) ::close(writer);
  }
}

// --- the writer ---------------------------------------------------------------------------

void expect_same_tensors(const SafetensorsFile& file, const SampleFile& sample) {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : sample.tensors) {
    names.push_back(name);
    const TensorView view = file.view(name);
    EXPECT_EQ(view.dtype, tensor.dtype()) << name;
    EXPECT_EQ(view.shape, tensor.shape()) << name;
    ASSERT_EQ(view.nbytes(), tensor.nbytes()) << name;
    if (tensor.nbytes()) {
      EXPECT_EQ(std::memcmp(view.data, tensor.raw(), tensor.nbytes()), 0) << name;
    }
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(file.names(), names);
  EXPECT_EQ(file.metadata(), sample.metadata);
}

TEST(SafetensorsRobustness, WriterLeavesNoTempFilesAndOverwritesWholeFiles) {
  ScratchDir dir;
  const std::string path = dir.file("model.safetensors");
  const SampleFile first = make_sample(3, 31), second = make_sample(40, 32);
  first.write(path);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  expect_same_tensors(SafetensorsFile::open(path), first);

  const SafetensorsFile still_open = SafetensorsFile::open(path);
  second.write(path);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  expect_same_tensors(SafetensorsFile::open(path), second);
  // A reader that opened the old file keeps seeing it whole: the new file is a new inode.
  expect_same_tensors(still_open, first);

  first.write(path);  // and back to a smaller file
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  expect_same_tensors(SafetensorsFile::open(path), first);
}

TEST(SafetensorsRobustness, ReadersNeverSeeAPartialFileWhileItIsRewritten) {
  ScratchDir dir;
  const std::string path = dir.file("model.safetensors");
  const SampleFile small = make_sample(1, 41), large = make_sample(2000, 42);
  const std::string small_bytes = sample_bytes(dir, small), large_bytes = sample_bytes(dir, large);
  small.write(path);

  std::atomic<bool> stop{false};
  std::atomic<int> rewrites{0};
  std::thread writer([&] {
    while (!stop) {
      (rewrites % 2 ? small : large).write(path);
      ++rewrites;
    }
  });
  int reads = 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(500);
  while (Clock::now() < deadline || rewrites < 4) {
    try {
      const SafetensorsFile file = SafetensorsFile::open(path);
      const std::span<const std::byte> seen = file.file_bytes();
      const std::string_view text(reinterpret_cast<const char*>(seen.data()), seen.size());
      ++reads;
      if (text != small_bytes && text != large_bytes) {
        ADD_FAILURE() << "read a file of " << seen.size() << " bytes that is neither version";
        break;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << "read during a rewrite failed: " << e.what();
      break;
    }
  }
  stop = true;
  writer.join();
  std::printf("[ atomic   ] %d reads during %d rewrites\n", reads, rewrites.load());
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

// Expects write_safetensors(path, ...) to throw kda::Error naming `path`.
void expect_write_fails(const std::string& path, const std::vector<NamedTensor>& tensors,
                        const std::map<std::string, std::string>& metadata = {}) {
  SCOPED_TRACE(path);
  try {
    write_safetensors(path, tensors, metadata);
    ADD_FAILURE() << "wrote";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "escaped " << typeid(e).name() << ": " << e.what();
  }
}

TEST(SafetensorsRobustness, WriterThrowsWhereItCannotWrite) {
  ScratchDir dir;
  std::mt19937_64 rng(51);
  const Tensor t = random_f32({3, 2}, rng);
  const std::vector<NamedTensor> tensors = {{"t", &t}};
  expect_write_fails(dir.file("missing/model.safetensors"), tensors);
  write_bytes(dir.file("plain"), "x");
  expect_write_fails(dir.file("plain") + "/model.safetensors", tensors);
  fs::create_directory(dir.file("folder.safetensors"));
  fs::create_directory(dir.file("folder.safetensors/inside"));
  expect_write_fails(dir.file("folder.safetensors"), tensors);
  expect_write_fails("", tensors);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"folder.safetensors", "plain"}));
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directory(dir.file("read_only"));
    fs::permissions(dir.file("read_only"), fs::perms::owner_read | fs::perms::owner_exec);
    expect_write_fails(dir.file("read_only/model.safetensors"), tensors);
    fs::permissions(dir.file("read_only"), fs::perms::owner_all);
    EXPECT_TRUE(fs::is_empty(dir.file("read_only")));
  }
}

TEST(SafetensorsRobustness, WriterRefusesBadTensorsWithoutWritingAnything) {
  ScratchDir dir;
  std::mt19937_64 rng(52);
  const Tensor t = random_f32({3, 2}, rng);
  const Tensor no_storage;  // default-constructed: shape [], no bytes behind it
  const std::string path = dir.file("model.safetensors");
  expect_write_fails(path, {{"__metadata__", &t}});
  expect_write_fails(path, {{"t", &t}, {"t", &t}});
  expect_write_fails(path, {{"t", nullptr}});
  expect_write_fails(path, {{"t", &no_storage}});
  expect_write_fails(path, {{"bad \xff name", &t}});
  expect_write_fails(path, {{"t", &t}}, {{"k", "bad \xc3 value"}});
  expect_write_fails(path, {{"t", &t}}, {{"bad \xc3 key", "v"}});
  EXPECT_TRUE(dir.entries().empty());
}

}  // namespace
}  // namespace kda
