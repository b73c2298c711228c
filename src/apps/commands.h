// The kda binary's subcommands; each lives in its own cmd_*.cpp and returns an exit code.
#pragma once
#include <string>
#include <vector>

namespace kda::apps {

using Args = std::vector<std::string>;  // arguments after the subcommand name

int cmd_verify(const Args& args);
int cmd_lineage(const Args& args);
int cmd_bench(const Args& args);
int cmd_bench_recall(const Args& args);
int cmd_bench_decode(const Args& args);
int cmd_bench_train(const Args& args);
int cmd_bench_tasks(const Args& args);
int cmd_train(const Args& args);
int cmd_info(const Args& args);
int cmd_run(const Args& args);
int cmd_serve(const Args& args);
int cmd_tokenize(const Args& args);
int cmd_export(const Args& args);

}  // namespace kda::apps
