// `troupe plan` and the plan check of `troupe train` / `troupe launch`, run as the built binary on
// a tiny GPT-2: the plan as JSON, the fit verdict and its exit code, the refusal before anything is
// allocated (no run directory output), the suggestion that fits, the override, the search, and
// bad sizes.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <set>
#include <string>
#include <tuple>

#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;

namespace {

using troupe::model::testing::scratch_dir;

const std::string troupe_binary = TROUPE_BINARY_DIR "/troupe";

struct run_result {
  int code;
  std::string out;
  std::string err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

run_result run_troupe(const scratch_dir& dir, const std::string& args) {
  REQUIRE_MESSAGE(fs::exists(troupe_binary), ("build the troupe target first: " + troupe_binary));
  const auto out = dir.path / "stdout.txt", err = dir.path / "stderr.txt";
  const std::string cmd = "cd '" + dir.path.string() + "' && '" + troupe_binary + "' " + args +
                          " >'" + out.string() + "' 2>'" + err.string() + "'";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

/// A 4-layer tiny GPT-2, pipeline 2 × data 2, written as a config file with its data.
std::string write_config(const scratch_dir& dir) {
  troupe::core::config c = troupe::model::testing::tiny_run(dir);
  c.model.num_layers = 4;
  c.parallel.pipeline_stage = 2;
  c.parallel.data_parallel = 2;
  c.parallel.micro_batch_num = 4;
  c.train.steps = 1;
  c.train.eval_interval = 0;
  c.data.val.clear();
  c.runtime.record = false;
  std::ofstream(dir / "job.toml") << troupe::core::to_toml(c);
  return dir / "job.toml";
}

nlohmann::json plan_json(const scratch_dir& dir, const std::string& cfg, const std::string& sets = "") {
  run_result r = run_troupe(dir, "plan '" + cfg + "' --json " + sets);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  return nlohmann::json::parse(r.out);
}

}  // namespace

TEST_CASE("troupe plan prints every rank's peaks and terms and exits 0 when the memory is unknown") {
  scratch_dir dir("plan_cli_json");
  const std::string cfg = write_config(dir);
  const nlohmann::json p = plan_json(dir, cfg);
  CHECK(p["data_parallel"] == 2);
  CHECK(p["pipeline_stage"] == 2);
  REQUIRE(p["ranks"].size() == 4);
  for (const auto& r : p["ranks"]) {
    CHECK(r["stage_peak_bytes"].get<std::uint64_t>() > 0);
    CHECK(r["optimizer_peak_bytes"].get<std::uint64_t>() > 0);
    CHECK(r["terms"].contains("fp32 parameters"));
    CHECK(r["peak_in_flight"].get<int>() >= 1);
  }
  // troupe train puts every worker on one device: the need is the sum of the ranks.
  std::uint64_t sum = 0;
  for (const auto& r : p["ranks"]) sum += r["total_bytes"].get<std::uint64_t>();
  CHECK(p["need_bytes"].get<std::uint64_t>() == sum);
  CHECK(p["fits"] == true);
  CHECK(p["step_s"].get<double>() > 0);
  CHECK_FALSE(p["largest_term"].get<std::string>().empty());
}

TEST_CASE("a layout that cannot fit is refused before allocation, with the plan and a change that fits") {
  scratch_dir dir("plan_cli_refuse");
  const std::string cfg = write_config(dir);
  const std::uint64_t none = plan_json(dir, cfg)["need_bytes"];
  const std::uint64_t full = plan_json(dir, cfg, "--set recompute.mode=full")["need_bytes"];
  REQUIRE(full < none);
  const std::string between = std::to_string((none + full) / 2);

  run_result p = run_troupe(dir, "plan '" + cfg + "' --device-memory " + between);
  CHECK(p.code == 3);
  CHECK(contains(p.out, "DOES NOT FIT"));
  CHECK(contains(p.out, "would fit: --set recompute.mode=full"));

  run_result t = run_troupe(dir, "train '" + cfg + "' --device-memory " + between);
  CHECK(t.code == 3);
  CHECK(contains(t.err, "nothing was allocated"));
  CHECK(contains(t.err, "hint:"));
  CHECK(contains(t.err, "--no-plan-check"));
  CHECK(contains(t.err, "plan: dp 2 × pp 2"));
  CHECK_FALSE(fs::exists(dir / "run/metrics.jsonl"));

  run_result l = run_troupe(dir, "launch --worker_num 4 --local_worker_num 4 '" + cfg +
                                 "' --device-memory 1KiB");
  CHECK(l.code == 3);
  CHECK(contains(l.err, "nothing was allocated"));

  // Following the suggestion, or overriding the check, trains.
  run_result ok = run_troupe(dir, "train '" + cfg + "' --device-memory " + between +
                                  " --set recompute.mode=full");
  CHECK_MESSAGE(ok.code == 0, ok.err);
  CHECK(fs::exists(dir / "run/metrics.jsonl"));
  fs::remove_all(dir.path / "run");
  run_result forced = run_troupe(dir, "train '" + cfg + "' --device-memory 1KiB --no-plan-check");
  CHECK_MESSAGE(forced.code == 0, forced.err);
}

TEST_CASE("troupe plan --search lists layouts that fit, fastest first, and counts the rejected") {
  scratch_dir dir("plan_cli_search");
  const std::string cfg = write_config(dir);
  run_result r = run_troupe(dir, "plan '" + cfg + "' --search --gpus 4 --device-memory 2GiB");
  CHECK_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, "1. dp "));
  CHECK(contains(r.out, "rejected:"));
  run_result none = run_troupe(dir, "plan '" + cfg + "' --search --gpus 4 --device-memory 1KiB");
  CHECK(none.code == 3);
  CHECK(contains(none.out, "no layout fits"));
}

