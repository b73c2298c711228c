// One exception type for every failure that comes from outside (files, flags, shapes).
#pragma once
#include <stdexcept>
#include <string>

namespace kda {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Throws kda::Error with `message` when `condition` is false.
inline void require(bool condition, const std::string& message) {
  if (!condition) throw Error(message);
}

}  // namespace kda
