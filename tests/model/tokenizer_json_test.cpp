// Tokenizers from Hugging Face tokenizer.json files (model/text_tokenizer.hpp): GPT-2's file gives
// exactly the ids of the encoder.json + vocab.bpe path (itself checked against OpenAI's ids in
// tokenizer_test.cpp); the LLaMA files decode back to the text; special ids; added-token rules on
// small files written here; and every unsupported or malformed part refused by name. The LLaMA
// ids themselves are compared with the npm reference encoders by tokenizer_reference_test.mjs.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/text_tokenizer.hpp"
#include "model/tokenizer.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::model;
using json = nlohmann::json;

namespace {

const std::string kData = TROUPE_SOURCE_DIR "/data";

std::unique_ptr<text_tokenizer> load_or_fail(const std::string& spec) {
  auto t = load_tokenizer(spec);
  REQUIRE_MESSAGE(t.ok(), (t.ok() ? "" : t.err().to_string() +
                                             " (run scripts/setup.sh for data/gpt2, data/llama2, "
                                             "data/llama3)"));
  return std::move(t.value());
}

fs::path scratch_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("troupe_tokjson_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_text(const std::string& path, std::size_t max) {
  std::ifstream in(path, std::ios::binary);
  std::string s(max, '\0');
  in.read(s.data(), static_cast<std::streamsize>(max));
  s.resize(static_cast<std::size_t>(in.gcount()));
  return s;
}

const std::vector<std::string> kCrafted = {
    "Hello world, this is GPT-2 tokenization.",
    "CJK 我们今天去公园散步。東京は晴れです。서울",
    "emoji 👋🌍 🧑‍🚀 👨‍👩‍👧‍👦 🇫🇮 ❤️‍🔥!!",
    "combining e\xCC\x81 a\xCC\x88 n\xCC\x83",
    "  runs   of\t\tspaces\n\n\r\n   ",
    "digits 1 12 123 1234 12345 3.14159",
    "I'm you're he's we've they'll she'd IT'S",
};

// A small byte-level BPE file: the 256 byte characters, merges "a b" -> "ab" and "ab c" -> "abc",
// plus added tokens with the given settings.
json small_byte_level(const json& added) {
  json vocab = json::object();
  std::vector<std::string> chars;
  // GPT-2's alphabet, spelled out: printable bytes as themselves, the rest from U+0100 on.
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab["\xC4\xA0" "ab"] = 258;  // "Ġab": space + ab
  int next = 259;
  json added_out = json::array();
  for (auto a : added) {
    a["id"] = next++;
    added_out.push_back(a);
  }
  return json{{"added_tokens", added_out},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"post_processor", nullptr},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model",
               {{"type", "BPE"},
                {"vocab", vocab},
                {"merges", json::array({"a b", "ab c", json::array({"\xC4\xA0", "ab"})})}}}};
}

std::string write_json(const fs::path& dir, const json& j, const std::string& name = "tokenizer.json") {
  fs::create_directories(dir);
  const auto p = dir / name;
  std::ofstream(p) << j.dump();
  return p.string();
}

