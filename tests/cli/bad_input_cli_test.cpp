// Hostile input at the command line, run as the built binary with a bound on every run: each
// case once crashed, hung or was silently accepted. Now each exits with the documented code (1 for
// bad input, 2 for a usage error) and a message naming the input, the place and a hint; valid
// input (a line of 100,000 dashes) works; a run stopped by SIGTERM leaves trace.json and
// metrics.jsonl valid JSON.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "kernels/select.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "tests/cli/troupe_process.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using troupe::model::testing::scratch_dir;
using troupe::testing::run_troupe;
using troupe::testing::start_troupe;

namespace {

const std::string kVocab = TROUPE_SOURCE_DIR "/data/gpt2";

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The tiny run config (shards written into `dir`), as a file, with `edit` applied.
template <class F>
std::string write_config(const scratch_dir& dir, F edit, const std::string& name = "job.toml") {
  auto cfg = troupe::model::testing::tiny_run(dir);
  cfg.train.eval_interval = 0;
  edit(cfg);
  std::ofstream(dir / name) << troupe::core::to_toml(cfg);
  return dir / name;
}
std::string write_config(const scratch_dir& dir) {
  return write_config(dir, [](troupe::core::config&) {});
}

std::string dotted(int parts) {
  std::string key = "a";
  for (int i = 1; i < parts; ++i) key += ".a";
  return key;
}

// A checkpoint of a one-layer GPT-2 over the real vocabulary (so that prompts encode), with
// `config_toml` as its saved config (empty: the model's own) and every weight of `poisoned`
// set to NaN.
std::string write_checkpoint(const scratch_dir& dir, const std::string& poisoned,
                             std::string config_toml = {}) {
  troupe::core::config cfg;
  cfg.model.num_layers = 1;
  cfg.model.hidden_size = 8;
  cfg.model.num_heads = 2;
  cfg.model.seq_length = 8;
  cfg.data.tokenizer_dir = kVocab;
  cfg.runtime.threads = 1;
  auto parsed = troupe::core::parse_config(troupe::core::to_toml(cfg), "ckpt");
  REQUIRE(parsed.ok());
  auto be = troupe::kernels::make_backend("cpu");
  troupe::model::chunk net(parsed->model, troupe::model::partition(parsed->model, 1)[0], *be);
  net.init(1);
  if (!poisoned.empty()) {
    auto t = net.param(poisoned);
    for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = std::nanf("");
  }
  troupe::model::checkpoint::save_request req;
  req.step = 1;
  req.config_toml = config_toml.empty() ? troupe::core::to_toml(parsed.value()) : config_toml;
  req.shards = {troupe::model::checkpoint::model_shard(*be, net)};
  auto saved = troupe::model::checkpoint::save(dir / "ckpt", req);
  REQUIRE_MESSAGE(saved.ok(), (saved.ok() ? "" : saved.err().to_string()));
  return saved.value();
}

}  // namespace

TEST_CASE("config check /dev/zero and a folder as CONFIG are refused at once, naming them") {
  scratch_dir dir("cli_bad_config");
  auto zero = run_troupe(dir.path, {"config", "check", "/dev/zero"}, 30s);
  CHECK(zero.code == 1);
  CHECK(contains(zero.err, "/dev/zero: is a character device"));
  CHECK(contains(zero.err, "hint:"));

  fs::create_directories(dir.path / "configs");
  auto folder = run_troupe(dir.path, {"train", "configs", "--set", "train.steps=1"}, 30s);
  CHECK(folder.code == 1);
  CHECK(contains(folder.err, "configs: is a directory, expected a config file"));
  CHECK_FALSE(fs::exists(dir.path / "runs"));
}

TEST_CASE("deeply nested TOML in a config, a --set value and a checkpoint's config exits 1") {
  scratch_dir dir("cli_deep_toml");
  std::ofstream(dir / "deep.toml") << "[model]\n" << dotted(50000) << " = 1\n";
  auto file = run_troupe(dir.path, {"config", "check", "deep.toml", "--no-file-check"}, 30s);
  CHECK(file.code == 1);
  CHECK(contains(file.err, "deep.toml:2:"));
  CHECK(contains(file.err, "levels deep"));

  std::ofstream(dir / "plain.toml") << "[train]\nsteps = 2\n";
  auto set = run_troupe(dir.path,
                        {"config", "check", "plain.toml", "--no-file-check", "--set",
                         std::string("train.steps=1\n[") + dotted(50000) + "]"},
                        30s);
  CHECK(set.code == 1);
  CHECK(contains(set.err, "--set train.steps=1"));
  CHECK(contains(set.err, "levels deep"));

  const std::string ck = write_checkpoint(dir, "", std::string("[") + dotted(100000) + "]\n");
  auto gen = run_troupe(dir.path, {"generate", ck, "--prompt", "Hi", "--tokens", "1"}, 30s);
  CHECK(gen.code == 1);
  CHECK(contains(gen.err, "manifest.json:1:"));
  CHECK(contains(gen.err, "levels deep"));
}

