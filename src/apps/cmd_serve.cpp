// kda serve: an OpenAI-style HTTP server over one model folder (server/openai_api.h).
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "apps/model_device.h"
#include "core/error.h"
#include "model/causal_lm.h"
#include "server/http_server.h"
#include "server/openai_api.h"
#include "server/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace kda::apps {
namespace {

void print_usage() {
  std::puts(
      "usage: kda serve -m DIR [--host H] [--port P] [--parallel N] [--ctx N] [--name NAME]\n"
      "                 [--prefix-cache N] [--device cpu|cuda] [--dtype bf16|fp32]\n"
      "\n"
      "  -m DIR        model folder with a tokenizer (GPT-2 or Kimi Linear)\n"
      "  --host H      address to listen on (default 127.0.0.1)\n"
      "  --port P      port (default 8080; 0: any free port, printed at start)\n"
      "  --parallel N  sequences generating at once (default 4); more requests wait their turn\n"
      "  --ctx N       context limit per sequence, prompt included (default: the model's)\n"
      "  --name NAME   the model's id in the API (default: the folder's name)\n"
      "  --prefix-cache N  sequence snapshots kept (default 16, 0: none): a prompt that starts\n"
      "                with a kept one (a system prompt, a chat's earlier turns) continues it\n"
      "  --device D    cpu (default) or cuda; --dtype as for kda run\n"
      "\n"
      "Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions\n"
      "(\"stream\": true for server-sent events). Every active sequence advances by one token (or\n"
      "a piece of its prompt) a round; the round's tokens go through the model as one batch (on\n"
      "the CPU each weight read once for all of them). Ctrl-C stops it.");
}

server::HttpServer* g_server = nullptr;

extern "C" void on_signal(int signal) {
  if (g_server) g_server->stop();  // only sets an atomic flag
  std::signal(signal, SIG_DFL);    // a second Ctrl-C ends the process at once
}

}  // namespace

int cmd_serve(const Args& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    print_usage();
    return 0;
  }
  std::string model_dir, host = "127.0.0.1", name;
  int64_t port = 8080;
  server::SchedulerOptions options;
  ModelDevice device;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-m" || a == "--model") {
      model_dir = flag_value(args, i);
    } else if (a == "--host") {
      host = flag_value(args, i);
    } else if (a == "--port") {
      port = parse_int(flag_value(args, i), a);
      require(port >= 0 && port <= 65535, "option --port must be in 0..65535");
    } else if (a == "--parallel") {
      options.max_active = parse_int(flag_value(args, i), a);
      require(options.max_active >= 1, "option --parallel must be at least 1");
    } else if (a == "--ctx") {
      options.context = parse_int(flag_value(args, i), a);
      require(options.context >= 2, "option --ctx must be at least 2");
    } else if (a == "--prefix-cache") {
      options.prefix_cache = parse_int(flag_value(args, i), a);
      require(options.prefix_cache >= 0, "option --prefix-cache must be >= 0");
    } else if (a == "--name") {
      name = flag_value(args, i);
    } else if (a == "--device") {
      parse_device(flag_value(args, i), device);
    } else if (a == "--dtype") {
      parse_dtype(flag_value(args, i), device);
    } else {
      throw Error("unknown option '" + a + "' (try 'kda serve --help')");
    }
  }
  require(!model_dir.empty(), "no model folder: pass -m DIR");
  require(tokenizer::folder_has_tokenizer(model_dir),
          model_dir + ": no tokenizer in this folder (the server takes text)");
  if (name.empty()) name = std::filesystem::path(model_dir).lexically_normal().filename().string();
  if (name.empty()) name = std::filesystem::weakly_canonical(model_dir).filename().string();

  const std::unique_ptr<model::CausalLM> lm = load_model_on(model_dir, device);
  const std::unique_ptr<tokenizer::Tokenizer> tok = tokenizer::load_tokenizer(model_dir);
  server::Scheduler scheduler(*lm, *tok, options);
  server::OpenAiApi api(scheduler, *tok, name);
  server::HttpServer http(
      host, int(port),
      [&](const server::HttpRequest& req, server::HttpResponder& out) { api.handle(req, out); });
  g_server = &http;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::fprintf(stderr, "[kda serve] %s (%s) on http://%s:%d, %lld sequences at once\n",
               name.c_str(), device.describe().c_str(), host.c_str(), http.port(),
               (long long)options.max_active);
  std::fflush(stderr);
  http.run();
  g_server = nullptr;
  std::fprintf(stderr, "[kda serve] stopping\n");
  scheduler.shutdown();  // running requests end now; their connections close before `http` goes
  return 0;
}

}  // namespace kda::apps
