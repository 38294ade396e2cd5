// `troupe generate` as users run it: a batch from --prompt and --prompts, greedy text of a batch
// equal to each prompt's text alone, seeds, whole UTF-8 characters on stdout, the rates on stderr,
// and bad input refused with a message.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "kernels/select.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "model/generate.hpp"
#include "tests/cli/troupe_process.hpp"
#include "tests/model/trainer_fixture.hpp"

using namespace std::chrono_literals;
using troupe::model::testing::scratch_dir;
using troupe::testing::run_troupe;

namespace {

const std::string kVocab = TROUPE_SOURCE_DIR "/data/gpt2";

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// A two-layer GPT-2 over the real vocabulary with 32 positions, weights drawn wide enough that
/// sampling at temperature 1 spreads over many tokens (byte tokens that split characters among
/// them).
std::string write_model(const scratch_dir& dir,
                        troupe::core::arch_kind arch = troupe::core::arch_kind::gpt2,
                        int vocab = 50257, const std::string& tokenizer = kVocab) {
  troupe::core::config cfg;
  cfg.model.arch = arch;
  cfg.model.vocab_size = vocab;
  if (arch == troupe::core::arch_kind::llama) {
    cfg.model.num_kv_heads = 1;
    cfg.model.tie_embeddings = false;
  }
  cfg.model.num_layers = 2;
  cfg.model.hidden_size = 16;
  cfg.model.num_heads = 2;
  cfg.model.seq_length = 32;
  cfg.model.init_std = 0.2f;
  cfg.data.tokenizer_dir = tokenizer;
  cfg.runtime.threads = 1;
  auto parsed = troupe::core::parse_config(troupe::core::to_toml(cfg), "ckpt");
  REQUIRE_MESSAGE(parsed.ok(), (parsed.ok() ? "" : parsed.err().to_string()));
  auto be = troupe::kernels::make_backend("cpu");
  troupe::model::chunk net(parsed->model, troupe::model::partition(parsed->model, 1)[0], *be);
  net.init(3);
  troupe::model::checkpoint::save_request req;
  req.step = 1;
  req.config_toml = troupe::core::to_toml(parsed.value());
  req.shards = {troupe::model::checkpoint::model_shard(*be, net)};
  auto saved = troupe::model::checkpoint::save(dir / "ckpt", req);
  REQUIRE_MESSAGE(saved.ok(), (saved.ok() ? "" : saved.err().to_string()));
  return saved.value();
}

/// True when s is whole UTF-8: a fresh stream passes it through unchanged and holds nothing back
/// (model/generate.hpp: it replaces every ill-formed byte).
bool whole_utf8(const std::string& s) {
  troupe::model::utf8_stream u;
  return u.push(s) == s && u.finish().empty();
}

}  // namespace

