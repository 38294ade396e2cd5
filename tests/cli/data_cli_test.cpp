// `troupe data prepare`, run as the built binary on small inputs: the shards it writes hold every
// document after an <|endoftext|>, in sorted order, split into train/val chunks by the documented
// rule; bad inputs exit non-zero with a message.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/shards.hpp"
#include "model/text_tokenizer.hpp"
#include "model/tokenizer.hpp"
#include "tests/cli/cli_harness.hpp"

namespace fs = std::filesystem;
using namespace troupe::model;
using namespace troupe::cli_test;

namespace {

const std::string kVocab = TROUPE_SOURCE_DIR "/data/gpt2";

fs::path scratch_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("troupe_datacli_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<std::uint16_t> shard_tokens(const fs::path& p) {
  auto s = shard::open(p.string());
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
  return {s->tokens16().begin(), s->tokens16().end()};
}

}  // namespace

TEST_CASE("data prepare writes every document after <|endoftext|>, split into train/val chunks") {
  auto dir = scratch_dir("prepare");
  fs::create_directories(dir / "in" / "sub");
  const std::string a = "Call me Ishmael. Some years ago, never mind how long precisely.\n";
  const std::string b = "It was the best of times, it was the worst of times; 1859 — Dickens.\n";
  const std::string c = "Fellow-Citizens of the Senate and House of Representatives: 中文 ✓\n";
  std::ofstream(dir / "in" / "sub" / "b.txt") << b;
  std::ofstream(dir / "in" / "a.txt") << a;
  std::ofstream(dir / "in" / "skip.md") << "not text input";
  std::ofstream(dir / "c.txt") << c;

  auto r = run_troupe(dir, "data prepare --input '" + (dir / "in").string() + "' '" +
                           (dir / "c.txt").string() + "' --out '" + (dir / "out").string() +
                           "' --val-fraction 0.25 --chunk-tokens 8 --tokenizer '" + kVocab + "'");
  INFO(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "prepared 3 documents"));
  CHECK(contains(r.err, "prepare: 100%"));  // not a terminal here: plain progress lines

  // Folder contents sorted (in/a.txt before in/sub/b.txt), then the file argument; .md ignored.
  auto tok = tokenizer::load(kVocab);
  REQUIRE(tok.ok());
  std::vector<int> stream;
  for (const auto* text : {&a, &b, &c}) {
    stream.push_back(tokenizer::eot_id);
    auto ids = tok->encode(*text);
    stream.insert(stream.end(), ids.begin(), ids.end());
  }
  std::vector<std::uint16_t> train, val;
  for (std::size_t begin = 0, k = 0; begin < stream.size(); begin += 8, ++k) {
    bool to_val = std::floor((k + 1) * 0.25) > std::floor(k * 0.25);  // chunks 3, 7, 11, ...
    auto& dst = to_val ? val : train;
    for (std::size_t j = begin; j < std::min(stream.size(), begin + 8); ++j)
      dst.push_back(static_cast<std::uint16_t>(stream[j]));
  }
  CHECK(shard_tokens(dir / "out" / "train.bin") == train);
  CHECK(shard_tokens(dir / "out" / "val.bin") == val);
  CHECK(val.size() >= 8);
  CHECK(contains(r.out, std::to_string(stream.size()) + " tokens"));

  // Same inputs, same bytes: the output is deterministic.
  auto first = slurp(dir / "out" / "train.bin");
  REQUIRE(run_troupe(dir, "data prepare --input '" + (dir / "in").string() + "' '" +
                          (dir / "c.txt").string() + "' --out '" + (dir / "out").string() +
                          "' --val-fraction 0.25 --chunk-tokens 8 --tokenizer '" + kVocab + "'")
              .code == 0);
  CHECK(slurp(dir / "out" / "train.bin") == first);
  fs::remove_all(dir);
}

TEST_CASE("data prepare with the default chunking warns when the input is too small for val") {
  auto dir = scratch_dir("small");
  std::ofstream(dir / "one.txt") << "A short document.";
  auto r = run_troupe(dir, "data prepare --input '" + (dir / "one.txt").string() + "' --out '" +
                           (dir / "out").string() + "' --tokenizer '" + kVocab + "'");
  REQUIRE(r.code == 0);
  CHECK(contains(r.err, "val.bin is empty"));
  CHECK(contains(r.err, "--chunk-tokens"));
  CHECK(shard_tokens(dir / "out" / "train.bin").size() == 5);  // <|endoftext|> + 4 tokens
  fs::remove_all(dir);
}

