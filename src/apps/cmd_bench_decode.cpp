// kda bench decode: how close Kimi Linear's CPU decode comes to this machine's memory bandwidth.
// Measures the streaming read and copy rates (the ceiling), writes a synthetic-weight Kimi
// Linear folder, loads it through load_causal_lm, prefills a prompt, decodes token by token
// through Session::feed_last, and compares the decode rate with the bandwidth floor: the bytes
// one decoded token must read (the active weights as held in memory, the KDA states read and
// written, the MLA latent cache read) over the measured read rate. With --device cuda the same
// decode rows on the GPU model (tokens/s and the bytes' rate; the host's floor does not apply).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "apps/model_device.h"
#include "core/blas.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "core/timer.h"
#include "model/causal_lm.h"
#include "model/kimi_linear_config.h"

namespace kda::apps {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

void print_usage() {
  std::puts(
      "usage: kda bench decode [--layers 12] [--hidden 1024] [--vocab 32000] [--kda-heads 8]\n"
      "                        [--head-dim 128] [--mla-heads 8] [--kv-lora 512] [--experts 32]\n"
      "                        [--top-k 4] [--moe-intermediate 256] [--prompt 128] [--decode 64]\n"
      "                        [--prefill 512] [--batch 4,16] [--reps 3] [--bandwidth-mib 1024]\n"
      "                        [--bf16] [--tiny] [--dir DIR] [--out DIR]\n"
      "                        [--device cpu|cuda] [--dtype bf16|fp32]\n"
      "\n"
      "Measures the memory bandwidth (streaming reads on 1 and all threads, a copy), then a\n"
      "synthetic-weight Kimi Linear (layers in a 3:1 KDA:MLA pattern, a dense first layer, MoE\n"
      "with a shared expert elsewhere): decode tokens/s after a prompt, against the bandwidth\n"
      "floor (bytes read per decoded token / read bandwidth), the same for decode steps of\n"
      "several sequences at once (CausalLM::decode_batch, one row per --batch size: the\n"
      "weights read once per step for all of them), and prefill tokens/s.\n"
      "The weights go to DIR (kept, and reused when its config.json matches; default: a\n"
      "temporary folder in /dev/shm, removed once loaded); --bf16 stores them as bf16 (the\n"
      "engine still holds fp32). --tiny: a seconds-long smoke configuration.\n"
      "--device cuda: the same decode rows with the model on the GPU (CUDA builds; --dtype for\n"
      "its weights): tokens/s and the rate of the fp32 bytes, no host-memory floor.\n"
      "Writes decode.md and decode.csv to --out (default out/bench).");
}

struct Options {
  int64_t layers = 12, hidden = 1024, vocab = 32000, kda_heads = 8, head_dim = 128;
  int64_t mla_heads = 8, kv_lora = 512, nope = 128, rope = 64, v_dim = 128;
  int64_t experts = 32, top_k = 4, moe_intermediate = 256, shared = 1, dense_intermediate = 2816;
  int64_t prompt = 128, decode = 64, prefill = 512, bandwidth_mib = 1024;
  std::vector<int64_t> batches = {4, 16};
  int reps = 3;
  bool bf16 = false;
  ModelDevice device;  // --device cuda [--dtype bf16|fp32]: the model on the GPU
  std::string dir, out_dir = "out/bench";
};

Options tiny_options() {
  Options o;
  o.layers = 4;
  o.hidden = 64;
  o.vocab = 512;
  o.kda_heads = 2;
  o.head_dim = 32;
  o.mla_heads = 2;
  o.kv_lora = 32;
  o.nope = 16;
  o.rope = 8;
  o.v_dim = 16;
  o.experts = 8;
  o.top_k = 2;
  o.moe_intermediate = 32;
  o.dense_intermediate = 128;
  o.prompt = 16;
  o.decode = 8;
  o.prefill = 32;
  o.bandwidth_mib = 16;
  o.batches = {3};
  o.reps = 1;
  return o;
}

// --- memory bandwidth ---

// Streaming rates over a buffer larger than the last-level cache (first touched by the threads
// that read it later).
class BandwidthProbe {
 public:
  explicit BandwidthProbe(int64_t mib)
      : n_(mib * (int64_t(1) << 20) / int64_t(sizeof(float))), src_(new float[size_t(n_)]) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n_; ++i) src_[i] = float(i & 1023) * 1e-3f;
  }
  int64_t bytes() const {
    return n_ * int64_t(sizeof(float));
  }

  // Best-of-reps GB/s reading the first `bytes` of the buffer over and over (after a warm-up
  // pass) on `threads` threads. Chunks are taken dynamically, so a thread the shared machine
  // deschedules does not hold the others up.
  double read_gbs(int reps, int threads, int64_t bytes) const {
    const int64_t n = std::min(n_, bytes / int64_t(sizeof(float)));
    constexpr int64_t kLanes = 64, kChunk = int64_t(1) << 18;  // 1 MiB chunks
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    const float* in = src_.get();
    volatile float sink = 0;
    const double seconds = best_seconds(reps, [&] {
      float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
      {
        // Many independent partial sums: one running sum would be bound by the add latency.
        float lanes[kLanes] = {};
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t end = std::min(n, (c + 1) * kChunk);
          int64_t i = c * kChunk;
          for (; i + kLanes <= end; i += kLanes) {
#pragma omp simd
            for (int64_t j = 0; j < kLanes; ++j) lanes[j] += in[i + j];
          }
          for (; i < end; ++i) lanes[0] += in[i];
        }
        for (int64_t j = 0; j < kLanes; ++j) total += lanes[j];
      }
      sink = total;
    });
    (void)sink;
    return double(n) * sizeof(float) / seconds / 1e9;
  }

  // Best-of-reps GB/s of a copy of the whole buffer, counting bytes read + bytes written.
  double copy_gbs(int reps) const {
    std::unique_ptr<float[]> dst(new float[size_t(n_)]);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n_; ++i) dst[i] = 0.0f;
    const double seconds = best_seconds(reps, [&] {
#pragma omp parallel
      {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t begin = n_ * t / threads, end = n_ * (t + 1) / threads;
        std::memcpy(dst.get() + begin, src_.get() + begin, size_t(end - begin) * sizeof(float));
      }
    });
    return 2.0 * double(bytes()) / seconds / 1e9;
  }

 private:
  int64_t n_;
  std::unique_ptr<float[]> src_;
};