std::string load_error(const std::string& path) {
  auto t = load_tokenizer(path);
  REQUIRE(!t.ok());
  return t.err().to_string();
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("GPT-2's tokenizer.json gives the ids of encoder.json + vocab.bpe on the corpus") {
  auto files = tokenizer::load(kData + "/gpt2");
  REQUIRE_MESSAGE(files.ok(), "run scripts/setup.sh");
  auto js = load_or_fail(kData + "/gpt2/tokenizer.json");
  CHECK(js->vocab_size() == 50257);
  std::vector<std::string> texts = kCrafted;
  texts.push_back(read_text(kData + "/raw/moby-dick/data/data.txt", 200000));
  for (const auto& t : texts) {
    auto want = files->encode(t);
    REQUIRE(!want.empty());
    CHECK(js->encode(t, specials_in_text::plain) == want);
    CHECK(js->decode(want) == t);
  }
  // Written in text, <|endoftext|> is the special id in match mode and text in plain mode.
  CHECK(js->encode("a<|endoftext|>b") == std::vector<int>{64, 50256, 65});
  CHECK(js->encode("a<|endoftext|>b", specials_in_text::plain) == files->encode("a<|endoftext|>b"));
  auto folder = load_or_fail(kData + "/gpt2");  // GPT-2's own files win in a folder with both
  CHECK(folder->describe().find("encoder.json + vocab.bpe") != std::string::npos);
  CHECK(js->bos_id() == 50256);
  CHECK(js->eos_id() == 50256);
  CHECK(!js->add_bos());
}

TEST_CASE("LLaMA-3's and LLaMA-2's files decode every crafted text back, with their special ids") {
  auto l3 = load_or_fail(kData + "/llama3/tokenizer.json");
  CHECK(l3->vocab_size() == 128256);
  CHECK(l3->bos_id() == 128000);
  CHECK(l3->eos_id() == 128001);
  CHECK(l3->add_bos());
  CHECK(l3->token_id("<|eot_id|>") == 128009);
  auto l2 = load_or_fail(kData + "/llama2");
  CHECK(l2->vocab_size() == 32000);
  CHECK(l2->bos_id() == 1);
  CHECK(l2->eos_id() == 2);
  CHECK(l2->add_bos());
  for (const auto& t : kCrafted) {
    auto a = l3->encode(t);
    CHECK(l3->decode(a) == t);
    auto b = l2->encode(t);
    CHECK(l2->decode(b) == t);
    auto with_bos = l3->encode_for_model(t);
    REQUIRE(with_bos.size() == a.size() + 1);
    CHECK(with_bos.front() == 128000);
  }
  // A character outside LLaMA-2's vocabulary falls back to its UTF-8 bytes, <0xNN> = NN + 3.
  auto e = l2->encode("\xF0\x9F\xA7\xAA");  // U+1F9EA TEST TUBE
  CHECK(e == std::vector<int>{29871, 0xF0 + 3, 0x9F + 3, 0xA7 + 3, 0xAA + 3});
  // Specials in text: matched, or read as text.
  CHECK(l3->encode("<|eot_id|>") == std::vector<int>{128009});
  CHECK(l3->encode("<|eot_id|>", specials_in_text::plain).size() > 1);
}

TEST_CASE("added tokens follow lstrip, rstrip and single_word, longest first") {
  auto dir = scratch_dir("added");
  json added = json::array({
      {{"content", "<x>"}, {"special", true}},                          // 259
      {{"content", "<x>y"}, {"special", true}},                         // 260: longer wins
      {{"content", "[L]"}, {"special", true}, {"lstrip", true}},        // 261
      {{"content", "[R]"}, {"special", true}, {"rstrip", true}},        // 262
      {{"content", "w"}, {"special", false}, {"single_word", true}},    // 263
  });
  auto path = write_json(dir, small_byte_level(added));
  auto t = load_or_fail(path);
  CHECK(t->encode("abc") == std::vector<int>{257});
  CHECK(t->encode("ab ab") == std::vector<int>{256, 258});
  CHECK(t->encode("<x>y<x>") == std::vector<int>{260, 259});
  CHECK(t->encode("ab  [L]") == std::vector<int>{256, 261});        // spaces before [L] absorbed
  CHECK(t->encode("[R]   ab") == std::vector<int>{262, 256});       // spaces after [R] absorbed
  CHECK(t->encode("w w") == std::vector<int>{263, ' ', 263});      // a word on its own
  CHECK(t->encode("aw")[1] != 263);                                 // inside a word: not matched
  // plain mode reads special tokens as text but still matches other added tokens.
  auto plain = t->encode("<x> w", specials_in_text::plain);
  CHECK(plain.back() == 263);
  CHECK(plain.front() == '<');
  fs::remove_all(dir);
}

TEST_CASE("SentencePiece-style files: Metaspace pre-tokenizer and the Strip decoder") {
  auto dir = scratch_dir("meta");
  json vocab = {{"<unk>", 0}, {"\xE2\x96\x81", 1}, {"a", 2}, {"b", 3}, {"\xE2\x96\x81" "a", 4},
                {"\xE2\x96\x81" "ab", 5}};
  json j = {{"added_tokens", json::array()},
            {"normalizer", nullptr},
            {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"},
                               {"prepend_scheme", "first"}, {"split", false}}},
            {"post_processor", nullptr},
            {"decoder", {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "first"}}},
            {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", true}, {"vocab", vocab},
                       {"merges", json::array({"\xE2\x96\x81 a", "\xE2\x96\x81" "a b"})}}}};
  auto t = load_or_fail(write_json(dir, j));
  CHECK(t->encode("ab a") == std::vector<int>{5, 4});
  CHECK(t->encode("ab xy") == std::vector<int>{5, 1, 0});  // x, y unknown: one fused <unk>
  CHECK(t->decode(std::vector<int>{5, 4}) == "ab a");
  fs::remove_all(dir);
}