TEST_CASE("bad memory sizes and a missing --gpus are errors that say what to write") {
  scratch_dir dir("plan_cli_bad");
  const std::string cfg = write_config(dir);
  run_result r = run_troupe(dir, "plan '" + cfg + "' --device-memory lots");
  CHECK(r.code == 2);
  CHECK(contains(r.err, "'lots' is not a memory size"));
  CHECK(contains(r.err, "80GiB"));
  run_result t = run_troupe(dir, "train '" + cfg + "' --device-memory 12XB");
  CHECK(t.code == 1);
  CHECK(contains(t.err, "not a memory size"));
  run_result s = run_troupe(dir, "plan '" + cfg + "' --search --device-memory 80GiB");
  CHECK(s.code == 2);
  CHECK(contains(s.err, "--gpus"));
}

TEST_CASE("troupe plan with optimizer.offload moves master weights and moments to host memory") {
  scratch_dir dir("plan_cli_offload");
  const std::string cfg = write_config(dir);
  const nlohmann::json off = plan_json(dir, cfg, "--set optimizer.zero_stage=1");
  const nlohmann::json on =
      plan_json(dir, cfg, "--set optimizer.zero_stage=1 --set optimizer.offload=true");
  CHECK(on["offload"] == true);
  CHECK(off["host_bytes"] == 0);
  REQUIRE(on["ranks"].size() == off["ranks"].size());
  std::uint64_t host = 0;
  for (std::size_t i = 0; i < on["ranks"].size(); ++i) {
    INFO("rank ", i);
    const auto& a = off["ranks"][i];
    const auto& b = on["ranks"][i];
    const std::uint64_t master = a["terms"]["fp32 master weights"], moments = a["terms"]["AdamW moments"];
    REQUIRE(master > 0);
    // The device loses exactly the master slice and the moments; the summed-gradient slice stays.
    CHECK(b["optimizer_peak_bytes"].get<std::uint64_t>() + master + moments ==
          a["optimizer_peak_bytes"].get<std::uint64_t>());
    CHECK_FALSE(b["terms"].contains("fp32 master weights"));
    CHECK_FALSE(b["terms"].contains("AdamW moments"));
    CHECK(b["terms"]["reduced gradient slice"] == a["terms"]["reduced gradient slice"]);
    CHECK(b["stage_peak_bytes"] == a["stage_peak_bytes"]);
    // Host: master and moments, and one staging buffer (this slice is one piece).
    CHECK(b["host_bytes"].get<std::uint64_t>() == master + moments + master);
    host += b["host_bytes"].get<std::uint64_t>();
  }
  CHECK(on["host_bytes"].get<std::uint64_t>() == host);
  CHECK(on["need_bytes"].get<std::uint64_t>() < off["need_bytes"].get<std::uint64_t>());
  CHECK(on["optimizer_s"].get<double>() > 0);
  run_result text = run_troupe(dir, "plan '" + cfg + "' --set optimizer.offload=true");
  CHECK(text.code == 0);
  CHECK(contains(text.out, "host memory (optimizer.offload"));
}

