// A fresh folder per test and process under the system's temporary directory, named after the
// running test (kda_<suite>_<pid>_<test>, then _1, _2, ... for further folders), removed with
// everything in it when the test ends: parallel test runs never touch each other's files.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace kda::testing {

class ScratchDir {
 public:
  ScratchDir() {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    // a second folder in the same process gets its own number: two in one test never share
    static std::atomic<int> made{0};
    const int n = made++;
    path_ = std::filesystem::temp_directory_path() /
            ("kda_" + std::string(test->test_suite_name()) + "_" + std::to_string(::getpid()) +
             "_" + test->name() + (n > 0 ? "_" + std::to_string(n) : ""));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;  // a test may have made it read-only
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ignored);
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  // The names of the folder's entries, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path_))
      names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace kda::testing