// --- the synthetic model ---

json model_config(const Options& o) {
  json kda_layers = json::array(), mla_layers = json::array();
  for (int64_t i = 1; i <= o.layers; ++i) (i % 4 == 0 ? mla_layers : kda_layers).push_back(i);
  return json{
      {"architectures", {"KimiLinearForCausalLM"}},
      {"model_type", "kimi_linear"},
      {"vocab_size", o.vocab},
      {"hidden_size", o.hidden},
      {"num_hidden_layers", o.layers},
      {"intermediate_size", o.dense_intermediate},
      {"rms_norm_eps", 1e-5},
      {"model_max_length", std::max<int64_t>(8192, std::max(o.prompt + o.decode, o.prefill))},
      {"tie_word_embeddings", false},
      {"hidden_act", "silu"},
      {"linear_attn_config",
       {{"kda_layers", kda_layers},
        {"full_attn_layers", mla_layers},
        {"num_heads", o.kda_heads},
        {"head_dim", o.head_dim},
        {"short_conv_kernel_size", 4}}},
      {"num_attention_heads", o.mla_heads},
      {"q_lora_rank", nullptr},
      {"kv_lora_rank", o.kv_lora},
      {"qk_nope_head_dim", o.nope},
      {"qk_rope_head_dim", o.rope},
      {"v_head_dim", o.v_dim},
      {"mla_use_nope", true},
      {"first_k_dense_replace", 1},
      {"moe_layer_freq", 1},
      {"num_experts", o.experts},
      {"num_experts_per_token", o.top_k},
      {"num_shared_experts", o.shared},
      {"moe_intermediate_size", o.moe_intermediate},
      {"moe_router_activation_func", "sigmoid"},
      {"moe_renormalize", true},
      {"routed_scaling_factor", 2.5},
      {"use_grouped_topk", false},
      {"num_expert_group", 1},
      {"topk_group", 1}};
}

