// Text corpora for language-model training: UTF-8 files -> documents -> token ids -> fixed-size
// rows of seq_len tokens that keep document boundaries.
//
// Documents: PATH is one file or a folder read recursively (regular files in sorted path order,
// names starting with '.' skipped). Each file is one document; with split_paragraphs a file is
// cut into documents at every run of blank lines (lines holding only spaces, tabs or '\r').
// Documents holding only whitespace are dropped. Files must be valid UTF-8 (a leading byte-order
// mark is dropped); anything else throws kda::Error naming the file and the byte offset.
//
// Tokens: every document is encoded on its own (special-token text is encoded as plain text)
// and followed by the tokenizer's end-of-text id (its first stop id) where it has one.
//
// Split: documents are numbered in corpus order; document i is validation when
// i % val_every == val_every - 1, training otherwise (disjoint by construction, and stable when
// documents are appended). val_every = 0 keeps every document for training.
//
// Rows: a split's documents are concatenated and cut into rows of seq_len tokens (the last row
// padded). In a row, the target of a token is the next token of the same document, or -1 where
// the document (or the split) ends; cu_seqlens starts a new segment at every document start
// inside the row, at the row start (a document cut by the row boundary continues as a fresh
// segment) and at the padding. So recurrent state resets and attention stops at documents.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kda::tokenizer {
class Tokenizer;
}

namespace kda::train {

struct TextDocument {
  std::string source;  // the file it came from
  std::string text;
};

// Reads the documents under path (see above). Throws kda::Error on a missing path, unreadable
// file, invalid UTF-8 (naming the file) or when no document holds any text (naming the path).
std::vector<TextDocument> read_text_documents(const std::string& path, bool split_paragraphs);

// Throws kda::Error naming `source` and the byte offset unless text is valid UTF-8 (no
// overlong forms, surrogates or code points past U+10FFFF).
void require_valid_utf8(const std::string& text, const std::string& source);

// The documents of one split, tokenized and back to back: document i holds
// tokens[offsets[i], offsets[i + 1]).
struct TokenDocuments {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  int64_t num_documents() const { return int64_t(offsets.size()) - 1; }
  int64_t num_tokens() const { return int64_t(tokens.size()); }
};

struct TextCorpusOptions {
  bool split_paragraphs = false;
  int64_t val_every = 10;
};

struct TextCorpus {
  TokenDocuments train, validation;
  int64_t vocab = 0;         // the tokenizer's vocabulary size
  int32_t end_of_text = -1;  // appended to every document; -1: the tokenizer has none
  uint64_t fingerprint = 0;  // hash of both splits' tokens and boundaries (checked on resume)
};

// Tokenizes and splits documents (see above). Throws kda::Error when the training split holds
// no token.
TextCorpus build_text_corpus(const std::vector<TextDocument>& documents,
                             const tokenizer::Tokenizer& tokenizer,
                             const TextCorpusOptions& options);

// read_text_documents + tokenizer::load_tokenizer(tokenizer_path) + build_text_corpus.
TextCorpus load_text_corpus(const std::string& path, const std::string& tokenizer_path,
                            const TextCorpusOptions& options);

// B rows of T tokens with document boundaries: inputs, targets [B, T] (target -1: not scored);
// cu_seqlens over the B * T flattened tokens (0, every document start, every row start, B * T),
// the form LineageModel::forward_backward takes.
struct TextBatch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs, targets;
  std::vector<int64_t> cu_seqlens;
};

// The fixed-size rows of one split (see above).
class PackedRows {
 public:
  // pad_id fills the padding of the last row. Throws kda::Error when seq_len < 1.
  PackedRows(const TokenDocuments& documents, int64_t seq_len, int32_t pad_id = 0);
  int64_t num_rows() const { return rows_; }
  int64_t seq_len() const { return T_; }
  // Appends row r's tokens, targets and row-local segment starts (0 included, T excluded).
  void append_row(int64_t r, std::vector<int32_t>& inputs, std::vector<int32_t>& targets,
                  std::vector<int64_t>& segment_starts) const;
  // The rows listed, in order, as one batch.
  TextBatch batch(std::span<const int64_t> rows) const;

 private:
  const TokenDocuments* docs_;
  std::vector<int64_t> doc_of_token_;  // document index of every token
  int64_t T_, rows_;
  int32_t pad_;
};

// Training rows in a fresh seeded order every epoch. The position (rows handed out so far) is
// all a checkpoint needs to continue the same sequence of batches.
class TextStream {
 public:
  TextStream(const PackedRows& rows, uint64_t seed);
  TextBatch next(int64_t batch_size);
  uint64_t position() const { return position_; }
  void seek(uint64_t position) { position_ = position; }

 private:
  const PackedRows* rows_;
  uint64_t seed_, position_ = 0;
  int64_t order_epoch_ = -1;
  std::vector<int64_t> order_;
};

}  // namespace kda::train