TEST_CASE("load_tokenizer picks the kind by what the path holds and names what is missing") {
  auto gpt2 = load_or_fail(kData + "/gpt2/");
  auto dir = scratch_dir("kinds");
  CHECK(has(load_error((dir / "nope.json").string()), "tokenizer not found"));
  CHECK(has(load_error(dir.string()), "neither tokenizer.json nor encoder.json"));
  fs::create_directories(dir / "g");
  fs::copy_file(kData + "/gpt2/encoder.json", dir / "g/encoder.json");
  fs::copy_file(kData + "/gpt2/vocab.bpe", dir / "g/vocab.bpe");
  auto files = load_or_fail((dir / "g").string());
  CHECK(has(files->describe(), "encoder.json + vocab.bpe"));
  CHECK(files->encode("a<|endoftext|>b") == std::vector<int>{64, 50256, 65});
  CHECK(files->encode("Hello world") == gpt2->encode("Hello world"));
  fs::remove_all(dir);
}

TEST_CASE("malformed or unsupported tokenizer.json parts are refused by file and key") {
  auto dir = scratch_dir("bad");
  const auto base = small_byte_level(json::array());
  auto with = [&](const std::string& name, auto edit) {
    json j = base;
    edit(j);
    return load_error(write_json(dir / name, j));
  };
  auto m = with("wp", [](json& j) { j["model"]["type"] = "WordPiece"; });
  CHECK(has(m, "model.type"));
  CHECK(has(m, "model type 'WordPiece' is not supported (supported: BPE)"));
  m = with("nfkc", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; });
  CHECK(has(m, "normalizer.type"));
  CHECK(has(m, "normalizer 'NFKC' is not supported"));
  m = with("bert", [](json& j) { j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}}; });
  CHECK(has(m, "pre-tokenizer 'BertPreTokenizer'"));
  m = with("merge", [](json& j) { j["model"]["merges"].push_back("zz q"); });
  CHECK(has(m, "model.merges[3]"));
  CHECK(has(m, "uses or makes a token that model.vocab lacks"));
  m = with("gap", [](json& j) { j["model"]["vocab"]["far"] = 1000; });
  CHECK(has(m, "id 259 is missing"));
  m = with("byte", [](json& j) { j["model"]["vocab"].erase("a"); j["model"]["vocab"]["zz"] = 97; });
  CHECK(has(m, "needs a token for every byte; 'a' (byte 97) is missing"));
  m = with("regex", [](json& j) {
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  });
  CHECK(has(m, "pre_tokenizer.pattern: cannot compile the pattern"));
  m = with("dropout", [](json& j) { j["model"]["dropout"] = 0.1; });
  CHECK(has(m, "BPE dropout is not supported"));
  m = with("eos", [](json& j) {
    j["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single", json::array({{{"Sequence", {{"id", "A"}}}}, {{"SpecialToken", {{"id", "a"}}}}})}};
  });
  CHECK(has(m, "adds 'a' after the text"));
  // A config beside the file naming a token the vocabulary lacks.
  write_json(dir / "cfg", base);
  write_json(dir / "cfg", json{{"eos_token", "</nope>"}}, "tokenizer_config.json");
  m = load_error((dir / "cfg/tokenizer.json").string());
  CHECK(has(m, "tokenizer_config.json"));
  CHECK(has(m, "token '</nope>' is not in"));
  // Broken JSON: the line and column.
  { std::ofstream(dir / "broken.json") << "{\n  \"model\": {\n    \"vocab\": [1,\n"; }
  m = load_error((dir / "broken.json").string());
  CHECK(has(m, "broken.json:"));
  CHECK(has(m, "not valid JSON"));
  fs::remove_all(dir);
}
