// A byte-level tokenizer for text tests, written into a folder: every byte is one token (ranks
// 0..255) and <|endoftext|> is 256, so a test knows each document's tokens without a vocabulary.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

namespace kda::testing {

// Writes byte.tiktoken + byte.json into dir; returns the path of byte.tiktoken.
inline std::string write_byte_tokenizer(const std::filesystem::path& dir) {
  auto base64 = [](unsigned char byte) {
    static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string s;
    s += digits[byte >> 2];
    s += digits[(byte & 3) << 4];
    return s + "==";
  };
  std::filesystem::create_directories(dir);
  std::ofstream ranks(dir / "byte.tiktoken");
  for (int b = 0; b < 256; ++b) ranks << base64((unsigned char)b) << " " << b << "\n";
  std::ofstream(dir / "byte.json")
      << R"({"pat_str": " ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+", )"
      << R"("special_tokens": {"<|endoftext|>": 256}})";
  return (dir / "byte.tiktoken").string();
}

}  // namespace kda::testing