// Uniform values of a given standard deviation from a counter-based hash: fast enough for
// hundreds of millions of weights, and the same for any thread count.
void fill_uniform_sd(Tensor& t, uint64_t seed, float sd, float mean = 0.0f) {
  float* x = t.f32();
  const int64_t n = t.numel();
  const float half_width = sd * std::sqrt(3.0f);
  // Threads only for big tensors: waking a team per small tensor costs more than the fill.
#pragma omp parallel for schedule(static) if (n >= (int64_t(1) << 20))
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + uint64_t(i) + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = float(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x[i] = mean + half_width * (2.0f * u - 1.0f);
  }
}

// Writes config.json and model.safetensors: every tensor of the released checkpoint's naming,
// projections scaled 1/sqrt(fan_in) so activations stay O(1).
void write_model(const Options& o, const std::string& dir) {
  fs::create_directories(dir);
  std::map<std::string, Tensor> t;
  uint64_t seed = 1;
  auto add = [&](const std::string& name, Shape shape, float sd, float mean = 0.0f) {
    Tensor x(DType::f32, std::move(shape));
    fill_uniform_sd(x, seed++, sd, mean);
    if (o.bf16) x = x.to(DType::bf16);
    t[name] = std::move(x);
  };
  auto proj = [&](const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, 1.0f / std::sqrt(float(in)));
  };
  const int64_t D = o.hidden, H = o.kda_heads, K = o.head_dim, HK = H * K;
  add("model.embed_tokens.weight", {o.vocab, D}, 1.0f);
  add("model.norm.weight", {D}, 0.1f, 1.0f);
  proj("lm_head.weight", o.vocab, D);
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {D}, 0.1f, 1.0f);
    add(p + "post_attention_layernorm.weight", {D}, 0.1f, 1.0f);
    const std::string a = p + "self_attn.";
    if ((i + 1) % 4 != 0) {
      for (const char* n : {"q_proj", "k_proj", "v_proj"}) proj(a + n + ".weight", HK, D);
      for (const char* n : {"q_conv1d", "k_conv1d", "v_conv1d"})
        add(a + n + ".weight", {HK, 1, 4}, 0.5f);
      proj(a + "f_a_proj.weight", K, D);
      proj(a + "f_b_proj.weight", HK, K);
      proj(a + "g_a_proj.weight", K, D);
      proj(a + "g_b_proj.weight", HK, K);
      proj(a + "b_proj.weight", H, D);
      add(a + "A_log", {1, 1, H, 1}, 0.5f, 1.0f);
      add(a + "dt_bias", {HK}, 0.5f, -2.0f);
      add(a + "o_norm.weight", {K}, 0.1f, 1.0f);
      proj(a + "o_proj.weight", D, HK);
    } else {
      proj(a + "q_proj.weight", o.mla_heads * (o.nope + o.rope), D);
      proj(a + "kv_a_proj_with_mqa.weight", o.kv_lora + o.rope, D);
      add(a + "kv_a_layernorm.weight", {o.kv_lora}, 0.1f, 1.0f);
      proj(a + "kv_b_proj.weight", o.mla_heads * (o.nope + o.v_dim), o.kv_lora);
      proj(a + "o_proj.weight", D, o.mla_heads * o.v_dim);
    }
    const std::string m = p + "block_sparse_moe.";
    if (i == 0) {
      proj(m + "gate_proj.weight", o.dense_intermediate, D);
      proj(m + "up_proj.weight", o.dense_intermediate, D);
      proj(m + "down_proj.weight", D, o.dense_intermediate);
      continue;
    }
    const int64_t I = o.moe_intermediate, Is = I * o.shared;
    proj(m + "gate.weight", o.experts, D);
    add(m + "gate.e_score_correction_bias", {o.experts}, 0.1f);
    for (int64_t e = 0; e < o.experts; ++e) {
      const std::string x = m + "experts." + std::to_string(e) + ".";
      proj(x + "w1.weight", I, D);
      proj(x + "w3.weight", I, D);
      proj(x + "w2.weight", D, I);
    }
    proj(m + "shared_experts.gate_proj.weight", Is, D);
    proj(m + "shared_experts.up_proj.weight", Is, D);
    proj(m + "shared_experts.down_proj.weight", D, Is);
  }
  std::vector<NamedTensor> named;
  for (const auto& [name, x] : t) named.push_back({name, &x});
  write_safetensors(dir + "/model.safetensors", named);
  write_file_atomic(dir + "/config.json", model_config(o).dump(2));  // last: marks it complete
}

// --- the bandwidth floor ---