TEST_CASE("config check checks what train checks: schedule.file and data.train as devices or folders") {
  scratch_dir dir("cli_preflight");
  fs::create_directories(dir.path / "folder");
  struct bad {
    std::string set;
    std::string says;
  };
  const std::vector<bad> cases = {
      {"schedule.file=/dev/zero", "/dev/zero: schedule.file: is a character device"},
      {"schedule.file=" + (dir / "folder"), "schedule.file: is a directory, expected a schedule file"},
      {"data.train=/dev/zero", "/dev/zero: data.train: is a character device"},
      {"train.eval_batches=2147483647", "train.eval_batches: eval_batches 2147483647"},
  };
  const std::string cfg = write_config(dir, [&](troupe::core::config& c) { c.train.eval_interval = 3; });
  REQUIRE(run_troupe(dir.path, {"config", "check", cfg}, 30s).code == 0);
  for (const auto& c : cases) {
    CAPTURE(c.set);
    auto check = run_troupe(dir.path, {"config", "check", cfg, "--set", c.set}, 30s);
    CHECK(check.code == 1);
    CHECK(contains(check.err, c.says));
    CHECK(contains(check.err, "hint:"));
    auto train = run_troupe(dir.path, {"train", cfg, "--set", c.set}, 30s);
    CHECK(train.code == 1);
    CHECK(contains(train.err, c.says));
  }
}

TEST_CASE("a FIFO as the training shard fails the run at once instead of hanging in open()") {
  scratch_dir dir("cli_fifo");
  const std::string fifo = dir / "fifo.bin";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string cfg = write_config(dir);
  auto r = run_troupe(dir.path, {"train", cfg, "--set", "data.train=" + fifo}, 30s);
  REQUIRE_MESSAGE(r.code != -1, "train still waited on the FIFO after 30 s");
  CHECK(r.code == 1);
  CHECK(contains(r.err, fifo + ": data.train: is a FIFO"));
}

TEST_CASE("data_parallel 65536 is refused by train before any worker starts, naming the limit") {
  scratch_dir dir("cli_workers");
  // Enough data for a global batch of 65536 x 4 sequences, so that only the workers are too many.
  troupe::model::testing::write_pattern_shard(dir / "big.bin", 300000, 64, 3);
  const std::string cfg = write_config(dir, [&](troupe::core::config& c) { c.data.train = dir / "big.bin"; });
  auto r = run_troupe(dir.path, {"train", cfg, "--set", "parallel.data_parallel=65536"}, 30s);
  CHECK(r.code == 1);
  CHECK(contains(r.err, "65536 workers in this process"));
  CHECK(contains(r.err, "hint:"));
  CHECK_FALSE(fs::exists(dir.path / "run" / "messages"));
  // config check says the config is valid (launch may spread it over nodes) but warns.
  auto check = run_troupe(dir.path, {"config", "check", cfg, "--set", "parallel.data_parallel=65536"}, 30s);
  CHECK(check.code == 0);
  CHECK(contains(check.err, "warning: `troupe train` on this machine would refuse"));
}

TEST_CASE("launch --rdzv_timeout nan, 1e300 and 1e-300 exit 2 before starting a worker") {
  scratch_dir dir("cli_rdzv");
  const std::string cfg = write_config(dir);
  for (const char* v : {"nan", "1e300", "1e-300", "-inf"}) {
    CAPTURE(v);
    auto r = run_troupe(dir.path, {"launch", "--rdzv_timeout", v, "--master_port", "1", cfg}, 30s);
    CHECK(r.code == 2);
    CHECK(contains(r.err, "--rdzv_timeout"));
    CHECK_FALSE(fs::exists(dir.path / "run" / "logs"));
  }
}

