// Text corpora for training (train/text_data.h) on small corpora written to a temp folder with a
// byte-level tokenizer (every byte one token, <|endoftext|> = 256): documents, the split,
// packed rows and their boundaries, the seeded stream, UTF-8 errors; the model on a packed row
// against its documents run alone; and `kda train --text` end to end with a bit-exact resume.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "byte_tokenizer.h"
#include "core/error.h"
#include "core/random.h"
#include "error_of.h"
#include "tokenizer/tokenizer.h"
#include "train/lineage_model.h"
#include "train/text_data.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using train::PackedRows;
using train::TextBatch;
using train::TokenDocuments;

constexpr int32_t kEot = 256;

// A fresh folder per test (removed by the destructor).
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("kda_text_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  void write(const std::string& rel, const std::string& text) const {
    fs::create_directories((path / rel).parent_path());
    std::ofstream(path / rel, std::ios::binary) << text;
  }
};

std::vector<int32_t> bytes_of(const std::string& text, bool eot = true) {
  std::vector<int32_t> out(text.begin(), text.end());
  for (int32_t& t : out) t &= 0xff;
  if (eot) out.push_back(kEot);
  return out;
}

using kda::testing::error_of;
using kda::testing::write_byte_tokenizer;

TEST(TextData, FilesAreDocumentsInSortedOrderAndParagraphsSplitAtBlankLines) {
  TempDir dir("docs");
  dir.write("b.txt", "second\n");
  dir.write("a.txt", "first one\n\n  \n\nstill first\n");
  dir.write("sub/c.txt", "third");
  dir.write("blank.txt", " \n\t\n");  // whitespace only: no document
  dir.write(".hidden", "\xff");       // hidden files are skipped (this one is not UTF-8)
  dir.write(".git/x", "\xff");
  const auto docs = train::read_text_documents(dir.path.string(), false);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0].text, "first one\n\n  \n\nstill first\n");
  EXPECT_EQ(docs[1].text, "second\n");
  EXPECT_EQ(docs[2].text, "third");
  EXPECT_EQ(fs::path(docs[2].source).filename(), "c.txt");
  const auto paragraphs = train::read_text_documents(dir.path.string(), true);
  ASSERT_EQ(paragraphs.size(), 4u);
  EXPECT_EQ(paragraphs[0].text, "first one\n");
  EXPECT_EQ(paragraphs[1].text, "still first\n");
  EXPECT_EQ(paragraphs[2].text, "second\n");
  // one file on its own, with a byte-order mark dropped
  dir.write("bom.txt", "\xEF\xBB\xBFhello");
  const auto one = train::read_text_documents((dir.path / "bom.txt").string(), false);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].text, "hello");
}

TEST(TextData, InvalidUtf8AndEmptyCorporaThrowNamingTheFile) {
  TempDir dir("utf8");
  dir.write("good.txt", "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80\n");
  EXPECT_NO_THROW(train::read_text_documents(dir.path.string(), false));
  for (const std::string bad :
       {"\xff", "ab\xC0\xAF", "\xED\xA0\x80", "\xE2\x82", "\xF4\x90\x80\x80", "x\x80", "\xC3"}) {
    dir.write("zz_bad.txt", "fine text " + bad + " more");
    const std::string what =
        error_of([&] { train::read_text_documents(dir.path.string(), false); });
    EXPECT_NE(what.find("zz_bad.txt"), std::string::npos) << what;
    EXPECT_NE(what.find("UTF-8"), std::string::npos) << what;
  }
  TempDir empty("empty");
  empty.write("a.txt", "");
  empty.write("b.txt", "\n \n");
  std::string what = error_of([&] { train::read_text_documents(empty.path.string(), false); });
  EXPECT_NE(what.find(empty.path.string()), std::string::npos) << what;
  EXPECT_NE(what.find("empty"), std::string::npos) << what;
  what = error_of([&] { train::read_text_documents((empty.path / "nope").string(), false); });
  EXPECT_NE(what.find("nope"), std::string::npos) << what;
}

std::string doc_text(int64_t i) {  // (appending, not operator+: GCC 12 warns falsely on that)
  std::string s = "doc ";
  s += std::to_string(i);
  return s;
}

