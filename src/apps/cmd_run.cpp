// kda run: generate from a model folder, streaming each token as it comes; then one stats line
// (prefill and decode speed, memory held) on stderr, so stdout carries only the generation.
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "apps/model_device.h"
#include "core/error.h"
#include "core/timer.h"
#include "model/causal_lm.h"
#include "runtime/sampling.h"
#include "tokenizer/text_stream.h"
#include "tokenizer/tokenizer.h"

namespace kda::apps {
namespace {

void print_usage() {
  std::puts(
      "usage: kda run -m DIR (-p TEXT | --ids 1,2,3) [-n N] [--temp T] [--top-k K] [--top-p P]\n"
      "               [--seed S] [--chat] [--ctx N] [--device cpu|cuda] [--dtype bf16|fp32]\n"
      "\n"
      "  -m DIR       model folder (config.json + model.safetensors or a sharded index)\n"
      "  -p TEXT      prompt, encoded with the folder's tokenizer; echoed, then continued\n"
      "  --ids LIST   prompt as comma-separated token ids (folders without a tokenizer); the\n"
      "               generated ids are printed as they come\n"
      "  -n N         tokens to generate (default 128); generation also ends at the\n"
      "               tokenizer's stop tokens and when the context is full\n"
      "  --temp T     sampling temperature (default 0: greedy)\n"
      "  --top-k K    sample from the K most likely tokens (default 0: all)\n"
      "  --top-p P    sample from the smallest set reaching probability P (default 1: all)\n"
      "  --seed S     random seed (default 0); a seed reproduces a run exactly\n"
      "  --chat       wrap the prompt as one user message in the tokenizer's chat template\n"
      "  --ctx N      context limit in tokens, prompt included (default: the model's maximum)\n"
      "  --device D   cpu (default) or cuda (builds with CUDA: weights, states and caches on\n"
      "               the GPU)\n"
      "  --dtype T    CUDA weights: bf16 (default) or fp32 (exact to fp32 rounding)\n"
      "\n"
      "Ends with a stats line on stderr: prompt and decode tokens/s, memory held (weights,\n"
      "fixed KDA/conv state, MLA/KV cache).");
}

struct RunOptions {
  std::string model_dir;
  std::optional<std::string> prompt;
  std::optional<std::vector<int32_t>> ids;
  int64_t max_new_tokens = 128;
  runtime::SamplingParams sampling;
  bool chat = false;
  int64_t context = 0;
  ModelDevice device;
};

double parse_double(const std::string& text, const std::string& flag) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  require(used == text.size() && !text.empty(),
          "option " + flag + ": '" + text + "' is not a number");
  return v;
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    const int64_t id = parse_int(item, "--ids");
    require(id >= 0 && id <= INT32_MAX,
            "option --ids: token id " + std::to_string(id) + " is negative or too large");
    ids.push_back(int32_t(id));
    begin = end + 1;
  }
  require(!ids.empty(), "option --ids needs at least one token id");
  return ids;
}

RunOptions parse_options(const Args& args) {
  RunOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-m" || a == "--model") {
      o.model_dir = flag_value(args, i);
    } else if (a == "-p" || a == "--prompt") {
      o.prompt = flag_value(args, i);
    } else if (a == "--ids") {
      o.ids = parse_ids(flag_value(args, i));
    } else if (a == "-n" || a == "--n-predict") {
      o.max_new_tokens = parse_int(flag_value(args, i), a);
      require(o.max_new_tokens >= 1, "option " + a + " must be at least 1");
    } else if (a == "--temp" || a == "--temperature") {
      o.sampling.temperature = float(parse_double(flag_value(args, i), a));
    } else if (a == "--top-k") {
      o.sampling.top_k = parse_int(flag_value(args, i), a);
    } else if (a == "--top-p") {
      o.sampling.top_p = float(parse_double(flag_value(args, i), a));
    } else if (a == "--seed") {
      const int64_t seed = parse_int(flag_value(args, i), a);
      require(seed >= 0, "option --seed must be >= 0");
      o.sampling.seed = uint64_t(seed);
    } else if (a == "--chat") {
      o.chat = true;
    } else if (a == "--device") {
      parse_device(flag_value(args, i), o.device);
    } else if (a == "--dtype") {
      parse_dtype(flag_value(args, i), o.device);
    } else if (a == "--ctx") {
      o.context = parse_int(flag_value(args, i), a);
      require(o.context >= 1, "option --ctx must be at least 1");
    } else {
      throw Error("unknown option '" + a + "' (try 'kda run --help')");
    }
  }
  require(!o.model_dir.empty(), "no model folder: pass -m DIR");
  require(o.prompt.has_value() != o.ids.has_value(),
          "pass exactly one prompt: -p TEXT or --ids 1,2,3");
  require(!(o.chat && o.ids), "--chat needs a text prompt (-p) and a tokenizer, not --ids");
  o.sampling.validate();
  return o;
}

