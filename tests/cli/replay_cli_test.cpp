// `troupe replay`, run as the built binary: --help documents the options, a recorded `troupe
// train` replays with exit 0 and the verdict line, a corrupted log exits 1 naming the message, and
// a directory that is not a recorded run exits 2 with the reason; --compare sets two runs side by
// side (exit 0 the same bits, 1 where they part).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/config.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using namespace troupe::cli_test;

TEST_CASE("replay --help lists the run directory and every option") {
  troupe::model::testing::scratch_dir tmp("replaycli_help");
  auto r = run_troupe(tmp.path, "replay --help");
  CHECK(r.code == 0);
  for (const char* part : {"run_dir", "--until-step", "--dump-tensors", "--rank", "--work-dir",
                           "--compare", "Exit status"})
    CHECK_MESSAGE(contains(r.out, part), part);
}

TEST_CASE("replay of a directory that is not a recorded run exits 2 with the reason") {
  troupe::model::testing::scratch_dir tmp("replaycli_bad");
  auto r = run_troupe(tmp.path, "replay '" + (tmp / "no_such_run") + "'");
  CHECK(r.code == 2);
  CHECK(contains(r.err, "troupe: error: " + (tmp / "no_such_run")));
  CHECK(contains(r.err, "no such run directory"));
  auto r2 = run_troupe(tmp.path, "replay '" + tmp.path.string() + "'");
  CHECK(r2.code == 2);
  CHECK(contains(r2.err, "not a troupe run directory"));
}

TEST_CASE("a recorded troupe train replays with exit 0; a corrupted log line exits 1 naming it") {
  troupe::model::testing::scratch_dir tmp("replaycli_run");
  auto cfg = troupe::model::testing::tiny_run(tmp);
  cfg.parallel.pipeline_stage = 2;
  cfg.train.steps = 2;
  cfg.train.eval_interval = 0;
  const std::string config = tmp / "run.toml";
  std::ofstream(config) << troupe::core::to_toml(cfg);
  auto t = run_troupe(tmp.path, "train '" + config + "'");
  REQUIRE_MESSAGE(t.code == 0, t.err);

  auto r = run_troupe(tmp.path, "replay '" + cfg.runtime.run_dir + "' --quiet");
  CHECK_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, "replay matched the recorded run bit for bit: "));
  CHECK(contains(r.out, " messages over 2 steps"));

  // The first line after the header of worker 1's log: its first tensor sent.
  const std::string log = cfg.runtime.run_dir + "/messages/rank_1.log";
  std::string text = slurp(log);
  const auto at = text.find("\"hash\":\"", text.find('\n'));
  REQUIRE(at != std::string::npos);
  text.replace(at + 8, 16, "ffffffffffffffff");
  std::ofstream(log, std::ios::binary | std::ios::trunc) << text;
  auto bad = run_troupe(tmp.path, "replay '" + cfg.runtime.run_dir + "' --quiet");
  CHECK(bad.code == 1);
  CHECK(contains(bad.err, "differs"));
  CHECK(contains(bad.err, "rank 1, step 0"));
  CHECK(contains(bad.err, "recorded hash ffffffffffffffff"));
}

TEST_CASE("replay --compare: two runs of one config exit 0; a changed log line exits 1 naming it") {
  troupe::model::testing::scratch_dir tmp("replaycli_compare");
  auto cfg = troupe::model::testing::tiny_run(tmp);
  cfg.parallel.pipeline_stage = 2;
  cfg.train.steps = 2;
  cfg.train.eval_interval = 0;
  const std::string config = tmp / "run.toml";
  std::ofstream(config) << troupe::core::to_toml(cfg);
  const std::string a = tmp / "run_a", b = tmp / "run_b";
  for (const std::string& dir : {a, b}) {
    auto t = run_troupe(tmp.path, "train '" + config + "' --set runtime.run_dir='\"" + dir + "\"'");
    REQUIRE_MESSAGE(t.code == 0, t.err);
  }
  auto same = run_troupe(tmp.path, "replay '" + a + "' --compare '" + b + "'");
  CHECK_MESSAGE(same.code == 0, same.err);
  CHECK(contains(same.out, "sent the same bits: "));
  CHECK(contains(same.out, " messages over 2 steps"));
  CHECK_FALSE(contains(same.out, "config.toml differ"));

  const std::string log = b + "/messages/rank_1.log";
  std::string text = slurp(log);
  const auto at = text.find("\"hash\":\"", text.find('\n'));
  REQUIRE(at != std::string::npos);
  text.replace(at + 8, 16, "ffffffffffffffff");
  std::ofstream(log, std::ios::binary | std::ios::trunc) << text;
  auto diff = run_troupe(tmp.path, "replay '" + a + "' --compare '" + b + "'");
  CHECK(diff.code == 1);
  CHECK(contains(diff.err, "part at step 0"));
  CHECK(contains(diff.err, "rank 1, step 0"));
  CHECK(contains(diff.err, "vs ffffffffffffffff"));

  // Options of a replay do not go with --compare.
  auto mixed = run_troupe(tmp.path, "replay '" + a + "' --compare '" + b + "' --rank 1");
  CHECK(mixed.code == 2);
  CHECK(contains(mixed.err, "excludes"));
}
