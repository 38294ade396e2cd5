// Instruction records to rows (model/instruct.hpp): record parsing with the reason for every
// dropped record, the plain and LLaMA-3 templates, the loss mask, truncation, padding and packing.
#include <doctest/doctest.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "model/instruct.hpp"
#include "model/text_tokenizer.hpp"
#include "model/tokenizer.hpp"
#include "tests/model/trainer_fixture.hpp"

using namespace troupe;
using namespace troupe::model;
using model::testing::scratch_dir;

namespace {

const std::string kVocab = TROUPE_SOURCE_DIR "/data/gpt2";

std::string problem_of(const std::string& line) {
  parsed_record r = parse_record(line);
  REQUIRE_FALSE(r.ok());
  return r.problem;
}

// The rendered text with special and end tokens written out, and the trained part alone.
std::pair<std::string, std::string> flatten(const std::vector<segment>& segs) {
  std::string all, trained;
  for (const segment& s : segs) {
    const std::string text = s.what == segment::kind::eos ? "<eos>" : s.text;
    all += text;
    if (s.trained) trained += text;
  }
  return {all, trained};
}

const tokenizer& gpt2() {
  static tokenizer tok = [] {
    auto t = tokenizer::load(kVocab);
    REQUIRE_MESSAGE(t.ok(), (t.ok() ? "" : t.err().to_string()));
    return std::move(t.value());
  }();
  return tok;
}

token_codec gpt2_codec() {
  token_codec c;
  c.encode = [](std::string_view t) { return gpt2().encode(t); };
  c.special = [](std::string_view t) -> std::optional<int> {
    if (t == "<|endoftext|>") return tokenizer::eot_id;
    return std::nullopt;
  };
  c.eos = tokenizer::eot_id;
  c.pad = tokenizer::eot_id;
  c.name = "the GPT-2 tokenizer";
  return c;
}

example make_example(std::vector<std::uint8_t> mask) {
  example e;
  for (std::size_t i = 0; i < mask.size(); ++i) e.ids.push_back(static_cast<std::int32_t>(10 + i));
  e.mask = std::move(mask);
  return e;
}

}  // namespace

TEST_CASE("prompt/response and chat records parse into messages") {
  parsed_record a = parse_record(R"({"prompt": "2+2=", "response": "4", "id": 7})");
  REQUIRE(a.ok());
  REQUIRE(a.chat.size() == 2);
  CHECK(a.chat[0].role == "user");
  CHECK(a.chat[0].content == "2+2=");
  CHECK(a.chat[1].role == "assistant");
  CHECK(a.chat[1].content == "4");
  parsed_record b = parse_record(
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},)"
      R"( {"role": "assistant", "content": "Hello."}]})");
  REQUIRE(b.ok());
  REQUIRE(b.chat.size() == 3);
  CHECK(b.chat[2].content == "Hello.");
}

TEST_CASE("every kind of bad record is refused with its reason") {
  CHECK(parse_record("{\"prompt\": \"a\", ").invalid_json);
  CHECK(problem_of("{\"prompt\": \"a\", ").find("invalid JSON (column") == 0);
  CHECK(problem_of("not json").find("invalid JSON") == 0);
  CHECK(problem_of("{\"prompt\": \"\xff\", \"response\": \"x\"}").find("invalid JSON") == 0);
  CHECK(problem_of("[1, 2]") == "the record is an array, expected a JSON object");
  CHECK(problem_of(R"({"prompt": "a"})").find("missing field \"response\"") == 0);
  CHECK(problem_of(R"({"response": "a"})").find("missing field \"prompt\"") == 0);
  CHECK(problem_of(R"({"prompt": 3, "response": "a"})")
            .find("field \"prompt\" is a number, expected a string") == 0);
  CHECK(problem_of(R"({"messages": []})").find("field \"messages\" is empty") == 0);
  CHECK(problem_of(R"({"messages": "hi"})").find("field \"messages\" is a string") == 0);
  CHECK(problem_of(R"({"messages": [{"role": "user"}]})") ==
        "missing field \"content\" in message 1");
  CHECK(problem_of(R"({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})") ==
        "message 2 has role \"bot\"; roles are system, user and assistant");
  CHECK(problem_of(R"({"messages": [{"role": "user", "content": "a"}, 5]})")
            .find("message 2 is a number") == 0);
  CHECK(problem_of(R"({"messages": [{"role": "user", "content": "a"}]})") ==
        "no assistant message: nothing to train on");
  CHECK_FALSE(parse_record(R"({"prompt": 1, "response": "a"})").invalid_json);
}