void print_text(const std::string& piece) {
  std::fwrite(piece.data(), 1, piece.size(), stdout);
  std::fflush(stdout);
}

std::string rate_text(int64_t tokens, double seconds) {
  if (tokens == 0 || seconds <= 0) return std::to_string(tokens) + " tokens";
  return std::to_string(tokens) + " tokens, " + fmt(double(tokens) / seconds, 1) + " tok/s";
}

}  // namespace

int cmd_run(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    print_usage();
    return args.empty() ? 2 : 0;
  }
  const RunOptions o = parse_options(args);
  const std::unique_ptr<model::CausalLM> lm = load_model_on(o.model_dir, o.device);

  std::unique_ptr<tokenizer::Tokenizer> tok;
  std::vector<int32_t> prompt;
  if (o.ids) {
    prompt = *o.ids;
    for (const int32_t id : prompt) {
      require(id < lm->vocab_size(), "option --ids: token id " + std::to_string(id) +
                                         " is outside the model's vocabulary of " +
                                         std::to_string(lm->vocab_size()));
    }
  } else {
    require(tokenizer::folder_has_tokenizer(o.model_dir),
            o.model_dir + ": no tokenizer in this folder; pass the prompt as --ids 1,2,3");
    tok = tokenizer::load_tokenizer(o.model_dir);
    const std::string text = o.chat ? tok->apply_chat_template({{"user", *o.prompt}}) : *o.prompt;
    prompt = tok->encode(text, /*allow_special=*/o.chat);
    require(!prompt.empty(), "the prompt encodes to no tokens");
  }
  std::set<int32_t> stop_ids;
  if (tok)
    for (const int32_t id : tok->stop_ids()) stop_ids.insert(id);

  const std::unique_ptr<model::Session> session = lm->start_session(o.context);
  const int64_t context = session->max_context();
  require(context == 0 || int64_t(prompt.size()) <= context,
          "the prompt has " + std::to_string(prompt.size()) + " tokens, more than the context of " +
              std::to_string(context));

  runtime::Sampler sampler(o.sampling);
  std::optional<tokenizer::TextStream> text;
  if (tok) {
    text.emplace(*tok);
    if (!o.chat) {
      std::fwrite(o.prompt->data(), 1, o.prompt->size(), stdout);
      std::fflush(stdout);
    }
  }

  Stopwatch clock;
  Tensor last = session->feed_last(prompt);
  const double prompt_seconds = clock.seconds();
  clock.reset();
  int64_t generated = 0, decode_steps = 0;
  std::string stopped = "after " + std::to_string(o.max_new_tokens) + " tokens (-n)";
  while (true) {
    const int32_t next = sampler.sample(last.span_f32());
    if (stop_ids.count(next)) {
      stopped = "at stop token " + std::to_string(next);
      break;
    }
    ++generated;
    if (text) {
      print_text(text->add(next));
    } else {
      std::printf(generated == 1 ? "%d" : " %d", next);
      std::fflush(stdout);
    }
    if (generated == o.max_new_tokens) break;
    if (context > 0 && session->length() >= context) {
      stopped = "at the context limit of " + std::to_string(context) + " tokens";
      break;
    }
    last = session->feed_last(std::span<const int32_t>(&next, 1));
    ++decode_steps;
  }
  const double decode_seconds = clock.seconds();
  if (text) print_text(text->finish());
  std::printf("\n");
  std::fflush(stdout);

  const model::MemoryReport memory = session->memory();
  std::fprintf(
      stderr,
      "[kda run] prompt: %s | decode: %s | stopped %s | memory: weights %s, KDA "
      "state %s, MLA/KV cache %s\n",
      rate_text(int64_t(prompt.size()), prompt_seconds).c_str(),
      rate_text(decode_steps, decode_seconds).c_str(), stopped.c_str(),
      human_bytes(double(memory.weight_bytes ? memory.weight_bytes : lm->weight_bytes())).c_str(),
      human_bytes(double(memory.state_bytes)).c_str(),
      human_bytes(double(memory.cache_bytes)).c_str());
  return 0;
}

}  // namespace kda::apps