TEST(TextData, TokenizesEveryDocumentAndSplitsDisjointlyByIndex) {
  TempDir dir("split");
  const std::string tok_path = write_byte_tokenizer(dir.path / "tok");
  std::vector<train::TextDocument> docs;
  for (int i = 0; i < 23; ++i) docs.push_back({doc_text(i), doc_text(i)});
  const auto tok = tokenizer::load_tokenizer(tok_path);
  const train::TextCorpus c = train::build_text_corpus(docs, *tok, {.val_every = 5});
  EXPECT_EQ(c.vocab, 257);
  EXPECT_EQ(c.end_of_text, kEot);
  ASSERT_EQ(c.validation.num_documents(), 4);  // 4, 9, 14, 19
  ASSERT_EQ(c.train.num_documents(), 19);
  std::multiset<std::vector<int32_t>> seen;
  auto doc = [](const TokenDocuments& d, int64_t i) {
    return std::vector<int32_t>(d.tokens.begin() + d.offsets[i],
                                d.tokens.begin() + d.offsets[i + 1]);
  };
  for (int64_t i = 0; i < c.validation.num_documents(); ++i) {
    EXPECT_EQ(doc(c.validation, i), bytes_of(doc_text(5 * i + 4)));
    seen.insert(doc(c.validation, i));
  }
  for (int64_t i = 0; i < c.train.num_documents(); ++i) seen.insert(doc(c.train, i));
  std::multiset<std::vector<int32_t>> all;
  for (const auto& d : docs) all.insert(bytes_of(d.text));
  EXPECT_EQ(seen, all);  // every document once, in exactly one split
  // deterministic, and the fingerprint follows the content
  const train::TextCorpus again = train::build_text_corpus(docs, *tok, {.val_every = 5});
  EXPECT_EQ(again.fingerprint, c.fingerprint);
  EXPECT_EQ(again.train.tokens, c.train.tokens);
  docs[3].text += "!";
  EXPECT_NE(train::build_text_corpus(docs, *tok, {.val_every = 5}).fingerprint, c.fingerprint);
  const train::TextCorpus none = train::build_text_corpus(docs, *tok, {.val_every = 0});
  EXPECT_EQ(none.train.num_documents(), 23);
  EXPECT_EQ(none.validation.num_documents(), 0);
}

TEST(TextData, PackedRowsKeepDocumentBoundaries) {
  TokenDocuments docs;
  for (const std::string text : {"abcde", "fg", "hijklmnopq", "r"}) {
    const auto t = bytes_of(text);
    docs.tokens.insert(docs.tokens.end(), t.begin(), t.end());
    docs.offsets.push_back(docs.num_tokens());
  }
  // 6 + 3 + 11 + 2 = 22 tokens -> rows of 8: 8, 8, 6 + 2 padding
  const PackedRows rows(docs, 8, kEot);
  ASSERT_EQ(rows.num_rows(), 3);
  const std::vector<int64_t> all_rows{0, 1, 2};
  const TextBatch b = rows.batch(all_rows);
  ASSERT_EQ(b.B, 3);
  ASSERT_EQ(b.T, 8);
  auto ids = [](const std::string& s) { return bytes_of(s, false); };
  const int32_t E = kEot, X = -1;
  std::vector<int32_t> in = ids("abcde");
  for (int32_t t : {E, int32_t('f'), int32_t('g')}) in.push_back(t);
  std::vector<int32_t> tg = ids("bcde");
  for (int32_t t : {E, X, int32_t('g'), E}) tg.push_back(t);
  // row 1: "<eot>hijklmn" ; row 2: "opq<eot>r<eot><pad><pad>"
  in.push_back(E);
  tg.push_back(X);
  for (int32_t t : ids("hijklmn")) in.push_back(t);
  for (int32_t t : ids("ijklmno")) tg.push_back(t);  // "n" -> "o" crosses the row: still scored
  for (int32_t t : ids("opq")) in.push_back(t);
  for (int32_t t : ids("pq")) tg.push_back(t);
  for (int32_t t : {E, X, E, X}) tg.push_back(t);  // q -> eot, eot -> -, r -> eot, eot -> -
  for (int32_t t : {E, int32_t('r'), E}) in.push_back(t);
  for (int i = 0; i < 2; ++i) {  // padding
    in.push_back(E);
    tg.push_back(X);
  }
  EXPECT_EQ(b.inputs, in);
  EXPECT_EQ(b.targets, tg);
  // segments: row 0 at 0 and "fg" at 6; row 1 at 8 (the rest of "fg") and "hij..." at 9;
  // row 2 at 16 (the rest of "hij..."), "r" at 20 and the padding at 22
  const std::vector<int64_t> cu{0, 6, 8, 9, 16, 20, 22, 24};
  EXPECT_EQ(b.cu_seqlens, cu);
  EXPECT_THROW(PackedRows(docs, 0), Error);
  EXPECT_THROW(rows.batch(std::vector<int64_t>{3}), Error);
}

