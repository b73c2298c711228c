// The message of the kda::Error a call throws, for tests that check what an error names.
#pragma once
#include <functional>
#include <string>

#include "core/error.h"

namespace kda::testing {

// "(no kda::Error)" when the call returns normally (no test expects that text in a message).
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no kda::Error)";
}

}  // namespace kda::testing
