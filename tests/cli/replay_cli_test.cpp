// `troupe replay`, run as the built binary: --help documents the options, a recorded `troupe
// train` replays with exit 0 and the verdict line, a corrupted log exits 1 naming the message, and
// a directory that is not a recorded run exits 2 with the reason.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/config.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;

namespace {

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

// Runs `troupe ARGS` (already shell-quoted) inside `dir`.
run_result run_troupe(const fs::path& dir, const std::string& args) {
  REQUIRE_MESSAGE(fs::exists(troupe_binary), ("build the troupe target first: " + troupe_binary));
  const auto out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = "cd '" + dir.string() + "' && '" + troupe_binary + "' " + args + " >'" +
                          out.string() + "' 2>'" + err.string() + "'";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("replay --help lists the run directory and every option") {
  troupe::model::testing::scratch_dir tmp("replaycli_help");
  auto r = run_troupe(tmp.path, "replay --help");
  CHECK(r.code == 0);
  for (const char* part : {"run_dir", "--until-step", "--dump-tensors", "--rank", "--work-dir", "Exit status"})
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
