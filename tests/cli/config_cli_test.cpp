// `troupe config check`, run as the built binary: valid configs exit 0 and print the resolved keys
// and derived values (as text and as JSON); bad files, bad overrides and missing data exit 1 with
// the error on stderr.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/shards.hpp"

#include "tests/cli/cli_harness.hpp"

namespace fs = std::filesystem;
using namespace troupe::cli_test;

namespace {

const std::string tiny = TROUPE_SOURCE_DIR "/configs/tiny.toml";

// A fresh folder to run in, so relative data paths resolve against a known directory.
struct work_dir {
  fs::path path;
  explicit work_dir(const std::string& name) {
    path = fs::temp_directory_path() / ("troupe_configcli_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~work_dir() { fs::remove_all(path); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name) << text;
    return (path / name).string();
  }
};

// Runs `troupe config check ARGS` (already shell-quoted) inside `dir`.
run_result config_check(const work_dir& dir, const std::string& args) {
  return run_troupe(dir.path, "config check " + args);
}

}  // namespace

TEST_CASE("config check --json prints the resolved config and the derived values of tiny.toml") {
  work_dir dir("json");
  const run_result r = config_check(dir, "'" + tiny + "' --json --no-file-check");
  CHECK(r.code == 0);
  CHECK(r.err.empty());
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["valid"] == true);
  CHECK(j["config"]["model"]["arch"] == "gpt2");
  CHECK(j["config"]["model"]["num_layers"] == 4);
  CHECK(j["config"]["model"]["tie_embeddings"] == true);
  CHECK(j["config"]["optimizer"]["lr"] == 0.003);
  CHECK(j["config"]["data"]["train"] == "data/tokens/train.bin");
  CHECK(j["derived"]["global_batch"] == 32);
  CHECK(j["derived"]["tokens_per_step"] == 2048);
  CHECK(j["derived"]["workers"] == 4);
  CHECK(j["derived"]["layers_per_stage"] == 2);
  CHECK(j["derived"]["parameters"] == 7234432);
}

TEST_CASE("config check prints a readable summary with defaults and overrides marked") {
  work_dir dir("text");
  const run_result r = config_check(
      dir, "--set parallel.pipeline_stage=4 '" + tiny + "' --no-file-check --set train.steps=7");
  CHECK(r.code == 0);
  CHECK(contains(r.out, "valid"));
  CHECK(contains(r.out, "[parallel]"));
  CHECK(contains(r.out, "pipeline_stage              = 4"));
  CHECK(contains(r.out, "# --set"));
  CHECK(contains(r.out, "# default"));
  CHECK(contains(r.out, "layers_per_stage  = 1"));
  CHECK(contains(r.out, "workers           = 8"));
  CHECK(contains(r.out, "7,234,432"));
}

TEST_CASE("config check finds the data files relative to the current directory") {
  work_dir dir("files");
  const run_result missing = config_check(dir, "'" + tiny + "'");
  CHECK(missing.code == 1);
  CHECK(contains(missing.err, "troupe: error: " + tiny + ":"));
  CHECK(contains(missing.err, "data.train: training data 'data/tokens/train.bin' does not exist"));
  CHECK(contains(missing.err, dir.path.string()));  // the hint names the current directory

  fs::create_directories(dir.path / "data/tokens");
  fs::create_directories(dir.path / "data/gpt2");
  for (const char* f : {"data/gpt2/encoder.json", "data/gpt2/vocab.bpe"}) dir.write(f, "x");
  // config check opens the shards as train does: they must be token shards long enough for a
  // global batch (32 sequences of 64 tokens) and an evaluation (4 x 4 sequences).
  const std::vector<std::uint16_t> tokens(2000, 7);
  REQUIRE(troupe::model::write_shard((dir.path / "data/tokens/train.bin").string(), tokens).ok());
  REQUIRE(troupe::model::write_shard((dir.path / "data/tokens/val.bin").string(), tokens).ok());
  const run_result found = config_check(dir, "'" + tiny + "'");
  CHECK_MESSAGE(found.code == 0, found.err);
  dir.write("data/tokens/val.bin", "x");
  const run_result bad = config_check(dir, "'" + tiny + "'");
  CHECK(bad.code == 1);
  CHECK(contains(bad.err, "data/tokens/val.bin"));
}

TEST_CASE("config check rejects a bad file with its location and a hint") {
  work_dir dir("bad");
  const std::string path = dir.write("bad.toml", "[model]\nnum_layer = 4\n");
  const run_result r = config_check(dir, "'" + path + "' --no-file-check");
  CHECK(r.code == 1);
  CHECK(r.out.empty());
  CHECK(contains(r.err, "troupe: error: " + path +
                            ":2:1: model.num_layer: unknown key 'model.num_layer'; did you mean "
                            "'model.num_layers'?"));
  CHECK(contains(r.err, "hint:"));

  const std::string syntax = dir.write("syntax.toml", "[model\nnum_layers = 4\n");
  const run_result s = config_check(dir, "'" + syntax + "' --no-file-check");
  CHECK(s.code == 1);
  CHECK(contains(s.err, syntax + ":1:"));
  CHECK(contains(s.err, "TOML syntax error"));

  const std::string heads = dir.write("heads.toml", "[model]\nhidden_size = 130\nnum_heads = 4\n");
  const run_result h = config_check(dir, "'" + heads + "' --no-file-check");
  CHECK(h.code == 1);
  CHECK(contains(h.err, heads + ":2:15: model.hidden_size: hidden_size 130 is not divisible by num_heads 4"));
}