TEST_CASE("the plain template trains the response and its end-of-text token") {
  parsed_record r = parse_record(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},)"
      R"( {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},)"
      R"( {"role": "assistant", "content": "A2"}]})");
  REQUIRE(r.ok());
  auto [all, trained] = flatten(render(chat_template::plain, r.chat));
  CHECK(all == "S\nQ1\nA1<eos>Q2\nA2<eos>");
  CHECK(trained == "A1<eos>A2<eos>");
}

TEST_CASE("the llama3 template writes Meta's chat format and trains assistant turns with <|eot_id|>") {
  parsed_record r = parse_record(
      R"({"messages": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi\n"},)"
      R"( {"role": "assistant", "content": "Hello."}]})");
  REQUIRE(r.ok());
  auto [all, trained] = flatten(render(chat_template::llama3, r.chat));
  // The format of Meta's LLaMA-3 model card (content trimmed, as its chat_template does).
  CHECK(all ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>");
  CHECK(trained == "Hello.<|eot_id|>");
}

TEST_CASE("encoding a plain example masks the prompt and trains the response and <|endoftext|>") {
  parsed_record r = parse_record(R"({"prompt": "Reverse: abc", "response": " cba"})");
  REQUIRE(r.ok());
  auto e = encode_example(render(chat_template::plain, r.chat), gpt2_codec());
  REQUIRE(e.ok());
  std::vector<int> want = gpt2().encode("Reverse: abc\n");
  const std::size_t prompt = want.size();
  for (int id : gpt2().encode(" cba")) want.push_back(id);
  want.push_back(tokenizer::eot_id);
  CHECK(std::vector<int>(e->ids.begin(), e->ids.end()) == want);
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(e->mask[i] == (i >= prompt ? 1 : 0));
}

TEST_CASE("the llama3 template with a tokenizer lacking its special tokens is an error naming one") {
  parsed_record r = parse_record(R"({"prompt": "a", "response": "b"})");
  auto e = encode_example(render(chat_template::llama3, r.chat), gpt2_codec());
  REQUIRE_FALSE(e.ok());
  CHECK(e.err().message.find("special token <|begin_of_text|>, which the GPT-2 tokenizer does not "
                             "have") != std::string::npos);
  CHECK(parse_template("llama3").ok());
  CHECK_FALSE(parse_template("chatml").ok());
}

TEST_CASE("padding puts one example per row; packing fills rows in order; padding is masked") {
  row_builder pad(6, false, 0);
  REQUIRE(pad.add(make_example({0, 0, 1, 1})));
  REQUIRE(pad.add(make_example({0, 1})));
  pad.finish();
  CHECK(pad.rows() == 2);
  CHECK(pad.ids() == std::vector<std::int32_t>{10, 11, 12, 13, 0, 0, 10, 11, 0, 0, 0, 0});
  CHECK(pad.mask() == std::vector<std::uint8_t>{0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0});

  row_builder pack(6, true, 0);
  REQUIRE(pack.add(make_example({0, 0, 1})));
  REQUIRE(pack.add(make_example({1, 1})));   // fits: the first token of an example is not trained
  REQUIRE(pack.add(make_example({0, 1})));   // does not fit the one left: a new row
  pack.finish();
  CHECK(pack.rows() == 2);
  CHECK(pack.ids() == std::vector<std::int32_t>{10, 11, 12, 10, 11, 0, 10, 11, 0, 0, 0, 0});
  CHECK(pack.mask() == std::vector<std::uint8_t>{0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0});
}

TEST_CASE("a long example is truncated to the row; one whose response starts past it is dropped") {
  row_builder b(4, true, 0);
  bool truncated = false;
  REQUIRE(b.add(make_example({0, 1, 1, 1, 1, 1}), &truncated));
  CHECK(truncated);
  CHECK(b.ids() == std::vector<std::int32_t>{10, 11, 12, 13});
  CHECK_FALSE(b.add(make_example({0, 0, 0, 0, 1, 1}), &truncated));
  CHECK_FALSE(b.add(make_example({1})));  // nothing to predict
  b.finish();
  CHECK(b.rows() == 1);
}

