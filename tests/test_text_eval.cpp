// The held-out evaluation of text training (`kda train --text`) scores exactly the validation
// rows it claims to: the val_tokens of log.jsonl is the number of scored targets of the first
// --eval-examples validation rows (0: all; more than there are: all), val_loss is the saved
// model's mean next-token cross-entropy over exactly those rows (document boundaries kept),
// and the validation documents are never trained on.
//
// The reference is rebuilt here from the documented rules (train/text_data.h), not from the
// library's packing: documents are the corpus files in sorted order, document i is validation
// when i % val_every == val_every - 1, every byte is a token (a byte-level tokenizer written by
// the test, <|endoftext|> = 256 closing every document), the validation documents are
// concatenated and cut into rows of seq_len tokens (the last one padded), and a token's target
// is the next token of its document (none for the last one, nor for the padding).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "byte_tokenizer.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "run_command.h"
#include "scratch_dir.h"
#include "train/model_factory.h"
#include "train/text_data.h"
#include "train/trainable_model.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::write_byte_tokenizer;

constexpr int32_t kEot = 256;
constexpr int64_t kT = 16;        // --seq-len
constexpr int64_t kValEvery = 3;  // --val-every: documents 2, 5, 8, 11 are validation
constexpr int64_t kDocuments = 12;
constexpr int64_t kSteps = 20;

const std::string kModelArgs =
    " --pattern KA --width 32 --heads 2 --head-dim 16 --mlp 64 --batch 4 --lr 1e-2 --seed 11"
    " --seq-len " +
    std::to_string(kT) + " --val-every " + std::to_string(kValEvery) + " --steps " +
    std::to_string(kSteps);

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Document d of the corpus: a tag no other document holds ("§07|"), then words (some of them
// multi-byte UTF-8) up to a length that varies by document. `variant` gives other words and
// lengths for the same tags.
std::string document_text(int64_t d, int variant = 0) {
  // café, naïve, über, €, 日本 and 😀 among them
  static const std::vector<std::string> words = [] {
    std::istringstream in(
        "the cat sat on a mat dog ran caf\xC3\xA9 na\xC3\xAFve \xC3\xBC\x62\x65r \xE2\x82\xAC "
        "\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80");
    std::vector<std::string> w;
    for (std::string word; in >> word;) w.push_back(word);
    return w;
  }();
  std::string text = "\xC2\xA7";  // §
  text += char('0' + d / 10);
  text += char('0' + d % 10);
  text += "|";
  const size_t length = size_t(30 + (d * 37 + variant * 23) % 45);
  uint64_t state = uint64_t(d) * 2654435761u + uint64_t(variant) * 97 + 1;
  while (text.size() < length) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    text += " " + words[(state >> 33) % words.size()];
  }
  return text + (d % 2 ? ".\n" : "\n");
}

bool is_validation(int64_t d) {
  return d % kValEvery == kValEvery - 1;
}

// The corpus folder: doc00.txt ... doc11.txt (sorted order = document order). With
// other_validation, the validation documents hold other text of other lengths.
fs::path write_corpus(const fs::path& dir, bool other_validation = false) {
  fs::create_directories(dir);
  for (int64_t d = 0; d < kDocuments; ++d) {
    const std::string name = std::string("doc") + char('0' + d / 10) + char('0' + d % 10) + ".txt";
    std::ofstream(dir / name, std::ios::binary)
        << document_text(d, other_validation && is_validation(d) ? 1 : 0);
  }
  return dir;
}

std::vector<int32_t> bytes_of(const std::string& text) {
  std::vector<int32_t> out;
  for (const char c : text) out.push_back(int32_t(uint8_t(c)));
  return out;
}

// The validation documents by the split rule, in corpus order.
std::vector<std::string> validation_texts(int variant = 0) {
  std::vector<std::string> texts;
  for (int64_t d = 0; d < kDocuments; ++d)
    if (is_validation(d)) texts.push_back(document_text(d, variant));
  return texts;
}

// The first `n` (0: all; capped at all) rows of seq_len kT of `texts`, packed as documented:
// inputs, targets (-1: not scored) and the segment starts of the flattened rows.
struct Rows {
  int64_t B = 0, all_rows = 0, scored = 0;
  std::vector<int32_t> inputs, targets;
  std::vector<int64_t> cu_seqlens;
};

Rows reference_rows(const std::vector<std::string>& texts, int64_t n) {
  std::vector<int32_t> tokens;
  std::vector<bool> first, last;  // of its document
  for (const std::string& text : texts) {
    std::vector<int32_t> doc = bytes_of(text);
    doc.push_back(kEot);
    for (size_t i = 0; i < doc.size(); ++i) {
      tokens.push_back(doc[i]);
      first.push_back(i == 0);
      last.push_back(i + 1 == doc.size());
    }
  }
  const int64_t total = int64_t(tokens.size());
  Rows r;
  r.all_rows = (total + kT - 1) / kT;
  r.B = n > 0 ? std::min(n, r.all_rows) : r.all_rows;
  for (int64_t p = 0; p < r.B * kT; ++p) {
    if (p >= total) {  // padding: a segment of its own, not scored
      if (p == total) r.cu_seqlens.push_back(p);
      r.inputs.push_back(kEot);
      r.targets.push_back(-1);
      continue;
    }
    if (p % kT == 0 || first[p]) r.cu_seqlens.push_back(p);
    r.inputs.push_back(tokens[p]);
    r.targets.push_back(last[p] ? -1 : tokens[p + 1]);
    r.scored += !last[p];
  }
  r.cu_seqlens.push_back(r.B * kT);
  return r;
}

