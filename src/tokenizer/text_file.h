// Small helpers for the tokenizer's text files (rank files, merges, JSON side files).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace kda::tokenizer {

// The whole file; throws kda::Error "PATH: cannot open (reason)" or "PATH: is a folder".
std::string read_text_file(const std::string& path);
// Calls fn(line, 1-based number) for each line, without its "\n" or "\r\n".
void for_each_line(std::string_view text, const std::function<void(std::string_view, size_t)>& fn);
// Fields separated by runs of spaces and tabs.
std::vector<std::string_view> split_fields(std::string_view line);
// A plain decimal number (digits only) in 0..max, or -1.
int64_t parse_decimal(std::string_view text, int64_t max);

}  // namespace kda::tokenizer