TEST_CASE("data prepare refuses missing inputs, a missing vocabulary and a bad fraction") {
  auto dir = scratch_dir("errors");
  std::ofstream(dir / "one.txt") << "text";
  auto r = run_troupe(dir, "data prepare --input '" + (dir / "nope.txt").string() + "' --out '" +
                           (dir / "out").string() + "' --tokenizer '" + kVocab + "'");
  CHECK(r.code != 0);
  CHECK(contains(r.err, "nope.txt: input not found"));

  r = run_troupe(dir, "data prepare --input '" + (dir / "one.txt").string() + "' --out '" +
                      (dir / "out").string() + "' --tokenizer '" + (dir / "novocab").string() + "'");
  CHECK(r.code != 0);
  CHECK(contains(r.err, "encoder.json"));
  CHECK(contains(r.err, "scripts/setup.sh"));

  r = run_troupe(dir, "data prepare --input '" + (dir / "one.txt").string() + "' --out '" +
                      (dir / "out").string() + "' --val-fraction 1.5 --tokenizer '" + kVocab + "'");
  CHECK(r.code != 0);
  CHECK(contains(r.err, "--val-fraction must be in [0, 1)"));

  r = run_troupe(dir, "data prepare --out '" + (dir / "out").string() + "'");
  CHECK(r.code != 0);
  CHECK(contains(r.err, "--input"));
  fs::remove_all(dir);
}

TEST_CASE("data prepare with LLaMA-3's tokenizer.json writes uint32 shards, <|begin_of_text|> first") {
  auto dir = scratch_dir("llama3");
  const std::string a = "Call me Ishmael. <|eot_id|> is plain text in a document.\n";
  const std::string b = "東京は晴れです。 12345 tokens 👋\n";
  std::ofstream(dir / "a.txt") << a;
  std::ofstream(dir / "b.txt") << b;
  const std::string llama3 = TROUPE_SOURCE_DIR "/data/llama3/tokenizer.json";
  auto r = run_troupe(dir, "data prepare --input '" + (dir / "a.txt").string() + "' '" +
                           (dir / "b.txt").string() + "' --out '" + (dir / "out").string() +
                           "' --val-fraction 0 --tokenizer '" + llama3 + "'");
  INFO(r.err);
  REQUIRE(r.code == 0);
  auto tok = load_tokenizer(llama3);
  REQUIRE(tok.ok());
  std::vector<std::uint32_t> want;
  for (const auto* text : {&a, &b}) {
    want.push_back(128000);
    for (int id : tok.value()->encode(*text, specials_in_text::plain))
      want.push_back(static_cast<std::uint32_t>(id));
  }
  auto s = shard::open((dir / "out" / "train.bin").string());
  REQUIRE(s.ok());
  CHECK(s->width() == 4);
  CHECK(std::vector<std::uint32_t>(s->tokens32().begin(), s->tokens32().end()) == want);
  CHECK(std::find(want.begin(), want.end(), 128009u) == want.end());  // <|eot_id|> stayed text

  // The config names the tokenizer; a model.vocab_size below its 128,256 ids is refused.
  const auto cfg = dir / "run.toml";
  std::ofstream(cfg) << "[model]\nvocab_size = 50304\n[data]\ntokenizer = '" << llama3 << "'\n";
  r = run_troupe(dir, "data prepare --input '" + (dir / "a.txt").string() + "' --out '" +
                      (dir / "out2").string() + "' --config '" + cfg.string() + "'");
  CHECK(r.code == 2);
  CHECK(contains(r.err, "run.toml"));
  CHECK(contains(r.err, "has 128256 ids, more than model.vocab_size 50304"));
  std::ofstream(cfg) << "[model]\nvocab_size = 128256\n[data]\ntokenizer = '" << llama3 << "'\n";
  r = run_troupe(dir, "data prepare --input '" + (dir / "a.txt").string() + "' --out '" +
                      (dir / "out2").string() + "' --config '" + cfg.string() + "' --val-fraction 0");
  INFO(r.err);
  REQUIRE(r.code == 0);
  auto s2 = shard::open((dir / "out2" / "train.bin").string());
  REQUIRE(s2.ok());
  CHECK(s2->width() == 4);
  CHECK(s2->id(0) == 128000u);
  fs::remove_all(dir);
}
