// Both training loops — the actor runtime (`troupe train`) and the single-rank loop
// (`troupe train --single-rank`) — follow one run policy (model/run_policy.hpp). Each case runs
// both and expects the same behaviour: progress lines at train.log_interval, a config.toml or
// metrics.jsonl that cannot be written stops the run, a checkpoint of another model is refused,
// and a token id outside the vocabulary in the validation shard stops the run naming the shard.
#include <doctest/doctest.h>

#include <filesystem>
#include <functional>

#include "model/shards.hpp"
#include "runtime/runtime.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
namespace fs = std::filesystem;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using loop = std::function<core::result<model::train_summary>(
    const core::config&, std::FILE*, const std::string& resume, int max_steps,
    std::vector<model::run_log::step_hook> hooks)>;

// The two loops, named for the messages of failed checks.
std::vector<std::pair<std::string, loop>> loops() {
  return {
      {"actors",
       [](const core::config& cfg, std::FILE* log, const std::string& resume, int max_steps,
          std::vector<model::run_log::step_hook> hooks) {
         actors::run_options opt;
         opt.log = log;
         opt.resume = resume;
         opt.max_steps = max_steps;
         opt.step_hooks = std::move(hooks);
         return actors::run_actor_job(cfg, opt);
       }},
      {"single-rank",
       [](const core::config& cfg, std::FILE* log, const std::string& resume, int max_steps,
          std::vector<model::run_log::step_hook> hooks) {
         model::train_options opt;
         opt.log = log;
         opt.resume = resume;
         opt.max_steps = max_steps;
         opt.step_hooks = std::move(hooks);
         return model::train_single_rank(cfg, opt);
       }},
  };
}

core::config two_stage_run(const scratch_dir& tmp, const std::string& name) {
  auto cfg = model::testing::tiny_run(tmp);
  cfg.parallel.pipeline_stage = 2;
  cfg.runtime.run_dir = tmp / name;
  return cfg;
}

}  // namespace

TEST_CASE("both loops print progress lines every train.log_interval steps, after evaluations and at the end") {
  scratch_dir tmp("policy_rt_log");
  for (auto& entry : loops()) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    auto& run = entry.second;
    CAPTURE(name);
    auto cfg = two_stage_run(tmp, name);
    cfg.train.steps = 6;
    cfg.train.log_interval = 4;
    cfg.train.eval_interval = 0;  // validation only after the last step
    const std::string log_path = tmp / (name + ".log");
    std::FILE* log = std::fopen(log_path.c_str(), "w");
    REQUIRE(log);
    auto r = run(cfg, log, "", -1, {});
    std::fclose(log);
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
    const auto text = model::testing::file_bytes(log_path);
    for (int s = 1; s <= 6; ++s) {
      CAPTURE(s);
      CHECK(has(text, "step " + std::to_string(s) + "/6 |") == (s == 4 || s == 6));
    }
    // metrics.jsonl still holds every step.
    const auto metrics = model::testing::file_bytes(cfg.runtime.run_dir + "/metrics.jsonl");
    CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 6);
  }
}

TEST_CASE("both loops stop when config.toml or metrics.jsonl cannot be written") {
  scratch_dir tmp("policy_rt_files");
  for (auto& entry : loops()) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    auto& run = entry.second;
    CAPTURE(name);
    auto cfg = two_stage_run(tmp, name + "_config");
    fs::create_directories(cfg.runtime.run_dir + "/config.toml");
    auto r = run(cfg, nullptr, "", -1, {});
    REQUIRE_FALSE(r.ok());
    CHECK(has(r.err().to_string(), "config.toml"));

    cfg = two_stage_run(tmp, name + "_metrics");
    fs::create_directories(cfg.runtime.run_dir);
    fs::create_symlink("/dev/full", cfg.runtime.run_dir + "/metrics.jsonl");
    r = run(cfg, nullptr, "", -1, {});
    REQUIRE_FALSE(r.ok());
    CHECK(has(r.err().to_string(), "metrics.jsonl"));
    CHECK(has(r.err().to_string(), "write failed"));
  }
}

TEST_CASE("both loops refuse to resume from a checkpoint of another model") {
  scratch_dir tmp("policy_rt_resume");
  for (auto& entry : loops()) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    auto& run = entry.second;
    CAPTURE(name);
    auto cfg = two_stage_run(tmp, name);
    REQUIRE(run(cfg, nullptr, "", 2, {}).ok());
    auto other = cfg;
    other.model.num_layers = 4;
    auto r = run(other, nullptr, cfg.runtime.run_dir, -1, {});
    REQUIRE_FALSE(r.ok());
    CHECK(has(r.err().to_string(), "the checkpoint holds a different model than the config"));
    CHECK(has(r.err().to_string(), "manifest.json"));
  }
}

TEST_CASE("a token id outside the vocabulary in the validation shard stops both loops naming the shard and the token") {
  scratch_dir tmp("policy_rt_val");
  const std::string bad = tmp / "val_bad.bin";
  REQUIRE(model::write_shard(bad, std::vector<std::uint16_t>(4000, 99)).ok());
  for (auto& entry : loops()) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    auto& run = entry.second;
    CAPTURE(name);
    auto cfg = two_stage_run(tmp, name);
    cfg.data.val = bad;
    auto r = run(cfg, nullptr, "", -1, {});
    REQUIRE_FALSE(r.ok());
    const auto m = r.err().to_string();
    CAPTURE(m);
    CHECK(has(m, "evaluation"));
    CHECK(has(m, "token id 99"));
    CHECK(has(m, bad));
    CHECK(has(m, "model.vocab_size 64"));
  }
}

TEST_CASE("both loops run the step-end hooks after every step's metrics line, and a failing hook stops the run") {
  scratch_dir tmp("policy_rt_hooks");
  for (auto& entry : loops()) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    auto& run = entry.second;
    CAPTURE(name);
    auto cfg = two_stage_run(tmp, name);
    cfg.train.steps = 3;
    std::vector<int> seen;
    std::vector<std::size_t> lines;  // metrics.jsonl lines when the hook ran
    const std::string metrics = cfg.runtime.run_dir + "/metrics.jsonl";
    auto r = run(cfg, nullptr, "", -1, {[&](const model::step_metrics& m) {
                   seen.push_back(m.step);
                   const auto text = model::testing::file_bytes(metrics);
                   lines.push_back(static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')));
                   return core::status{};
                 }});
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
    CHECK(seen == std::vector<int>{0, 1, 2});
    CHECK(lines == std::vector<std::size_t>{1, 2, 3});

    cfg.runtime.run_dir = tmp / (name + "_failing");
    r = run(cfg, nullptr, "", -1, {[](const model::step_metrics& m) -> core::status {
              if (m.step == 1) return core::error::make("the report of step 1 could not be written");
              return {};
            }});
    REQUIRE_FALSE(r.ok());
    CHECK(has(r.err().to_string(), "the report of step 1 could not be written"));
  }
}