TEST_CASE("config check --json reports an error as JSON and exits 1") {
  work_dir dir("jsonerr");
  const run_result r = config_check(dir, "'" + tiny + "' --json --no-file-check --set parallel.pipeline_stage=3");
  CHECK(r.code == 1);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["valid"] == false);
  CHECK(j["error"]["key"] == "model.num_layers");
  CHECK(j["error"]["file"] == tiny);
  CHECK(j["error"]["line"].get<int>() > 0);
  CHECK(contains(j["error"]["message"].get<std::string>(), "pipeline_stage 3"));
  CHECK(contains(r.err, "troupe: error:"));
}

TEST_CASE("config check names a bad override") {
  work_dir dir("set");
  const run_result r = config_check(dir, "'" + tiny + "' --no-file-check --set optimizer.zero_stage=three");
  CHECK(r.code == 1);
  CHECK(contains(r.err, "--set optimizer.zero_stage=three: optimizer.zero_stage: expected an "
                        "integer, got a string \"three\""));
  const run_result m = config_check(dir, "missing.toml");
  CHECK(m.code == 1);
  CHECK(contains(m.err, "missing.toml: cannot open the config file"));
}

TEST_CASE("config check reads [lora], prints the trainable parameters and names a bad target") {
  work_dir dir("lora");
  const std::string good = dir.write("lora.toml", "[lora]\nrank = 8\n");
  const run_result r = config_check(dir, "'" + good + "' --json --no-file-check");
  CHECK(r.code == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["config"]["lora"]["rank"] == 8);
  CHECK(j["config"]["lora"]["targets"] == "c_attn");
  CHECK(j["config"]["lora"]["alpha"] == 8.0);
  // 4 layers of c_attn adapters: A [8, 128] and B [384, 8].
  CHECK(j["derived"]["trainable_parameters"] == 4 * (8 * 128 + 384 * 8));
  const std::string bad = dir.write("bad.toml", "[lora]\nrank = 8\ntargets = [\"c_atn\"]\n");
  const run_result b = config_check(dir, "'" + bad + "' --no-file-check");
  CHECK(b.code == 1);
  CHECK(contains(b.err, bad + ":3:11: lora.targets: 'c_atn' is not a gpt2 module; did you mean 'c_attn'?"));
  CHECK(contains(b.err, "hint: lora.targets names one of: c_attn, c_proj"));
}

TEST_CASE("config check shows an uneven split and refuses a bad one naming the key and line") {
  work_dir dir("stages");
  const run_result ok = config_check(
      dir, "'" + tiny + "' --no-file-check --set model.num_layers=5 --set parallel.stage_layers=[1,4]");
  CHECK_MESSAGE(ok.code == 0, ok.err);
  CHECK(contains(ok.out, "stage_layers                = \"1,4\""));
  CHECK(contains(ok.out, "layers_per_stage  = 4"));
  CHECK(contains(ok.out, "the largest of [1, 4] per pipeline rank"));
  const run_result j = config_check(
      dir, "'" + tiny + "' --json --no-file-check --set model.num_layers=5 --set parallel.stage_layers=[1,4]");
  REQUIRE(j.code == 0);
  const auto json = nlohmann::json::parse(j.out);
  CHECK(json["derived"]["stage_layers"] == nlohmann::json::array({1, 4}));
  CHECK(json["derived"]["layers_per_stage"] == 4);

  const std::string bad = dir.write("bad.toml",
                                    "[model]\nnum_layers = 16\n[parallel]\npipeline_stage = 4\n"
                                    "stage_layers = [3, 5, 5, 2]\n[recompute]\nmode = \"full\"\n");
  const run_result sum = config_check(dir, "'" + bad + "' --no-file-check");
  CHECK(sum.code == 1);
  CHECK(contains(sum.err, "bad.toml:5:16: parallel.stage_layers: stage_layers [3, 5, 5, 2] sum to 15, "
                          "but model.num_layers is 16"));
  CHECK(contains(sum.err, "[3, 5, 5, 3]"));
  const run_result recompute = config_check(
      dir, "'" + bad + "' --no-file-check --set parallel.stage_layers=[4,4,4,4] --set recompute.layers=9");
  CHECK(recompute.code == 1);
  CHECK(contains(recompute.err, "recompute.layers 9 is more than the 4 layers of the largest model chunk"));
  CHECK(contains(recompute.err, "--set recompute.layers=9"));
}