TEST_CASE("generate continues a batch of prompts as it continues each alone (greedy)") {
  scratch_dir dir("cli_generate_batch");
  const std::string ck = write_model(dir);
  std::ofstream(dir / "more.txt") << "Call me Ishmael.\n\nIt was the best of times\n";
  std::ofstream(dir / "more.jsonl") << "{\"prompt\": \"Call me Ishmael.\", \"response\": \"x\"}\n"
                                    << "{\"prompt\": \"It was the best of times\"}\n";
  const std::vector<std::string> common = {"generate", ck, "--temperature", "0",
                                           "--max-new-tokens", "6"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  auto batch = run_troupe(dir.path, with({"--prompt", "Hello", "--prompt", "The sea was",
                                          "--prompts", dir / "more.txt"}), 120s);
  REQUIRE_MESSAGE(batch.code == 0, batch.err);
  std::string alone;
  for (const char* p : {"Hello", "The sea was", "Call me Ishmael.", "It was the best of times"}) {
    auto one = run_troupe(dir.path, with({"--prompt", p}), 60s);
    REQUIRE_MESSAGE(one.code == 0, one.err);
    CHECK(one.out.rfind(p, 0) == 0);  // the prompt, then its continuation
    CHECK(one.out.size() > std::string(p).size() + 1);
    alone += one.out;
  }
  CHECK(batch.out == alone);
  CHECK(contains(batch.err, "4 prompt(s) on cpu (fp32): prefill "));
  CHECK(contains(batch.err, "tokens/s); decode "));
  // The same prompts from a JSON-lines file.
  auto jsonl = run_troupe(dir.path, with({"--prompt", "Hello", "--prompt", "The sea was",
                                          "--prompts", dir / "more.jsonl"}), 120s);
  CHECK(jsonl.out == batch.out);
}

TEST_CASE("generate: a seed names a sample and stdout never carries part of a character") {
  scratch_dir dir("cli_generate_seed");
  const std::string ck = write_model(dir);
  auto sample = [&](const std::string& seed) {
    return run_troupe(dir.path, {"generate", ck, "--prompt", "日本語 🙂", "--prompt", "é",
                                 "--temperature", "1", "--top-k", "0", "--top-p", "0.999",
                                 "--max-new-tokens", "30", "--seed", seed, "--ignore-eos"},
                      60s);
  };
  auto a = sample("7"), b = sample("7"), c = sample("8");
  REQUIRE_MESSAGE(a.code == 0, a.err);
  CHECK(a.out == b.out);
  CHECK(a.out != c.out);
  // Run one prompt at a time, the draws and so the text stay those of the seed.
  auto one_by_one = run_troupe(dir.path, {"generate", ck, "--prompt", "日本語 🙂", "--prompt", "é",
                                          "--temperature", "1", "--top-k", "0", "--top-p", "0.999",
                                          "--max-new-tokens", "30", "--seed", "7", "--ignore-eos",
                                          "--batch-size", "1"},
                               60s);
  CHECK(one_by_one.out == a.out);
  CHECK(contains(one_by_one.err, "2 prompt(s) on cpu"));
  // 60 tokens drawn from all 50,257 include byte tokens that are halves of characters; what
  // reaches stdout is whole UTF-8 all the same.
  for (const auto* r : {&a, &c}) CHECK(whole_utf8(r->out));
}

TEST_CASE("generate refuses bad input with a message: long prompt, flags, files, checkpoint") {
  scratch_dir dir("cli_generate_bad");
  const std::string ck = write_model(dir);
  std::ofstream(dir / "bad.jsonl") << "{\"prompt\": \"ok\"}\n{\"prompt\": 3\n";
  std::ofstream(dir / "empty.txt") << "\n\n";
  std::string long_prompt;
  for (int i = 0; i < 40; ++i) long_prompt += " word";
  struct bad {
    std::vector<std::string> args;
    int code;
    std::string says;
  };
  const std::vector<bad> cases = {
      {{"--prompt", "Hi", "--prompt", long_prompt}, 1,
       "prompt 2 is 40 tokens long, more than the model's 32 positions (model.seq_length)"},
      {{"--prompt", "Hi", "--top-p", "0"}, 2, "--top-p 0 is not a probability in (0, 1]"},
      {{"--prompt", "Hi", "--top-p", "1.5"}, 2, "--top-p 1.5 is not a probability"},
      {{"--prompt", "Hi", "--temperature", "nan"}, 2, "--temperature nan is not a number"},
      {{"--prompt", "Hi", "--max-new-tokens", "2147483647"}, 2,
       "--max-new-tokens 2147483647 is above the 1048576"},
      {{}, 2, "no prompt given"},
      {{"--prompt", "Hi", "--batch-size", "0"}, 2, "--batch-size 0 is not 1 or more"},
      {{"--prompt", "Hi", "--dtype", "fp8"}, 2, "--dtype 'fp8' is not one of fp32, bf16, fp16"},
      {{"--prompt", "Hi", "--dtype", "bf16", "--device", "cpu"}, 1, "--dtype bf16 on the cpu device"},
      {{"--prompts", dir / "missing.txt"}, 1, "missing.txt: cannot open the prompts file"},
      {{"--prompts", dir / "bad.jsonl"}, 1, "bad.jsonl:2: not valid JSON"},
      {{"--prompts", dir / "empty.txt"}, 1, "empty.txt: the prompts file holds no prompt"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.says);
    std::vector<std::string> args = {"generate", ck};
    args.insert(args.end(), c.args.begin(), c.args.end());
    auto r = run_troupe(dir.path, args, 60s);
    CHECK(r.code == c.code);
    CHECK(contains(r.err, c.says));
    CHECK(contains(r.err, "hint:"));
    CHECK(r.out.empty());
  }
  auto missing = run_troupe(dir.path, {"generate", dir / "nowhere", "--prompt", "Hi"}, 30s);
  CHECK(missing.code == 1);
  CHECK(contains(missing.err, "nowhere"));
  CHECK(missing.out.empty());
}

TEST_CASE("generate stops a prompt at the model's positions and says so") {
  scratch_dir dir("cli_generate_positions");
  const std::string ck = write_model(dir);
  std::string prompt;
  for (int i = 0; i < 28; ++i) prompt += " word";
  auto r = run_troupe(dir.path, {"generate", ck, "--prompt", prompt, "--temperature", "0",
                                 "--max-new-tokens", "10", "--ignore-eos"}, 60s);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.err, "prompt 1 stopped after 4 new tokens at the model's 32 positions"));
  CHECK(r.out.rfind(prompt, 0) == 0);
}