// Bytes one decode step reads (and, for the KDA states, writes) at `context` cached tokens: the
// weights a token touches as the engine holds them (fp32), every KDA layer's recurrent and conv
// state read and written, every MLA layer's latent rows read. Activations are left out (they
// stay in cache). For a step of `batch` sequences: the weights once, each sequence's states and
// cache, and the routed experts any of them picks (E (1 - (1 - k / E)^batch) expected, the
// synthetic router being close to uniform).
struct DecodeBytes {
  double weights = 0, state = 0, cache = 0;
  double total() const { return weights + state + cache; }
};

DecodeBytes decode_bytes(const model::KimiLinearConfig& c, int64_t context, int64_t batch = 1) {
  constexpr double f = sizeof(float);
  const double D = double(c.hidden_size), H = double(c.kda_heads), K = double(c.kda_head_dim);
  const double HK = H * K, W = double(c.conv_kernel);
  DecodeBytes b;
  const double N = double(batch);
  double params = N * D + D * double(c.vocab_size) + D;  // embedding rows, lm_head, final norm
  for (int64_t i = 0; i < c.num_layers; ++i) {
    params += 2 * D;  // the two norms
    if (c.mixers[i] == model::KimiMixer::kda) {
      params += (3 * HK + 2 * K + H) * D + 3 * HK * W + 2 * HK * K + H + HK + K + D * HK;
      b.state += N * 2 * f * (H * K * K + 3 * (W - 1) * HK);
    } else {
      const double Hm = double(c.mla_heads), L = double(c.kv_lora_rank);
      const double qk = double(c.mla_qk_dim()), row = double(c.mla_row_width());
      params += c.q_lora_rank > 0 ? double(c.q_lora_rank) * (D + 1 + Hm * qk) : Hm * qk * D;
      params += row * D + L + Hm * double(c.qk_nope_head_dim + c.v_head_dim) * L +
                D * Hm * double(c.v_head_dim);
      b.cache += N * f * row * double(context);
    }
    if (c.ffns[i] == model::KimiFfn::dense) {
      params += 3 * D * double(c.dense_intermediate);
    } else {
      const double I = double(c.moe_intermediate), E = double(c.num_experts);
      const double k = double(c.top_k);
      const double routed = batch == 1 ? k : E * (1 - std::pow(1 - k / E, N));
      params += E * D + E + 3 * D * I * (routed + double(c.num_shared_experts));
    }
  }
  b.weights = f * params;
  return b;
}

// Where the temporary folder goes: RAM-backed /dev/shm when there is one (writing and syncing
// a GiB to a disk other jobs are busy with takes tens of seconds), else the temp directory.
fs::path scratch_parent() {
  std::error_code error;
  if (fs::is_directory("/dev/shm", error) && ::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  return fs::temp_directory_path();
}

Options parse_options(const Args& args, bool& help) {
  Options o;
  for (const std::string& a : args)
    if (a == "--tiny") o = tiny_options();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      help = true;
      return o;
    }
    if (a == "--tiny") continue;
    if (a == "--bf16") {
      o.bf16 = true;
      continue;
    }
    const std::string value = flag_value(args, i);
    const std::map<std::string, int64_t*> ints = {
        {"--layers", &o.layers},     {"--hidden", &o.hidden},
        {"--vocab", &o.vocab},       {"--kda-heads", &o.kda_heads},
        {"--head-dim", &o.head_dim}, {"--mla-heads", &o.mla_heads},
        {"--kv-lora", &o.kv_lora},   {"--experts", &o.experts},
        {"--top-k", &o.top_k},       {"--moe-intermediate", &o.moe_intermediate},
        {"--prompt", &o.prompt},     {"--decode", &o.decode},
        {"--prefill", &o.prefill},   {"--bandwidth-mib", &o.bandwidth_mib}};
    if (const auto it = ints.find(a); it != ints.end()) {
      *it->second = parse_int(value, a);
    } else if (a == "--batch") {
      o.batches = parse_int_list(value, a);
    } else if (a == "--reps") {
      o.reps = int(parse_int(value, a));
    } else if (a == "--device") {
      parse_device(value, o.device);
    } else if (a == "--dtype") {
      parse_dtype(value, o.device);
    } else if (a == "--dir") {
      o.dir = value;
    } else if (a == "--out") {
      o.out_dir = value;
    } else {
      throw Error("bench decode: unknown option '" + a + "' (see kda bench decode --help)");
    }
  }
  require(o.layers >= 1 && o.hidden >= 1 && o.vocab >= 2 && o.kda_heads >= 1 && o.head_dim >= 1 &&
              o.mla_heads >= 1 && o.kv_lora >= 1 && o.experts >= 1 && o.moe_intermediate >= 1,
          "bench decode: model sizes must be positive");
  require(o.top_k >= 1 && o.top_k <= o.experts, "bench decode: --top-k must lie in [1, experts]");
  require(o.prompt >= 1 && o.decode >= 1 && o.prefill >= 1 && o.reps >= 1 && o.bandwidth_mib >= 1,
          "bench decode: --prompt, --decode, --prefill, --reps and --bandwidth-mib must be >= 1");
  for (const int64_t n : o.batches)
    require(n >= 1 && n <= 1024, "bench decode: --batch sizes must lie in [1, 1024]");
  return o;
}

