// Runs a shell command line and captures what it prints: the kda binary tested end to end.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace kda::testing {

struct CommandResult {
  int status = -1;     // the exit code; -1 when the command did not exit normally
  std::string output;  // stdout, and stderr too when merged
};

// `command` is a shell fragment; stderr joins stdout when merge_stderr, else it is dropped.
inline CommandResult run_command(const std::string& command, bool merge_stderr = true) {
  CommandResult r;
  FILE* pipe = ::popen((command + (merge_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The built kda binary (KDA_BINARY) with `args`.
inline CommandResult run_kda(const std::string& args, bool merge_stderr = true) {
  return run_command(std::string("'") + KDA_BINARY + "' " + args, merge_stderr);
}

}  // namespace kda::testing