TEST_CASE("config check sums each pipeline rank's chunks where the schedule places them (zb_v's V)") {
  work_dir dir("zbv");
  // 8 chunks on 4 ranks. Interleaved: rank r holds chunks r and r + 4; the V: r and 7 - r.
  const std::string split = "'" + tiny + "' --set model.num_layers=12 --set parallel.pipeline_stage=4 "
                            "--set parallel.micro_batch_num=8 --set parallel.virtual_pipeline=2 "
                            "--set parallel.stage_layers=[1,1,2,2,1,1,2,2] ";
  const run_result v = config_check(dir, split + "--set schedule.name=zb_v --no-file-check");
  CHECK_MESSAGE(v.code == 0, v.err);
  CHECK(contains(v.out, "layers_per_stage  = 3"));
  CHECK(contains(v.out, "the largest of [3, 3, 3, 3] per pipeline rank (uneven: chunks [1, 1, 2, 2, 1, 1, 2, 2]; "
                        "chunks in a V"));
  const run_result inter = config_check(dir, split + "--set schedule.name=interleaved_1f1b --no-file-check");
  CHECK_MESSAGE(inter.code == 0, inter.err);
  CHECK(contains(inter.out, "the largest of [2, 2, 4, 4] per pipeline rank"));
  const run_result j = config_check(dir, split + "--set schedule.name=zb_v --no-file-check --json");
  REQUIRE(j.code == 0);
  const auto json = nlohmann::json::parse(j.out);
  CHECK(json["derived"]["stage_layers"] == nlohmann::json::array({3, 3, 3, 3}));
  CHECK(json["derived"]["chunk_placement"] == "v");

  // A schedule file's `placement v` line is read when files are checked, and only then.
  const run_result w = run_troupe(dir.path, "schedule show -s zb_v -p 4 -m 8 -v 2 --write zbv.txt");
  REQUIRE_MESSAGE(w.code == 0, w.err);
  fs::create_directories(dir.path / "data/tokens");
  fs::create_directories(dir.path / "data/gpt2");
  for (const char* f : {"data/gpt2/encoder.json", "data/gpt2/vocab.bpe"}) dir.write(f, "x");
  const std::vector<std::uint16_t> tokens(20000, 7);
  REQUIRE(troupe::model::write_shard((dir.path / "data/tokens/train.bin").string(), tokens).ok());
  REQUIRE(troupe::model::write_shard((dir.path / "data/tokens/val.bin").string(), tokens).ok());
  const run_result file = config_check(dir, split + "--set schedule.file=zbv.txt");
  CHECK_MESSAGE(file.code == 0, file.err);
  CHECK(contains(file.out, "the largest of [3, 3, 3, 3] per pipeline rank"));
  const run_result unread = config_check(dir, split + "--set schedule.file=zbv.txt --no-file-check --json");
  REQUIRE(unread.code == 0);
  const auto uj = nlohmann::json::parse(unread.out);
  CHECK(uj["derived"]["chunk_placement"] == "unknown");
  CHECK(uj["derived"]["stage_layers"] == nlohmann::json::array({2, 2, 4, 4}));
}

TEST_CASE("tensor-parallel layouts: config check validates them and refuses what does not run yet by key") {
  work_dir dir("tp");
  const run_result split = config_check(
      dir, "'" + tiny + "' --no-file-check --set parallel.model_parallel=2 --set "
           "parallel.sequence_parallel=true");
  CHECK_MESSAGE(split.code == 0, split.err);
  CHECK(contains(split.out, "sequence_parallel           = true"));
  CHECK(contains(split.out, "workers           = 8"));
  const run_result three =
      config_check(dir, "'" + tiny + "' --no-file-check --set parallel.model_parallel=3");
  CHECK(three.code == 1);
  CHECK(contains(three.err, "parallel.model_parallel: model_parallel 3 does not divide num_heads 4"));
  CHECK(contains(three.err, "near 3: 2 or 4"));
  const run_result sp = config_check(dir, "'" + tiny + "' --no-file-check --set parallel.sequence_parallel=true");
  CHECK(sp.code == 1);
  CHECK(contains(sp.err, "parallel.sequence_parallel: sequence_parallel = true needs model_parallel > 1"));

  // What the runtime does not run yet (tensor parallel with bf16 compute) is refused by the check,
  // naming the key.
  const run_result bf16 = config_check(
      dir, "'" + tiny + "' --no-file-check --set parallel.model_parallel=2 --set runtime.device=cuda "
           "--set precision.compute=bf16");
  CHECK(bf16.code == 1);
  CHECK_MESSAGE(contains(bf16.err, "precision.compute: parallel.model_parallel = 2 sums its "
                                   "partial results in fp32 only"),
                bf16.err);
  CHECK(contains(bf16.err, "hint: set precision.compute = \"fp32\""));
}