TEST_CASE("troupe train with optimizer.offload gives the checkpoint and losses of the run without") {
  scratch_dir dir("plan_cli_offload_train");
  const std::string cfg = write_config(dir);
  const std::string common = " --set train.steps=3 --set optimizer.zero_stage=2";
  run_result off = run_troupe(dir, "train '" + cfg + "'" + common + " --set runtime.run_dir=off");
  REQUIRE_MESSAGE(off.code == 0, off.err);
  run_result on = run_troupe(dir, "train '" + cfg + "'" + common +
                                      " --set runtime.run_dir=on --set optimizer.offload=true");
  REQUIRE_MESSAGE(on.code == 0, on.err);
  fs::path a;  // the final checkpoint
  for (auto& e : fs::directory_iterator(dir.path / "off/checkpoints"))
    if (e.path().filename().string().rfind("step_", 0) == 0 && e.path().filename() > a.filename())
      a = e.path();
  REQUIRE_FALSE(a.empty());
  const fs::path b = dir.path / "on/checkpoints" / a.filename();
  REQUIRE(fs::exists(b));
  int files = 0;
  for (auto& e : fs::directory_iterator(a)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    CHECK_MESSAGE(slurp(e.path()) == slurp(b / e.path().filename()), e.path().filename().string());
  }
  CHECK(files > 0);
  auto losses = [](const fs::path& m) {
    std::string out;
    std::istringstream in(slurp(m));
    for (std::string line; std::getline(in, line);) out += nlohmann::json::parse(line).at("loss").dump() + " ";
    return out;
  };
  const std::string la = losses(dir.path / "off/metrics.jsonl");
  CHECK(la.size() > 3);
  CHECK(la == losses(dir.path / "on/metrics.jsonl"));
  run_result single = run_troupe(dir, "train '" + cfg + "' --single-rank --set optimizer.offload=true");
  CHECK(single.code != 0);
  CHECK(contains(single.err, "optimizer.offload"));
}

TEST_CASE("troupe plan with model_parallel names every (dp, tp, pp) rank, as text and as JSON") {
  scratch_dir dir("plan_cli_tp");
  const std::string cfg = write_config(dir);
  const nlohmann::json one = plan_json(dir, cfg);
  const nlohmann::json p = plan_json(dir, cfg, "--set parallel.model_parallel=2 --set parallel.sequence_parallel=true");
  CHECK(p["model_parallel"] == 2);
  CHECK(p["sequence_parallel"] == true);
  REQUIRE(p["ranks"].size() == 8);  // dp 2 × tp 2 × pp 2
  std::set<std::tuple<int, int, int>> seen;
  for (const auto& r : p["ranks"]) seen.insert({r["dp"].get<int>(), r["tp"].get<int>(), r["pp"].get<int>()});
  CHECK(seen.size() == 8);
  // A rank holds its shard: fewer parameters than at model_parallel 1 (tests/plan/memory_test.cpp
  // checks how many fewer).
  const auto params = [](const nlohmann::json& j) {
    return j["ranks"][0]["terms"]["fp32 parameters"].get<double>();
  };
  CHECK(params(p) < params(one));
  const run_result text = run_troupe(dir, "plan '" + cfg + "' --set parallel.model_parallel=2");
  REQUIRE_MESSAGE(text.code == 0, text.err);
  CHECK(contains(text.out, "dp 2 × tp 2 × pp 2"));
  for (const char* name : {"dp0/tp0/pp0", "dp0/tp1/pp1", "dp1/tp1/pp0"}) {
    INFO(name);
    CHECK(contains(text.out, name));
  }
  // A model_parallel the model cannot split is refused naming the key.
  const run_result bad = run_troupe(dir, "plan '" + cfg + "' --set parallel.model_parallel=3");
  CHECK(bad.code != 0);
  CHECK(contains(bad.err, "parallel.model_parallel"));
}