std::vector<json> log_entries(const fs::path& dir, const std::string& key) {
  std::ifstream in(dir / "log.jsonl");
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) {
      json j = json::parse(line);
      if (j.contains(key)) out.push_back(std::move(j));
    }
  return out;
}

// The run's saved model: config.json (a lineage model) with every tensor of model.safetensors.
std::unique_ptr<train::TrainableModel> load_run_model(const fs::path& dir) {
  std::ifstream in(dir / "config.json");
  const json config = json::parse(in);
  std::unique_ptr<train::TrainableModel> model = train::new_trainable(config, 12345);
  const SafetensorsFile weights = SafetensorsFile::open((dir / "model.safetensors").string());
  EXPECT_EQ(weights.names().size(), model->params().size());
  for (train::Param* p : model->params()) {
    const Tensor w = weights.load(p->name);
    EXPECT_EQ(w.shape(), p->value.shape()) << p->name;
    if (w.shape() != p->value.shape()) return nullptr;
    std::copy(w.f32(), w.f32() + w.numel(), p->value.f32());
  }
  return model;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// --eval-examples N: the final evaluation (of the weights saved at the last step) covers the
// first N validation rows, or all of them for 0 and for N past their number. Its val_tokens is
// their number of scored targets, its val_loss the saved model's mean cross-entropy over them
// and its val_accuracy the share predicted, all computed here from the documented rules.
TEST(TextEval, ScoresExactlyTheFirstNValidationRows) {
  const testing::ScratchDir scratch;
  const std::string tok = write_byte_tokenizer(fs::path(scratch.file("tok")));
  const fs::path corpus = write_corpus(scratch.file("corpus"));
  const std::vector<std::string> texts = validation_texts();
  ASSERT_EQ(texts.size(), 4u);
  const int64_t all_rows = reference_rows(texts, 0).all_rows;
  // the evaluation runs in slices of 8 rows: N in the first slice, N within the second one
  // (short of all rows), N past all rows and N = 0 (all)
  ASSERT_GE(all_rows, 12) << "the corpus is too small for the cases below";
  const int64_t cases[] = {5, all_rows - 2, all_rows + 100, 0};
  ASSERT_NE((all_rows - 2) % 8, 0);
  int run = 0;
  for (const int64_t n : cases) {
    SCOPED_TRACE("--eval-examples " + std::to_string(n));
    const fs::path out = scratch.file("run" + std::to_string(run));
    // the first run evaluates at its last step inside the run (--eval-every = --steps), the
    // others only at the end: either way one evaluation, of the final weights
    const std::string eval_every = run++ == 0 ? std::to_string(kSteps) : "0";
    const auto r = testing::run_kda("train --out " + out.string() + " --text " + corpus.string() +
                                    " --tokenizer " + tok + kModelArgs + " --eval-every " +
                                    eval_every + " --eval-examples " + std::to_string(n));
    ASSERT_EQ(r.status, 0) << r.output;
    ASSERT_EQ(log_entries(out, "loss").size(), size_t(kSteps));
    const std::vector<json> evals = log_entries(out, "val_loss");
    ASSERT_EQ(evals.size(), 1u) << "one evaluation, at the end";
    const json& e = evals[0];
    EXPECT_EQ(e.at("step").get<int64_t>(), kSteps);

    const Rows want = reference_rows(texts, n);
    EXPECT_EQ(want.B, n > 0 ? std::min(n, all_rows) : all_rows);
    EXPECT_EQ(e.at("val_tokens").get<int64_t>(), want.scored);

    const std::unique_ptr<train::TrainableModel> model = load_run_model(out);
    ASSERT_NE(model, nullptr);
    const train::StepResult got = model->forward_backward(want.inputs.data(), want.targets.data(),
                                                          want.B, kT, false, want.cu_seqlens);
    ASSERT_EQ(got.scored, want.scored);
    ASSERT_TRUE(std::isfinite(got.loss));
    const double val_loss = e.at("val_loss").get<double>();
    EXPECT_LE(std::abs(val_loss - got.loss), 1e-5 * got.loss)
        << "logged " << val_loss << ", the saved model on those rows " << got.loss;
    // the accuracy counts argmax hits: allow one near-tie to fall the other way
    const double hits = e.at("val_accuracy").get<double>() * double(want.scored);
    EXPECT_LE(std::abs(hits - double(got.correct)), 1.0 + 1e-6)
        << hits << " vs " << got.correct << " of " << want.scored;
    // resuming the finished run trains nothing and reports the logged evaluation: the log still
    // holds it once (a resume used to append a second line for the same step)
    if (run > 2) continue;
    const std::string before = slurp(out / "log.jsonl");
    const auto again = testing::run_kda("train --resume " + out.string());
    ASSERT_EQ(again.status, 0) << again.output;
    EXPECT_EQ(slurp(out / "log.jsonl"), before);
  }
  // the rows are the documented ones: the loss of all rows is not that of another packing
  // (the check above can tell them apart), e.g. one that lets documents see each other
  {
    const Rows all = reference_rows(texts, 0);
    const std::unique_ptr<train::TrainableModel> model = load_run_model(scratch.file("run3"));
    ASSERT_NE(model, nullptr);
    const double packed = model
                              ->forward_backward(all.inputs.data(), all.targets.data(), all.B, kT,
                                                 false, all.cu_seqlens)
                              .loss;
    const double rows_only =
        model->forward_backward(all.inputs.data(), all.targets.data(), all.B, kT, false).loss;
    EXPECT_GT(std::abs(packed - rows_only), 1e-4 * packed) << packed << " " << rows_only;
  }
}

// No validation document reaches training: the library's split (the same corpus and settings)
// holds the documents the rule names, its training rows hold no validation document's text,
// and a run whose validation documents say something else trains bit for bit the same.
TEST(TextEval, ValidationDocumentsAreNeverTrainedOn) {
  const testing::ScratchDir scratch;
  const std::string tok = write_byte_tokenizer(fs::path(scratch.file("tok")));
  const fs::path corpus = write_corpus(scratch.file("corpus"));
  const train::TextCorpus c =
      train::load_text_corpus(corpus.string(), tok, {.val_every = kValEvery});
  ASSERT_EQ(c.end_of_text, kEot);
  // the split, document by document
  std::vector<std::vector<int32_t>> want_train, want_val;
  for (int64_t d = 0; d < kDocuments; ++d) {
    std::vector<int32_t> doc = bytes_of(document_text(d));
    doc.push_back(kEot);
    (is_validation(d) ? want_val : want_train).push_back(doc);
  }
  auto documents = [](const train::TokenDocuments& t) {
    std::vector<std::vector<int32_t>> out;
    for (int64_t i = 0; i < t.num_documents(); ++i)
      out.emplace_back(t.tokens.begin() + t.offsets[i], t.tokens.begin() + t.offsets[i + 1]);
    return out;
  };
  EXPECT_EQ(documents(c.validation), want_val);
  EXPECT_EQ(documents(c.train), want_train);
  // the training rows, read back to back, hold no validation document (nor its tag, which no
  // training document holds)
  const train::PackedRows rows(c.train, kT, kEot);
  std::vector<int64_t> all(size_t(rows.num_rows()));
  for (int64_t r = 0; r < rows.num_rows(); ++r) all[size_t(r)] = r;
  const std::vector<int32_t> trained = rows.batch(all).inputs;
  auto holds = [&](const std::vector<int32_t>& part) {
    return std::search(trained.begin(), trained.end(), part.begin(), part.end()) != trained.end();
  };
  for (const std::string& text : validation_texts()) {
    const std::vector<int32_t> doc = bytes_of(text);
    const std::vector<int32_t> tag(doc.begin(), doc.begin() + 5);  // "§NN|"
    EXPECT_FALSE(holds(doc)) << "a training row holds the validation document " << text;
    EXPECT_FALSE(holds(tag)) << "a training row holds the tag of the validation document " << text;
  }
  // end to end: other validation documents leave the training (every step's loss and gradient
  // norm, the saved weights) bit for bit the same, and only the evaluation changes
  const fs::path other = write_corpus(scratch.file("other_corpus"), /*other_validation=*/true);
  const fs::path a = scratch.file("a"), b = scratch.file("b");
  for (const auto& [dir, text] : {std::pair{a, corpus}, std::pair{b, other}}) {
    const auto r = testing::run_kda("train --out " + dir.string() + " --text " + text.string() +
                                    " --tokenizer " + tok + kModelArgs + " --eval-examples 0");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  const std::vector<json> la = log_entries(a, "loss"), lb = log_entries(b, "loss");
  ASSERT_EQ(la.size(), size_t(kSteps));
  ASSERT_EQ(lb.size(), size_t(kSteps));
  for (size_t i = 0; i < la.size(); ++i)
    for (const char* key : {"loss", "grad_norm"})
      EXPECT_EQ(la[i].at(key).get<double>(), lb[i].at(key).get<double>())
          << key << " at step " << i + 1;
  const std::string weights = read_bytes(a / "model.safetensors");
  EXPECT_GT(weights.size(), 1000u);
  EXPECT_EQ(weights, read_bytes(b / "model.safetensors"));
  const std::vector<json> ea = log_entries(a, "val_loss"), eb = log_entries(b, "val_loss");
  ASSERT_EQ(ea.size(), 1u);
  ASSERT_EQ(eb.size(), 1u);
  EXPECT_NE(ea[0].at("val_tokens"), eb[0].at("val_tokens"));  // the other documents were scored
  EXPECT_EQ(eb[0].at("val_tokens").get<int64_t>(), reference_rows(validation_texts(1), 0).scored);
}

}  // namespace
}  // namespace kda