TEST(TextData, StreamVisitsEveryRowOncePerEpochAndResumesFromItsPosition) {
  TokenDocuments docs;
  for (int i = 0; i < 50; ++i) {  // 50 one-row documents: token i, then <eot>
    docs.tokens.push_back(i);
    docs.tokens.push_back(kEot);
    docs.offsets.push_back(docs.num_tokens());
  }
  const PackedRows rows(docs, 2);
  ASSERT_EQ(rows.num_rows(), 50);
  train::TextStream a(rows, 7), b(rows, 7), c(rows, 8);
  std::vector<int32_t> first_epoch;
  for (int i = 0; i < 10; ++i) {
    const TextBatch x = a.next(5);
    for (int r = 0; r < 5; ++r) first_epoch.push_back(x.inputs[2 * r]);
  }
  std::vector<int32_t> sorted = first_epoch;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_NE(first_epoch, sorted);  // shuffled
  // the same seed gives the same batches; a position continues the sequence
  for (int i = 0; i < 10; ++i) b.next(5);
  EXPECT_EQ(a.position(), 50u);
  const uint64_t at = a.position() + 3;
  a.next(3);
  const TextBatch after = a.next(7);
  train::TextStream resumed(rows, 7);
  resumed.seek(at);
  EXPECT_EQ(resumed.next(7).inputs, after.inputs);
  EXPECT_NE(c.next(50).inputs, train::TextStream(rows, 7).next(50).inputs);
}

// Parameter gradients, flattened.
std::vector<double> gradients(train::LineageModel& model) {
  std::vector<double> g;
  for (train::Param* p : model.params())
    for (float x : p->grad.span_f32()) g.push_back(x);
  return g;
}

double relative_error(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// One row holding two documents (one spanning chunks of 64) gives the loss and gradients of
// the two documents run on their own, weighted by their scored tokens.
TEST(TextDataModel, PackedRowOfTwoDocumentsMatchesTheDocumentsRunSeparately) {
  for (const char* pattern : {"KKKA", "AA", "LDG", "KM"}) {
    train::LineageModel model({32, 16, 2, 8, 24, pattern}, 3);
    for (train::Param* p : model.params())
      if (p->decay)
        for (float& w : p->value.span_f32()) w *= 4.0f;
    Random rng(std::hash<std::string>()(pattern));
    const int64_t T1 = 70, T2 = 23, T = T1 + T2;
    std::vector<int32_t> in(T), tg(T);
    for (auto& x : in) x = int32_t(rng.integer(0, 31));
    for (auto& x : tg) x = rng.uniform(0, 1) < 0.8 ? int32_t(rng.integer(0, 31)) : -1;
    const std::vector<int64_t> cu{0, T1, T};
    model.zero_grad();
    const auto packed = model.forward_backward(in.data(), tg.data(), 1, T, true, cu);
    const std::vector<double> g_packed = gradients(model);
    model.zero_grad();
    const auto r1 = model.forward_backward(in.data(), tg.data(), 1, T1, true);
    std::vector<double> g_alone = gradients(model);
    model.zero_grad();
    const auto r2 = model.forward_backward(in.data() + T1, tg.data() + T1, 1, T2, true);
    const std::vector<double> g2 = gradients(model);
    ASSERT_EQ(packed.scored, r1.scored + r2.scored);
    const double w1 = double(r1.scored) / double(packed.scored), w2 = 1 - w1;
    for (size_t i = 0; i < g_alone.size(); ++i) g_alone[i] = w1 * g_alone[i] + w2 * g2[i];
    const double loss_alone = w1 * r1.loss + w2 * r2.loss;
    EXPECT_LE(std::abs(packed.loss - loss_alone) / loss_alone, 1e-6) << pattern;
    const double err = relative_error(g_packed, g_alone);
    EXPECT_LE(err, 1e-5) << pattern;  // NaN fails too
    EXPECT_EQ(packed.correct, r1.correct + r2.correct) << pattern;
    // without the boundary the second document sees the first: the loss differs
    const auto unpacked = model.forward_backward(in.data(), tg.data(), 1, T, false);
    EXPECT_GT(std::abs(unpacked.loss - packed.loss), 1e-6) << pattern;
  }
  // cu_seqlens holding only the row starts is the plain batch of rows
  train::LineageModel model({32, 16, 2, 8, 24, "KA"}, 4);
  Random rng(9);
  const int64_t B = 2, T = 20;
  std::vector<int32_t> in(B * T), tg(B * T);
  for (auto& x : in) x = int32_t(rng.integer(0, 31));
  for (auto& x : tg) x = int32_t(rng.integer(0, 31));
  const std::vector<int64_t> rows{0, T, 2 * T};
  model.zero_grad();
  const double packed = model.forward_backward(in.data(), tg.data(), B, T, true, rows).loss;
  const std::vector<double> gp = gradients(model);
  model.zero_grad();
  const double plain = model.forward_backward(in.data(), tg.data(), B, T, true).loss;
  EXPECT_LE(std::abs(packed - plain) / plain, 1e-6);
  EXPECT_LE(relative_error(gp, gradients(model)), 1e-5);
  // a layout that lets a document cross a row start is refused
  const std::vector<int64_t> crossing{0, 30, 2 * T};
  EXPECT_THROW(model.forward_backward(in.data(), tg.data(), B, T, false, crossing), Error);
  const std::vector<int64_t> short_end{0, T};
  EXPECT_THROW(model.forward_backward(in.data(), tg.data(), B, T, false, short_end), Error);
}

int run_kda(const std::string& args) {
  const int status =
      std::system((std::string(KDA_BINARY) + " " + args + " >/dev/null 2>&1").c_str());
  return WEXITSTATUS(status);
}

std::vector<std::string> log_lines(const fs::path& p, const std::string& key) {
  std::ifstream in(p);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("\"" + key + "\":");
    if (at == std::string::npos) continue;
    // two runs of NaN losses would match each other: every value must be a finite number
    const char* value = line.c_str() + at + key.size() + 3;
    char* end = nullptr;
    const double x = std::strtod(value, &end);
    EXPECT_TRUE(end != value && std::isfinite(x)) << key << " not a finite number: " << line;
    // timings differ between runs: keep everything up to them
    out.push_back(line.substr(0, line.find("\"tokens_per_s\"")));
  }
  return out;
}

