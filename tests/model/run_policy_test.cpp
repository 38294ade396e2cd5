// The run policy both training loops share (model/run_policy.hpp): the cadence of evaluation,
// checkpoints and progress lines, the run directory and config.toml, the metrics line with its
// step-end hooks, and resuming only into the same model.
#include "model/run_policy.hpp"

#include <doctest/doctest.h>

#include <filesystem>

#include "tests/model/trainer_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
namespace fs = std::filesystem;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A file the test reads back as the log.
struct log_file {
  std::string path;
  std::FILE* f;
  explicit log_file(const std::string& p) : path(p), f(std::fopen(p.c_str(), "w")) { REQUIRE(f); }
  ~log_file() {
    if (f) std::fclose(f);
  }
  std::string text() {
    std::fflush(f);
    return model::testing::file_bytes(path);
  }
};

model::step_outcome outcome(int step) {
  model::step_outcome o;
  o.step = step;
  o.loss = 4.0 + step;
  o.grad_norm = 0.5;
  o.lr = 1e-3;
  o.tokens = 64;
  o.seconds = 0.25;
  return o;
}

}  // namespace

TEST_CASE("cadence: evaluation, checkpoints and progress lines at their intervals and at the last step") {
  scratch_dir tmp("policy_cadence");
  auto cfg = model::testing::tiny_run(tmp);
  cfg.train.eval_interval = 3;
  cfg.checkpoint.interval = 4;
  cfg.train.log_interval = 5;
  std::vector<int> evals, ckpts, logs;
  for (int done = 1; done <= 10; ++done) {
    const auto c = model::cadence(cfg, done, 10, true);
    if (c.evaluate) evals.push_back(done);
    if (c.checkpoint) ckpts.push_back(done);
    if (c.log) logs.push_back(done);
  }
  CHECK(evals == std::vector<int>{3, 6, 9, 10});
  CHECK(ckpts == std::vector<int>{4, 8, 10});
  CHECK(logs == std::vector<int>{3, 5, 6, 9, 10});  // every 5th, and after each evaluation
  // Without validation data nothing is evaluated; an invocation cut short by --steps ends at 7.
  for (int done = 1; done <= 7; ++done) CHECK_FALSE(model::cadence(cfg, done, 7, false).evaluate);
  CHECK(model::cadence(cfg, 7, 7, false).checkpoint);
  CHECK(model::cadence(cfg, 7, 7, false).log);
}

TEST_CASE("open_run creates the run directory and config.toml, and a config.toml it cannot write is an error") {
  scratch_dir tmp("policy_open");
  auto cfg = model::testing::tiny_run(tmp);
  cfg.runtime.run_dir = tmp / "deep/run";
  auto r = model::open_run(cfg, "", 2, true, nullptr);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  CHECK(r->first_step == 0);
  CHECK(r->end_step == 2);
  CHECK(r->ckpt_root == (fs::path(cfg.runtime.run_dir) / "checkpoints").string());
  CHECK(model::testing::file_bytes(cfg.runtime.run_dir + "/config.toml") == core::to_toml(cfg));

  // A worker that does not host worker 0 leaves config.toml alone.
  fs::remove(cfg.runtime.run_dir + "/config.toml");
  REQUIRE(model::open_run(cfg, "", -1, false, nullptr).ok());
  CHECK_FALSE(fs::exists(cfg.runtime.run_dir + "/config.toml"));

  fs::create_directories(cfg.runtime.run_dir + "/config.toml");  // cannot be opened for writing
  auto bad = model::open_run(cfg, "", -1, true, nullptr);
  REQUIRE_FALSE(bad.ok());
  CHECK(has(bad.err().to_string(), "config.toml"));
  CHECK(has(bad.err().to_string(), "cannot create"));
}

TEST_CASE("run_log writes one metrics line per step, prints progress lines when due, then runs the hooks") {
  scratch_dir tmp("policy_log");
  auto cfg = model::testing::tiny_run(tmp);
  cfg.train.steps = 6;
  cfg.train.log_interval = 4;
  auto start = model::open_run(cfg, "", -1, true, nullptr);
  REQUIRE(start.ok());
  log_file log(tmp / "log.txt");
  auto run = model::run_log::open(cfg, start.value(), log.f);
  REQUIRE(run.ok());
  std::vector<int> hooked;
  run->add_step_hook([&](const model::step_metrics& m) {
    hooked.push_back(m.step);
    return core::status{};
  });
  for (int s = 0; s < 6; ++s) {
    auto o = outcome(s);
    if (s == 2) o.val_loss = 3.5;
    REQUIRE(run->step_end(o, s == 0 ? "\"extra\":1" : "").ok());
  }
  run->checkpoint_written(tmp / "ckpt");
  const auto sum = run->finish();
  CHECK(hooked == std::vector<int>{0, 1, 2, 3, 4, 5});
  CHECK(sum.losses.size() == 6);
  CHECK(sum.end_step == 6);
  CHECK(sum.final_val_loss == 3.5);
  CHECK(sum.checkpoint == tmp / "ckpt");
  CHECK(sum.seconds == doctest::Approx(1.5));

  const auto text = log.text();
  // Steps 3 (an evaluation), 4 (log_interval) and 6 (the last) are printed; 1, 2 and 5 are not.
  CHECK(has(text, "step 3/6 |"));
  CHECK(has(text, "step 4/6 |"));
  CHECK(has(text, "step 6/6 |"));
  CHECK_FALSE(has(text, "step 1/6 |"));
  CHECK_FALSE(has(text, "step 2/6 |"));
  CHECK_FALSE(has(text, "step 5/6 |"));
  CHECK(has(text, "checkpoint: " + tmp / "ckpt"));

  const auto metrics = model::testing::file_bytes(cfg.runtime.run_dir + "/metrics.jsonl");
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 6);
  CHECK(has(metrics, "\"extra\":1}\n"));
  CHECK(has(metrics, "\"val_loss\":3.5"));
}

TEST_CASE("a failing step-end hook and a metrics file that cannot be written stop the run") {
  scratch_dir tmp("policy_fail");
  auto cfg = model::testing::tiny_run(tmp);
  auto start = model::open_run(cfg, "", -1, true, nullptr);
  REQUIRE(start.ok());
  {
    auto run = model::run_log::open(cfg, start.value(), nullptr);
    REQUIRE(run.ok());
    run->add_step_hook([](const model::step_metrics& m) -> core::status {
      return core::error::make("report of step " + std::to_string(m.step) + " failed");
    });
    auto st = run->step_end(outcome(0));
    REQUIRE_FALSE(st.ok());
    CHECK(has(st.err().to_string(), "report of step 0 failed"));
  }
  // A fresh run's metrics.jsonl is created in place: make it a link to a device where every
  // write fails.
  fs::remove(cfg.runtime.run_dir + "/metrics.jsonl");
  fs::create_symlink("/dev/full", cfg.runtime.run_dir + "/metrics.jsonl");
  auto run = model::run_log::open(cfg, start.value(), nullptr);
  REQUIRE(run.ok());
  auto st = run->step_end(outcome(0));
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().to_string(), "metrics.jsonl"));
  CHECK(has(st.err().to_string(), "write failed"));
}