TEST_CASE("generate refuses a NaN temperature, a negative or huge seed and 2^31 tokens with exit 2") {
  scratch_dir dir("cli_generate_args");
  const std::string ck = write_checkpoint(dir, "");
  struct bad {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<bad> cases = {
      {{"--temperature", "nan"}, "--temperature nan is not a number in 0.."},
      {{"--seed", "-1"}, "--seed '-1' is not a whole number in 0..18446744073709551615"},
      {{"--seed", "99999999999999999999999"}, "--seed '99999999999999999999999' is not a whole"},
      {{"--tokens", "2147483647"}, "--max-new-tokens 2147483647 is above the 1048576"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.says);
    std::vector<std::string> args = {"generate", ck, "--prompt", "Hi"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    auto r = run_troupe(dir.path, args, 30s);
    CHECK(r.code == 2);
    CHECK(contains(r.err, c.says));
    CHECK(contains(r.err, "hint:"));
    CHECK(r.out.empty());
  }
  auto ok = run_troupe(dir.path, {"generate", ck, "--prompt", "Hi", "--tokens", "3", "--seed", "18446744073709551615"}, 60s);
  CHECK(ok.code == 0);
  CHECK(contains(ok.out, "Hi"));
}

TEST_CASE("generate refuses a checkpoint whose weights are NaN, naming the tensor") {
  scratch_dir dir("cli_generate_nan");
  const std::string ck = write_checkpoint(dir, "h.0.mlp.c_fc.weight");
  auto r = run_troupe(dir.path, {"generate", ck, "--prompt", "Hi", "--tokens", "2"}, 60s);
  CHECK(r.code == 1);
  CHECK(contains(r.err, "tensor 'h.0.mlp.c_fc.weight'"));
  CHECK(contains(r.err, "NaN or infinite"));
  CHECK(contains(r.err, "hint:"));
}

TEST_CASE("data prepare refuses an empty and a one-character file, and tokenizes 100,000 dashes") {
  scratch_dir dir("cli_prepare");
  std::ofstream(dir / "empty.txt");
  std::ofstream(dir / "one.txt") << "x";
  std::ofstream(dir / "dashes.txt") << "Before.\n" << std::string(100000, '-') << "\nAfter.\n";
  auto prepare = [&](const std::string& input) {
    return run_troupe(dir.path,
                      {"data", "prepare", "--input", dir / input, "--out", dir / ("out_" + input),
                       "--tokenizer", kVocab},
                      60s);
  };
  auto empty = prepare("empty.txt");
  CHECK(empty.code == 1);
  CHECK(contains(empty.err, "empty.txt: the text file is empty"));
  auto one = prepare("one.txt");
  CHECK(one.code == 1);
  CHECK(contains(one.err, "one.txt: the input holds 1 token of text"));
  CHECK_FALSE(fs::exists(dir.path / "out_one.txt" / "train.bin"));
  auto dashes = prepare("dashes.txt");
  CHECK_MESSAGE(dashes.code == 0, dashes.err);
  CHECK(fs::exists(dir.path / "out_dashes.txt" / "train.bin"));
}

TEST_CASE("a run stopped by SIGTERM leaves trace.json and metrics.jsonl valid JSON") {
  scratch_dir dir("cli_sigterm");
  const std::string cfg = write_config(dir, [](troupe::core::config& c) {
    c.train.steps = 100000;
    c.parallel.pipeline_stage = 2;
    c.runtime.record = false;
  });
  auto p = start_troupe(dir.path, "train", {"train", cfg});
  const fs::path metrics = dir.path / "run" / "metrics.jsonl";
  const auto until = std::chrono::steady_clock::now() + 60s;
  auto lines = [&] {
    std::istringstream in(troupe::testing::read_file(metrics));
    int n = 0;
    for (std::string l; std::getline(in, l);) ++n;
    return n;
  };
  while (lines() < 3 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);
  REQUIRE_MESSAGE(lines() >= 3, p->stderr_text());
  ::kill(p->pid, SIGTERM);
  REQUIRE(p->wait(30s).has_value());
  CHECK(*p->code == 128 + SIGTERM);

  const auto trace = nlohmann::json::parse(troupe::testing::read_file(dir.path / "run" / "trace.json"));
  CHECK_FALSE(trace["traceEvents"].empty());
  const std::string text = troupe::testing::read_file(metrics);
  REQUIRE_FALSE(text.empty());
  CHECK(text.back() == '\n');
  std::istringstream in(text);
  int step = 0;
  for (std::string line; std::getline(in, line); ++step)
    CHECK(nlohmann::json::parse(line)["step"] == step);
  CHECK(step >= 3);
}

TEST_CASE("2^20 micro-batches of a small shard are refused before a step that would never end") {
  scratch_dir dir("cli_microbatches");
  const std::string cfg = write_config(dir);
  auto r = run_troupe(dir.path, {"train", cfg, "--set", "parallel.micro_batch_num=1048576"}, 60s);
  CHECK(r.code == 1);
  CHECK(contains(r.err, "parallel.micro_batch_num: a step's global batch of 2097152 sequences"));
  CHECK(contains(r.err, "hint:"));
}