TEST(TextDataCli, TrainsOnATextFolderAndResumesBitForBit) {
  TempDir dir("cli");
  const std::string tok = write_byte_tokenizer(dir.path / "tok");
  Random rng(21);
  const std::vector<std::string> words{"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran"};
  for (int d = 0; d < 12; ++d) {
    std::string text;
    for (int w = 0; w < 30; ++w) text += words[rng.integer(0, 8)] + (w % 10 == 9 ? ".\n" : " ");
    dir.write("corpus/doc" + std::to_string(d / 10) + std::to_string(d % 10) + ".txt", text);
  }
  const std::string args = " --text " + (dir.path / "corpus").string() + " --tokenizer " + tok +
                           " --pattern KA --width 32 --heads 2 --head-dim 16 --mlp 64"
                           " --seq-len 48 --batch 2 --lr 3e-3 --seed 3 --val-every 4";
  const fs::path a = dir.path / "a", b = dir.path / "b";
  ASSERT_EQ(run_kda("train --out " + a.string() + " --steps 5 --eval-every 2" + args), 0);
  const auto losses = log_lines(a / "log.jsonl", "loss");
  ASSERT_EQ(losses.size(), 5u);
  // steps 2 and 4, then the end
  ASSERT_EQ(log_lines(a / "log.jsonl", "val_loss").size(), 3u);
  std::ifstream config(a / "config.json");
  const std::string cfg((std::istreambuf_iterator<char>(config)), {});
  EXPECT_NE(cfg.find("\"vocab_size\": 257"), std::string::npos);
  EXPECT_NE(cfg.find("\"task\": \"text\""), std::string::npos);
  // interrupted after 2 steps and resumed: the same 5 losses, bit for bit
  ASSERT_EQ(
      run_kda("train --out " + b.string() + " --steps 5 --eval-every 2 --stop-after 2" + args), 0);
  EXPECT_EQ(log_lines(b / "log.jsonl", "val_loss").size(), 1u);  // step 2: logged once
  ASSERT_EQ(run_kda("train --resume " + b.string()), 0);
  EXPECT_EQ(log_lines(b / "log.jsonl", "loss"), losses);
  // without a validation split: trains, logs no evaluation
  const fs::path nv = dir.path / "no_val";
  ASSERT_EQ(
      run_kda("train --out " + nv.string() + " --steps 2 --eval-every 1" + args + " --val-every 0"),
      0);
  EXPECT_EQ(log_lines(nv / "log.jsonl", "loss").size(), 2u);
  EXPECT_EQ(log_lines(nv / "log.jsonl", "val_loss").size(), 0u);
  // a corpus that changed since the checkpoint is refused
  dir.write("corpus/doc00.txt", "something else entirely\n");
  EXPECT_EQ(run_kda("train --resume " + b.string()), 1);
  // bad UTF-8 in the corpus, and --text without --tokenizer
  dir.write("corpus/doc00.txt", "bad \xff byte\n");
  EXPECT_EQ(run_kda("train --out " + (dir.path / "c").string() + " --steps 1" + args), 1);
  EXPECT_EQ(run_kda("train --out " + (dir.path / "d").string() + " --text " +
                    (dir.path / "corpus").string()),
            1);
}

}  // namespace
}  // namespace kda
