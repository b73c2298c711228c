#include "train/text_data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/parallel.h"
#include "tokenizer/tokenizer.h"

namespace kda::train {

namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  require(bool(in), path.string() + ": cannot open");
  std::ostringstream s;
  s << in.rdbuf();
  require(!in.bad(), path.string() + ": read failed");
  return s.str();
}

bool is_blank_line(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

bool is_whitespace_only(const std::string& text) {
  return text.find_first_not_of(" \t\r\n\f\v") == std::string::npos;
}

// Splits at runs of blank lines; the pieces keep their own line breaks.
std::vector<std::string> split_at_blank_lines(const std::string& text) {
  std::vector<std::string> pieces;
  std::string current;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    end = end == std::string::npos ? text.size() : end + 1;
    const std::string_view line(text.data() + at, end - at);
    if (is_blank_line(line.substr(0, line.size() - (line.back() == '\n')))) {
      if (!current.empty()) pieces.push_back(std::move(current));
      current.clear();
    } else {
      current += line;
    }
    at = end;
  }
  if (!current.empty()) pieces.push_back(std::move(current));
  return pieces;
}

// FNV-1a over 64-bit words.
void mix(uint64_t& h, uint64_t x) {
  for (int i = 0; i < 8; ++i) {
    h ^= (x >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

void require_valid_utf8(const std::string& text, const std::string& source) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  auto fail = [&] { throw Error(source + ": not valid UTF-8 (byte " + std::to_string(i) + ")"); };
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int extra = 0;
    uint32_t cp = 0, min = 0;
    if ((c & 0xE0) == 0xC0) {
      extra = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3, cp = c & 0x07, min = 0x10000;
    } else {
      fail();
    }
    for (int k = 1; k <= extra; ++k) {
      if (i + k >= n || (s[i + k] & 0xC0) != 0x80) fail();
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail();
    i += extra + 1;
  }
}

std::vector<TextDocument> read_text_documents(const std::string& path, bool split_paragraphs) {
  const fs::path root(path);
  require(fs::exists(root), "text corpus " + path + ": no such file or folder");
  std::vector<fs::path> files;
  if (fs::is_directory(root)) {
    for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator();
         ++it) {
      const std::string name = it->path().filename().string();
      if (!name.empty() && name[0] == '.') {  // hidden files and folders (.git, editor files)
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file()) files.push_back(it->path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(root);
  }
  std::vector<TextDocument> documents;
  for (const fs::path& file : files) {
    std::string text = read_file(file);
    require_valid_utf8(text, file.string());
    if (text.starts_with("\xEF\xBB\xBF")) text.erase(0, 3);
    if (split_paragraphs) {
      for (std::string& piece : split_at_blank_lines(text))
        if (!is_whitespace_only(piece)) documents.push_back({file.string(), std::move(piece)});
    } else if (!is_whitespace_only(text)) {
      documents.push_back({file.string(), std::move(text)});
    }
  }
  require(!documents.empty(), "text corpus " + path + ": empty (no file holds any text)");
  return documents;
}

TextCorpus build_text_corpus(const std::vector<TextDocument>& documents,
                             const tokenizer::Tokenizer& tokenizer,
                             const TextCorpusOptions& options) {
  require(options.val_every >= 0, "text corpus: val_every must be >= 0");
  TextCorpus corpus;
  corpus.vocab = tokenizer.vocab_size();
  const std::vector<int32_t> stops = tokenizer.stop_ids();
  corpus.end_of_text = stops.empty() ? -1 : stops.front();
  // documents are independent: encode them in parallel, then place them in order
  std::vector<std::vector<int32_t>> encoded(documents.size());
  parallel_for(int64_t(documents.size()), [&](int64_t i) {
    encoded[i] = tokenizer.encode(documents[i].text, /*allow_special=*/false);
    if (corpus.end_of_text >= 0) encoded[i].push_back(corpus.end_of_text);
  });
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < documents.size(); ++i) {
    if (encoded[i].empty()) continue;
    const bool validation =
        options.val_every > 0 && int64_t(i) % options.val_every == options.val_every - 1;
    TokenDocuments& split = validation ? corpus.validation : corpus.train;
    split.tokens.insert(split.tokens.end(), encoded[i].begin(), encoded[i].end());
    split.offsets.push_back(split.num_tokens());
    mix(hash, validation);
    mix(hash, encoded[i].size());
    for (int32_t t : encoded[i]) mix(hash, uint64_t(uint32_t(t)));
  }
  corpus.fingerprint = hash;
  require(corpus.train.num_tokens() > 0, "text corpus: the training split holds no token");
  return corpus;
}

TextCorpus load_text_corpus(const std::string& path, const std::string& tokenizer_path,
                            const TextCorpusOptions& options) {
  const std::vector<TextDocument> documents = read_text_documents(path, options.split_paragraphs);
  const std::unique_ptr<tokenizer::Tokenizer> tok = tokenizer::load_tokenizer(tokenizer_path);
  return build_text_corpus(documents, *tok, options);
}

PackedRows::PackedRows(const TokenDocuments& documents, int64_t seq_len, int32_t pad_id)
    : docs_(&documents), T_(seq_len), pad_(pad_id) {
  require(seq_len >= 1, "text rows: seq_len must be >= 1");
  doc_of_token_.resize(documents.num_tokens());
  for (int64_t d = 0; d < documents.num_documents(); ++d)
    std::fill(doc_of_token_.begin() + documents.offsets[d],
              doc_of_token_.begin() + documents.offsets[d + 1], d);
  rows_ = (documents.num_tokens() + T_ - 1) / T_;
}

void PackedRows::append_row(int64_t r, std::vector<int32_t>& inputs, std::vector<int32_t>& targets,
                            std::vector<int64_t>& segment_starts) const {
  require(r >= 0 && r < rows_, "text rows: row index out of range");
  const int64_t N = docs_->num_tokens(), begin = r * T_;
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t p = begin + t;
    if (p >= N) {  // padding: one segment of its own, never scored
      if (p == N) segment_starts.push_back(t);
      inputs.push_back(pad_);
      targets.push_back(-1);
      continue;
    }
    const int64_t doc = doc_of_token_[p];
    if (t == 0 || docs_->offsets[doc] == p) segment_starts.push_back(t);
    inputs.push_back(docs_->tokens[p]);
    targets.push_back(p + 1 < docs_->offsets[doc + 1] ? docs_->tokens[p + 1] : -1);
  }
}

TextBatch PackedRows::batch(std::span<const int64_t> rows) const {
  TextBatch b;
  b.B = int64_t(rows.size());
  b.T = T_;
  b.inputs.reserve(b.B * T_);
  b.targets.reserve(b.B * T_);
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < b.B; ++i) {
    starts.clear();
    append_row(rows[i], b.inputs, b.targets, starts);
    for (int64_t s : starts) b.cu_seqlens.push_back(i * T_ + s);
  }
  b.cu_seqlens.push_back(b.B * T_);
  return b;
}

TextStream::TextStream(const PackedRows& rows, uint64_t seed) : rows_(&rows), seed_(seed) {
  require(rows.num_rows() > 0, "text stream: no training rows");
}

TextBatch TextStream::next(int64_t batch_size) {
  const int64_t n = rows_->num_rows();
  std::vector<int64_t> picked;
  for (int64_t i = 0; i < batch_size; ++i, ++position_) {
    const int64_t epoch = int64_t(position_ / uint64_t(n));
    if (epoch != order_epoch_) {  // Fisher-Yates from (seed, epoch)
      order_.resize(n);
      for (int64_t r = 0; r < n; ++r) order_[r] = r;
      uint64_t state = seed_ * 0x9e3779b97f4a7c15ull + uint64_t(epoch);
      for (int64_t r = n - 1; r > 0; --r)
        std::swap(order_[r], order_[int64_t(splitmix64(state) % uint64_t(r + 1))]);
      order_epoch_ = epoch;
    }
    picked.push_back(order_[position_ % uint64_t(n)]);
  }
  return rows_->batch(picked);
}

}  // namespace kda::train
