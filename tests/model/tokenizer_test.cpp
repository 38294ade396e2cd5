// GPT-2 BPE against reference ids. The vectors below were produced by the algorithm of OpenAI's
// gpt-2 src/encoder.py run with Python's `regex` module on data/gpt2 (docs/data.md says how), and
// the corpus checks compare with that reference's token count and hash over every corpus file.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "model/tokenizer.hpp"

namespace fs = std::filesystem;
using troupe::model::tokenizer;

namespace {

const std::string kVocab = TROUPE_SOURCE_DIR "/data/gpt2";
const std::string kRaw = TROUPE_SOURCE_DIR "/data/raw";

const tokenizer& gpt2() {
  static auto t = tokenizer::load(kVocab);
  REQUIRE_MESSAGE(t.ok(), (t.ok() ? "" : t.err().to_string()));
  return t.value();
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// FNV-1a over ids, the hash the Python reference printed.
std::uint64_t id_hash(const std::vector<int>& ids) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (int id : ids) h = (h ^ static_cast<std::uint64_t>(id)) * 0x100000001b3ull;
  return h;
}

std::vector<fs::path> corpus_files() {
  std::vector<fs::path> files;
  for (auto& e : fs::recursive_directory_iterator(kRaw))
    if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

fs::path scratch_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("troupe_tok_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

struct vector_case {
  const char* name;
  std::string text;
  std::vector<int> ids;
};

const std::vector<vector_case> kVectors = {
    {"GPT-2 reference sentence",
     "Hello world, this is GPT-2 tokenization.",
     {15496, 995, 11, 428, 318, 402, 11571, 12, 17, 11241, 1634, 13}},
    {"accented Latin and an em dash",
     "héllo wörld — naïve café, Zürich, São Paulo",
     {71, 2634, 18798, 266, 30570, 335, 851, 41492, 40304, 11, 1168, 9116, 7527, 11, 311, 28749,
      34410}},
    {"contractions",
     "I'm sure they'll say it's what we've done, and you'd agree I'd've.",
     {40, 1101, 1654, 484, 1183, 910, 340, 338, 644, 356, 1053, 1760, 11, 290, 345, 1549, 4236,
      314, 1549, 1053, 13}},
    {"upper-case and curly-quote contractions are not split off",
     "DON'T SHOUT. She'S here. Don’t use curly quotes",
     {41173, 6, 51, 6006, 12425, 13, 1375, 6, 50, 994, 13, 2094, 447, 247, 83, 779, 45731, 13386}},
    {"whitespace runs, tabs and CRLF",
     "     leading spaces, trailing   \n\n\n  multiple\t\ttabs\r\n crlf  ",
     {220, 220, 220, 220, 3756, 9029, 11, 25462, 220, 220, 220, 628, 198, 220, 3294, 197, 197,
      8658, 82, 201, 198, 1067, 1652, 220, 220}},
    {"numbers in several scripts",
     "price: $1,234.56 on 2024-05-20 at 3:45pm; 1000000 and ٣٤٥ and ½ and Ⅻ",
     {20888, 25, 720, 16, 11, 24409, 13, 3980, 319, 48609, 12, 2713, 12, 1238, 379, 513, 25, 2231,
      4426, 26, 1802, 2388, 290, 18923, 96, 149, 97, 149, 98, 290, 25208, 290, 2343, 227, 104}},
    {"emoji, a ZWJ family and a variation selector",
     "Emojis: 👋🌍🚀 👨\xe2\x80\x8d👩\xe2\x80\x8d👧\xe2\x80\x8d👦 ❤\xef\xb8\x8f",
     {36, 5908, 73, 271, 25, 50169, 233, 8582, 234, 235, 8582, 248, 222, 50169, 101, 447, 235,
      41840, 102, 447, 235, 41840, 100, 447, 235, 41840, 99, 43074, 97, 37929}},
    {"CJK, Japanese and Korean",
     "中文分词测试：你好，世界！ 日本語のテキスト。한국어 텍스트",
     {40792, 23877, 229, 26344, 228, 46237, 235, 38184, 233, 46237, 243, 171, 120, 248, 19526,
      254, 25001, 121, 171, 120, 234, 10310, 244, 45911, 234, 171, 120, 223, 10545, 245, 98, 17312,
      105, 45739, 252, 5641, 24336, 25084, 43302, 16764, 47991, 250, 166, 113, 255, 168, 244, 112,
      220, 169, 227, 235, 168, 232, 97, 169, 232, 116}},
    {"Cyrillic, Greek, Hebrew, Arabic, Devanagari",
     "Привет, мир! Ελληνικά κείμενα. עברית العربية हिन्दी",
     {140, 253, 21169, 18849, 38857, 16843, 20375, 11, 12466, 120, 18849, 21169, 0, 7377, 243,
      39377, 39377, 138, 115, 26180, 29945, 43000, 138, 105, 7377, 118, 30950, 138, 107, 34703,
      30950, 26180, 17394, 13, 14360, 95, 49603, 37778, 33951, 103, 28981, 44690, 26897, 39848,
      22654, 45632, 28225, 117, 11976, 123, 11976, 101, 24231, 235, 11976, 99, 24231, 222}},
    {"Unicode spaces: no-break, em, ideographic, zero-width, line separator, NEL",
     "a\xc2\xa0"
     "b\xe2\x80\x83"
     "c\xe3\x80\x80"
     "d\xe2\x80\x8b"
     "e\xe2\x80\xa8"
     "f\xc2\x85"
     "g",
     {64, 1849, 65, 447, 225, 66, 5099, 222, 67, 9525, 68, 447, 101, 69, 126, 227, 70}},
    {"U+180E joins punctuation, not whitespace",
     "Mongolian \xe1\xa0\x8eseparator!",
     {44, 506, 349, 666, 28053, 254, 236, 25512, 1352, 0}},
    {"<|endoftext|> written in text is plain text",
     "<|endoftext|> is not special here",
     {27, 91, 437, 1659, 5239, 91, 29, 318, 407, 2041, 994}},
    {"repeated symbols merge left to right",
     "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx abababababababababababababababababababab",
     {24223, 24223, 24223, 12343, 5324, 450, 397, 397, 397, 397, 397, 397, 397, 397, 397, 397, 397,
      397, 397, 397, 397, 397, 397, 397, 397}},
    {"a lone space", " ", {220}},
    {"a lone newline", "\n", {198}},
    {"spaces before a newline", "  \n", {220, 220, 198}},
    {"punctuation runs",
     "!!!???... ---- ==== ((( )))",
     {10185, 28358, 986, 13498, 796, 18604, 14808, 7, 47282}},
    {"mathematical letters outside the BMP",
     "ﬁ ligature and ẞ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
     {171, 105, 223, 26106, 1300, 290, 28053, 118, 252, 290, 220, 47728, 242, 246, 47728, 242, 104,
      47728, 242, 99, 47728, 242, 254, 47728, 242, 105, 47728, 242, 94, 47728, 242, 95, 10688}},
};

}  // namespace

TEST_CASE("tokenizer encodes every reference vector to the reference ids and decodes it back") {
  const auto& t = gpt2();
  for (const auto& v : kVectors) {
    CAPTURE(v.name);
    CHECK(t.encode(v.text) == v.ids);
    CHECK(t.decode(v.ids) == v.text);
  }
}

TEST_CASE("tokenizer has GPT-2's 50257 tokens with <|endoftext|> last") {
  const auto& t = gpt2();
  CHECK(t.vocab_size() == 50257);
  CHECK(tokenizer::eot_id == 50256);
  CHECK(t.token_bytes(tokenizer::eot_id) == "<|endoftext|>");
  CHECK(t.encode("").empty());
}

TEST_CASE("tokenizer ids agree with the entries of encoder.json") {
  // Read encoder.json independently: GPT-2 writes a leading space as U+0120 'Ġ' and a newline as
  // U+010A 'Ċ'; these ids must be the ones encode() returns for the plain text.
  std::ifstream in(kVocab + "/encoder.json");
  REQUIRE(in);
  auto enc = nlohmann::json::parse(in);
  const auto& t = gpt2();
  CHECK(enc.at("Hello").get<int>() == 15496);
  CHECK(t.encode("Hello") == std::vector<int>{enc.at("Hello").get<int>()});
  CHECK(t.encode(" world") == std::vector<int>{enc.at("\xc4\xa0world").get<int>()});
  CHECK(t.encode("\n") == std::vector<int>{enc.at("\xc4\x8a").get<int>()});
  CHECK(t.encode(" tokenization") ==
        std::vector<int>{enc.at("\xc4\xa0token").get<int>(), enc.at("ization").get<int>()});
  CHECK(t.token_bytes(enc.at("\xc4\xa0the").get<int>()) == " the");
  CHECK(enc.at("<|endoftext|>").get<int>() == tokenizer::eot_id);
}

TEST_CASE("tokenizer round-trips and matches the reference count and hash on the whole corpus") {
  const auto& t = gpt2();
  auto files = corpus_files();
  REQUIRE_MESSAGE(files.size() == 234, "run scripts/setup.sh to fetch the corpus into data/raw");
  std::vector<int> stream;
  for (const auto& f : files) {
    std::string text = slurp(f);
    auto ids = t.encode(text);
    CAPTURE(f.string());
    CHECK(t.decode(ids) == text);
    if (f.filename() == "data.txt") {  // moby-dick
      CHECK(ids.size() == 317756);
      CHECK(id_hash(ids) == 0xa11b5d12787588cdull);
    }
    stream.push_back(tokenizer::eot_id);
    stream.insert(stream.end(), ids.begin(), ids.end());
  }
  CHECK(stream.size() == 2392269);
  CHECK(id_hash(stream) == 0xc28db96d6bff41e7ull);
}

TEST_CASE("tokenizer replaces ill-formed UTF-8 as Python's errors='replace' does") {
  std::size_t n = 0;
  CHECK(tokenizer::valid_utf8("a\xff" "b\xe2\x82" "c", &n) == "a\xef\xbf\xbd" "b\xef\xbf\xbd" "c");
  CHECK(n == 2);
  CHECK(tokenizer::valid_utf8("\xed\xa0\x80", &n) == "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
  CHECK(n == 3);  // a surrogate: each byte is its own ill-formed subpart
  CHECK(tokenizer::valid_utf8("\xf0\x9f\x98", &n) == "\xef\xbf\xbd");
  CHECK(n == 1);  // a cut-off emoji is one maximal subpart
  CHECK(tokenizer::valid_utf8("\xc0\xaf", &n) == "\xef\xbf\xbd\xef\xbf\xbd");
  CHECK(n == 2);  // overlong
  CHECK(tokenizer::valid_utf8("ok \xe2\x9c\x93", &n) == "ok \xe2\x9c\x93");
  CHECK(n == 0);
  // Reference ids of the repaired strings.
  CHECK(gpt2().encode("a\xff" "b\xe2\x82" "c") == std::vector<int>{64, 4210, 65, 4210, 66});
  CHECK(gpt2().encode("ok\xf4\x90\x80\x80!") == std::vector<int>{482, 12100, 0});
}

TEST_CASE("tokenizer gives the same ids when encoding from several threads") {
  const auto& t = gpt2();
  std::string text = slurp(corpus_files().back());
  std::vector<int> a, b;
  std::thread ta([&] { a = t.encode(text); });
  std::thread tb([&] { b = t.encode(text); });
  ta.join();
  tb.join();
  CHECK(!a.empty());
  CHECK(a == b);
  CHECK(a == t.encode(text));
}

TEST_CASE("tokenizer decode rejects ids outside the vocabulary") {
  CHECK_THROWS_AS(gpt2().decode({50257}), troupe::core::failure);
  CHECK_THROWS_AS(gpt2().decode({-1}), troupe::core::failure);
}

TEST_CASE("tokenizer load names the missing file and points at scripts/setup.sh") {
  auto dir = scratch_dir("missing");
  auto t = tokenizer::load(dir.string());
  REQUIRE(!t.ok());
  auto msg = t.err().to_string();
  CHECK(msg.find("encoder.json") != std::string::npos);
  CHECK(msg.find("scripts/setup.sh") != std::string::npos);

  fs::copy_file(kVocab + "/encoder.json", dir / "encoder.json");
  t = tokenizer::load(dir.string());
  REQUIRE(!t.ok());
  CHECK(t.err().to_string().find("vocab.bpe") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("tokenizer load reports corrupt encoder.json with its line") {
  auto dir = scratch_dir("badjson");
  write(dir / "encoder.json", "{\n  \"a\": 0,\n  \"b\": oops\n}\n");
  fs::copy_file(kVocab + "/vocab.bpe", dir / "vocab.bpe");
  auto t = tokenizer::load(dir.string());
  REQUIRE(!t.ok());
  CHECK(t.err().where.file == (dir / "encoder.json").string());
  CHECK(t.err().where.line == 3);
  CHECK(t.err().to_string().find("not valid JSON") != std::string::npos);

  write(dir / "encoder.json", "{\"a\": 0}");
  t = tokenizer::load(dir.string());
  REQUIRE(!t.ok());
  CHECK(t.err().to_string().find("single-byte token") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("tokenizer load reports a malformed vocab.bpe line by number") {
  auto dir = scratch_dir("badbpe");
  fs::copy_file(kVocab + "/encoder.json", dir / "encoder.json");
  write(dir / "vocab.bpe", "#version: 0.2\n\xc4\xa0 t\nthree fields here\n");
  auto t = tokenizer::load(dir.string());
  REQUIRE(!t.ok());
  CHECK(t.err().where.file == (dir / "vocab.bpe").string());
  CHECK(t.err().where.line == 3);

  write(dir / "vocab.bpe", "#version: 0.2\nqq\xe2\x9c\x93 zz\n");
  t = tokenizer::load(dir.string());
  REQUIRE(!t.ok());
  CHECK(t.err().to_string().find("does not contain") != std::string::npos);

  write(dir / "vocab.bpe", "Hello world\n");
  t = tokenizer::load(dir.string());
  REQUIRE(!t.ok());
  CHECK(t.err().to_string().find("#version") != std::string::npos);
  fs::remove_all(dir);
}