std::string millions(int64_t n) {
  return fmt(double(n) / 1e6, 1) + "M";
}

}  // namespace

int cmd_bench_decode(const Args& args) {
  bool help = false;
  const Options o = parse_options(args, help);
  if (help) {
    print_usage();
    return 0;
  }
  std::printf("kda bench decode: %d threads, %s, OpenBLAS core %s\n", hardware_threads(),
              machine_description().c_str(), openblas_core_name().c_str());

  // The ceiling, before any model memory is touched. The floor divides by the better of the one-
  // and all-thread read rates (one core streams this machine's DRAM about as fast as two).
  const model::KimiLinearConfig config = model::KimiLinearConfig::parse(model_config(o));
  const DecodeBytes bytes = decode_bytes(config, o.prompt + o.decode / 2);
  const int bw_reps = std::max(o.reps, 3), threads = hardware_threads();
  double read_one = 0, read_all = 0, read_token = 0, copy_all = 0;
  int64_t token_bytes = 0;
  const bool gpu = o.device.cuda;  // no host-memory floor: the GPU's rows are rates only
  if (!gpu) {
    const BandwidthProbe probe(o.bandwidth_mib);
    read_one = probe.read_gbs(bw_reps, 1, probe.bytes());
    read_all = probe.read_gbs(bw_reps, threads, probe.bytes());
    token_bytes = std::min(probe.bytes(), int64_t(bytes.total()));
    read_token = probe.read_gbs(bw_reps, 1, token_bytes);
    copy_all = probe.copy_gbs(bw_reps);
  }
  const double read_best = std::max(read_one, read_all);
  if (!gpu)
    std::printf(
        "memory bandwidth over %lld MiB, best of %d: read %.1f GB/s (1 thread), %.1f GB/s (%d "
        "threads); copy %.1f GB/s (read + written)\n",
        (long long)o.bandwidth_mib, bw_reps, read_one, read_all, threads, copy_all);

  const bool temporary = o.dir.empty();
  const std::string dir =
      temporary ? (scratch_parent() / ("kda_bench_decode_" + std::to_string(::getpid()))).string()
                : o.dir;
  struct TemporaryFolder {
    std::string dir;
    bool active;
    void remove() {
      std::error_code ignored;
      if (active) fs::remove_all(dir, ignored);
      active = false;
    }
    ~TemporaryFolder() { remove(); }
  } folder{dir, temporary};
  // A kept folder holding this very config is reused (profiling runs skip the write).
  Stopwatch write_clock;
  const std::string config_text = model_config(o).dump(2);
  bool reused = false;
  if (!temporary && fs::exists(dir + "/model.safetensors") && fs::exists(dir + "/config.json")) {
    std::ifstream in(dir + "/config.json");
    const std::string stored((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
    reused = stored == config_text;
  }
  if (!reused) write_model(o, dir);
  const double write_s = write_clock.seconds();
  Stopwatch load_clock;
  const std::unique_ptr<model::CausalLM> lm = load_model_on(dir, o.device);
  const double load_s = load_clock.seconds();
  const double stored_bytes = double(fs::file_size(dir + "/model.safetensors"));
  folder.remove();  // the model holds its own fp32 copy
  const model::ArchitectureInfo& info = lm->info();
  std::printf("model: %s\n", info.summary.c_str());
  std::printf(
      "  %lld layers (%lld KDA, %lld MLA; layer 1 dense MLP, MoE after), hidden %lld, vocab %lld,"
      "\n  KDA %lld heads x %lld, MLA %lld heads (nope %lld, rope %lld, v %lld, kv_lora %lld),\n"
      "  MoE %lld experts x %lld, top-%lld + %lld shared; params %s total, %s active per token;\n"
      "  weights %s in memory (%s), folder %s %s in %.1f s (%s), loaded in %.1f s\n",
      (long long)config.num_layers, (long long)config.count(model::KimiMixer::kda),
      (long long)config.count(model::KimiMixer::mla), (long long)config.hidden_size,
      (long long)config.vocab_size, (long long)config.kda_heads, (long long)config.kda_head_dim,
      (long long)config.mla_heads, (long long)config.qk_nope_head_dim,
      (long long)config.qk_rope_head_dim, (long long)config.v_head_dim,
      (long long)config.kv_lora_rank, (long long)config.num_experts,
      (long long)config.moe_intermediate, (long long)config.top_k,
      (long long)config.num_shared_experts, millions(info.total_params).c_str(),
      millions(info.active_params).c_str(), human_bytes(double(lm->weight_bytes())).c_str(),
      gpu ? o.device.describe().c_str() : "cpu fp32", human_bytes(stored_bytes).c_str(),
      reused ? "reused" : "written", write_s, o.bf16 ? "bf16" : "fp32", load_s);

  // Token ids from a fixed hash: the same prompt every rep.
  auto ids_of = [&](int64_t n, uint64_t salt) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      ids[size_t(i)] = int32_t((uint64_t(i + 1) * 2654435761ull + salt) % uint64_t(o.vocab));
    return ids;
  };
  const std::vector<int32_t> prompt = ids_of(o.prompt, 7);
  const int64_t V = lm->vocab_size();

  // Decode: prefill the prompt, then feed back the argmax token one at a time.
  double prompt_s = 1e30, decode_s = 1e30;
  for (int r = -1; r < o.reps; ++r) {  // rep -1 warms up (first touches, thread start-up)
    const std::unique_ptr<model::Session> session = lm->start_session(o.prompt + o.decode);
    Stopwatch prompt_clock;
    Tensor logits = session->feed_last(prompt);
    if (r >= 0) prompt_s = std::min(prompt_s, prompt_clock.seconds());
    Stopwatch decode_clock;
    for (int64_t t = 0; t < o.decode; ++t) {
      const int32_t next = int32_t(std::max_element(logits.f32(), logits.f32() + V) - logits.f32());
      logits = session->feed_last(std::span(&next, 1));
    }
    if (r >= 0) decode_s = std::min(decode_s, decode_clock.seconds());
  }
  // Decode steps of N sequences at once: N prompts (a different one each) prefilled, then
  // o.decode steps of decode_batch, each sequence fed its own argmax.
  struct BatchTiming {
    int64_t n;
    double step_s;
  };
  std::vector<BatchTiming> batch_timings;
  for (const int64_t n : o.batches) {
    double best = 1e30;
    for (int r = -1; r < o.reps; ++r) {
      std::vector<std::unique_ptr<model::Session>> sessions;
      std::vector<model::Session*> batch;
      std::vector<int32_t> next(static_cast<size_t>(n), 0);
      for (int64_t i = 0; i < n; ++i) {
        sessions.push_back(lm->start_session(o.prompt + o.decode));
        const Tensor logits = sessions.back()->feed_last(ids_of(o.prompt, 7 + 13 * uint64_t(i)));
        next[size_t(i)] = int32_t(std::max_element(logits.f32(), logits.f32() + V) - logits.f32());
        batch.push_back(sessions.back().get());
      }
      Stopwatch clock;
      for (int64_t t = 0; t < o.decode; ++t) {
        const Tensor logits = lm->decode_batch(batch, next);
        for (int64_t i = 0; i < n; ++i) {
          const float* row = logits.f32() + i * V;
          next[size_t(i)] = int32_t(std::max_element(row, row + V) - row);
        }
      }
      if (r >= 0) best = std::min(best, clock.seconds() / double(o.decode));
    }
    batch_timings.push_back({n, best});
  }
  // Prefill alone, at its own length.
  const std::vector<int32_t> long_prompt = ids_of(o.prefill, 11);
  const double prefill_s = best_seconds(o.reps, [&] {
    const std::unique_ptr<model::Session> session = lm->start_session(o.prefill);
    session->feed_last(long_prompt);
  });

  const double floor_s = gpu ? 0 : bytes.total() / (read_best * 1e9);
  auto percent_of_floor = [&](double floor, double t) {
    return gpu ? std::string("-") : fmt(100.0 * floor / t, 1);
  };
  const double per_token_s = decode_s / double(o.decode);
  std::printf(
      "\nbytes per decoded token (at %lld cached tokens, fp32 weights): weights %s + KDA states %s"
      " + MLA latent cache %s = %s\n",
      (long long)(o.prompt + o.decode / 2), human_bytes(bytes.weights).c_str(),
      human_bytes(bytes.state).c_str(), human_bytes(bytes.cache).c_str(),
      human_bytes(bytes.total()).c_str());
  if (!gpu)
    std::printf("floor = %s / %.1f GB/s = %.3f ms per token (%.1f tokens/s)\n",
                human_bytes(bytes.total()).c_str(), read_best, floor_s * 1e3, 1.0 / floor_s);
  std::printf("\n");

  Table table({"measure", "tokens", "ms/token", "tokens/s", "GB/s", "% of floor"});
  const std::string mib = std::to_string(o.bandwidth_mib) + " MiB";
  if (!gpu) {
    table.add({"read " + mib + ", 1 thread", "-", "-", "-", fmt(read_one, 1), "-"});
    table.add({"read " + mib + ", " + std::to_string(threads) + " threads", "-", "-", "-",
               fmt(read_all, 1), "-"});
    table.add({"copy " + mib + " (read + written)", "-", "-", "-", fmt(copy_all, 1), "-"});
    table.add({"read " + human_bytes(double(token_bytes)) + " again and again, 1 thread", "-", "-",
               "-", fmt(read_token, 1), "-"});
    table.add({"floor: bytes per token / best read", "-", fmt(floor_s * 1e3, 2),
               fmt(1.0 / floor_s, 1), fmt(read_best, 1), "100"});
  }
  table.add({"decode (feed_last, 1 token)", std::to_string(o.decode), fmt(per_token_s * 1e3, 2),
             fmt(1.0 / per_token_s, 1), fmt(bytes.total() / per_token_s / 1e9, 1),
             percent_of_floor(floor_s, per_token_s)});
  for (const BatchTiming& b : batch_timings) {
    const double step_bytes = decode_bytes(config, o.prompt + o.decode / 2, b.n).total();
    const double step_floor_s = gpu ? 0 : step_bytes / (read_best * 1e9);
    table.add({"decode " + std::to_string(b.n) + " sequences a step (decode_batch)",
               std::to_string(b.n * o.decode), fmt(b.step_s / double(b.n) * 1e3, 2),
               fmt(double(b.n) / b.step_s, 1), fmt(step_bytes / b.step_s / 1e9, 1),
               percent_of_floor(step_floor_s, b.step_s)});
  }
  table.add({"prompt (prefill)", std::to_string(o.prompt),
             fmt(prompt_s / double(o.prompt) * 1e3, 3), fmt(double(o.prompt) / prompt_s, 1), "-",
             "-"});
  table.add({"prefill", std::to_string(o.prefill), fmt(prefill_s / double(o.prefill) * 1e3, 3),
             fmt(double(o.prefill) / prefill_s, 1), "-", "-"});
  table.print();
  std::printf(
      "\nBest of %d reps. Decode: %lld tokens fed one at a time through Session::feed_last after "
      "a %lld-token prompt (argmax feedback). %% of floor = floor time / measured time; GB/s of\n"
      "decode = bytes per token x tokens/s. Reading one token's bytes over and over shows what "
      "the\n"
      "last-level cache adds when the working set is near its size. Batched rows: ms/token and\n"
      "tokens/s over all N sequences; their floor reads the weights once per step (the routed\n"
      "experts any sequence picks) plus every sequence's states and cache.\n",
      o.reps, (long long)o.decode, (long long)o.prompt);
  table.write(o.out_dir, "decode");
  std::printf("wrote %s/decode.md and %s/decode.csv\n", o.out_dir.c_str(), o.out_dir.c_str());
  return 0;
}

}  // namespace kda::apps