TEST_CASE("prepare_instructions drops bad records naming file and line, and splits by record") {
  scratch_dir tmp("instruct_prep");
  const std::string file = tmp / "data.jsonl";
  {
    std::ofstream out(file);
    out << R"({"prompt": "one", "response": " 1"})" << "\n"
        << "\n"                                                         // blank: skipped
        << R"({"prompt": "two", "response": " 2")" << "\n"               // line 3: invalid JSON
        << R"({"prompt": "three"})" << "\r\n"                            // line 4: missing field
        << R"({"prompt": ")" << std::string(200, 'x') << R"(", "response": "y"})" << "\n"  // 5
        << R"({"messages": [{"role": "user", "content": "four"}, {"role": "assistant", "content": " 4"}]})"
        << "\n"
        << R"({"prompt": "five", "response": " 5"})";  // no final newline
  }
  instruct_options opt;
  opt.seq_length = 16;
  opt.val_fraction = 1.0 / 3;
  opt.vocab_size = 50257;
  auto r = prepare_instructions({file}, opt, gpt2_codec());
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  const prepare_counts& n = r->counts;
  CHECK(n.records == 6);
  CHECK(n.kept == 3);
  CHECK(n.invalid_json == 1);
  CHECK(n.bad_fields == 1);
  CHECK(n.too_long == 1);
  REQUIRE(r->problems.size() == 3);
  CHECK(r->problems[0].file == file);
  CHECK(r->problems[0].line == 3);
  CHECK(r->problems[1].line == 4);
  CHECK(r->problems[1].reason.find("missing field \"response\"") == 0);
  CHECK(r->problems[2].line == 5);
  CHECK(r->problems[2].reason.find("prompt too long: its ") == 0);
  CHECK(r->problems[2].reason.find("leave the response no position in a row of 17 tokens "
                                   "(seq_length 16;") != std::string::npos);
  // Kept records 0, 1, 2: record 2 (the third, ⌊3/3⌋ > ⌊2/3⌋) goes to validation.
  CHECK(r->train.rows() == 2);
  CHECK(r->val.rows() == 1);
  std::vector<int> five = gpt2().encode("five\n");
  CHECK(r->val.ids()[0] == five[0]);

  // A token id outside the model's vocabulary stops preparation naming the line.
  opt.vocab_size = 1000;
  auto small = prepare_instructions({file}, opt, gpt2_codec());
  REQUIRE_FALSE(small.ok());
  CHECK(small.err().where.line == 1);
  CHECK(small.err().message.find("is not below model.vocab_size 1000") != std::string::npos);
}

TEST_CASE("the llama3 template with LLaMA-3's tokenizer.json: its special ids, text without specials") {
  auto loaded = load_tokenizer(TROUPE_SOURCE_DIR "/data/llama3/tokenizer.json");
  REQUIRE_MESSAGE(loaded.ok(), (loaded.ok() ? "" : loaded.err().to_string()));
  std::shared_ptr<const text_tokenizer> tok(std::move(loaded.value()));
  token_codec c;
  c.encode = [tok](std::string_view t) { return tok->encode(t, specials_in_text::plain); };
  c.special = [tok](std::string_view t) { return tok->token_id(t); };
  c.name = tok->describe();
  // A user turn that spells <|eot_id|> must stay text, not end the turn.
  parsed_record r = parse_record(
      R"({"messages": [{"role": "user", "content": "Say <|eot_id|>"}, {"role": "assistant", "content": "Done."}]})");
  REQUIRE(r.ok());
  auto e = encode_example(render(chat_template::llama3, r.chat), c);
  REQUIRE_MESSAGE(e.ok(), (e.ok() ? "" : e.err().to_string()));
  // LLaMA-3's published ids: <|begin_of_text|> 128000, <|start_header_id|> 128006,
  // <|end_header_id|> 128007, <|eot_id|> 128009.
  std::vector<int> want = {128000, 128006};
  auto add = [&](std::string_view text) {
    for (int id : tok->encode(text, specials_in_text::plain)) want.push_back(id);
  };
  add("user");
  want.push_back(128007);
  add("\n\n");
  add("Say <|eot_id|>");
  want.push_back(128009);
  want.push_back(128006);
  add("assistant");
  want.push_back(128007);
  add("\n\n");
  const std::size_t answer = want.size();
  add("Done.");
  want.push_back(128009);
  CHECK(std::vector<int>(e->ids.begin(), e->ids.end()) == want);
  int eot_in_text = 0;
  for (std::size_t i = 0; i + 1 < answer; ++i) eot_in_text += e->ids[i] == 128009;
  CHECK(eot_in_text == 1);  // the user turn's closing one only
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(e->mask[i] == (i >= answer ? 1 : 0));
}

TEST_CASE("a record with a number too large for a double is reported, not thrown") {
  // Found by fuzz/fuzz_instruct: the JSON library reports such a number with another exception
  // type than a syntax error.
  for (const char* line : {"444E440t4}", "{\"prompt\": 1E400, \"response\": \"x\"}"}) {
    INFO(line);
    const auto r = troupe::model::parse_record(line);
    CHECK_FALSE(r.ok());
    CHECK(r.problem.find("invalid JSON") != std::string::npos);
  }
}