TEST_CASE("generate reads tokenizer.json vocabularies: a LLaMA model with the LLaMA-2 and -3 files") {
  struct vocabulary {
    const char* dir;
    int size;
  };
  int tried = 0;
  for (const vocabulary v : {vocabulary{"/data/llama2", 32000}, vocabulary{"/data/llama3", 128256}}) {
    const std::string tok = std::string(TROUPE_SOURCE_DIR) + v.dir;
    if (!std::filesystem::exists(tok + "/tokenizer.json")) {
      MESSAGE("skipped: no " << tok << "/tokenizer.json (scripts/setup.sh makes it)");
      continue;
    }
    ++tried;
    CAPTURE(v.dir);
    scratch_dir dir("cli_generate_llama");
    const std::string ck = write_model(dir, troupe::core::arch_kind::llama, v.size, tok);
    auto run = [&](std::vector<std::string> prompts) {
      std::vector<std::string> args = {"generate", ck, "--temperature", "0", "--max-new-tokens", "8"};
      for (auto& p : prompts) args.insert(args.end(), {"--prompt", p});
      return run_troupe(dir.path, args, 60s);
    };
    auto batch = run({"Hello world", "日本語のテキスト"});
    REQUIRE_MESSAGE(batch.code == 0, batch.err);
    auto a = run({"Hello world"}), b = run({"日本語のテキスト"});
    CHECK(batch.out == a.out + b.out);
    CHECK(a.out.rfind("Hello world", 0) == 0);
    CHECK(a.out.size() > std::string("Hello world\n").size());
    CHECK(whole_utf8(batch.out));
  }
  if (tried == 0) MESSAGE("no LLaMA tokenizer files: nothing checked");
}

TEST_CASE("generate continues from a Hugging Face directory exactly as from the checkpoint it was exported from") {
  for (auto arch : {troupe::core::arch_kind::gpt2, troupe::core::arch_kind::llama}) {
    CAPTURE(static_cast<int>(arch));
    scratch_dir dir("cli_generate_hf");
    const std::string ck = write_model(dir, arch);
    auto exported = run_troupe(dir.path, {"export", ck, "--out", dir / "hf"}, 120s);
    REQUIRE_MESSAGE(exported.code == 0, exported.err);
    const std::vector<std::string> rest = {"--prompt", "Hello", "--prompt", "The sea was",
                                           "--temperature", "0", "--max-new-tokens", "8",
                                           "--tokenizer", kVocab};
    std::vector<std::string> from_ck = {"generate", ck}, from_hf = {"generate", dir / "hf"};
    from_ck.insert(from_ck.end(), rest.begin(), rest.end());
    from_hf.insert(from_hf.end(), rest.begin(), rest.end());
    auto a = run_troupe(dir.path, from_ck, 60s), b = run_troupe(dir.path, from_hf, 60s);
    REQUIRE_MESSAGE(a.code == 0, a.err);
    REQUIRE_MESSAGE(b.code == 0, b.err);
    CHECK(b.out == a.out);
    CHECK(a.out.size() > std::string("Hello\nThe sea was\n").size());
  }
  // A directory without a tokenizer troupe reads is refused with a hint when none is given.
  scratch_dir dir("cli_generate_hf_tok");
  const std::string ck = write_model(dir);
  REQUIRE(run_troupe(dir.path, {"export", ck, "--out", dir / "hf"}, 120s).code == 0);
  for (const char* f : {"tokenizer.json", "encoder.json", "vocab.bpe"})
    std::filesystem::remove(dir.path / "hf" / f);
  auto r = run_troupe(dir.path, {"generate", dir / "hf", "--prompt", "Hi"}, 60s);
  CHECK(r.code == 1);
  CHECK(contains(r.err, "pass one with --tokenizer"));
}
