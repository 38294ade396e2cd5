// `troupe launch` running real jobs as separate worker processes (tcp transport for tensors, CAF
// middleman for control) on configs/tiny.toml's model, compared bit for bit with `troupe train`
// of the same config in one process: 4 local workers; the replay of the launched run; SIGKILL of
// one worker mid-run (every process stops within 30 s naming the dead rank), then a resume that
// ends bit-identical to an uninterrupted run; the same failure restarted automatically
// (--max-restarts); and two "nodes" (two launch calls) on loopback.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cli/child_process.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/cli/train_compare.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using troupe::model::testing::scratch_dir;
using troupe::cli_test::child;
using troupe::cli_test::contains;
using troupe::cli_test::free_port;
using troupe::cli_test::last_checkpoint;
using troupe::cli_test::require_same_result;
using troupe::cli_test::slurp;
using troupe::cli_test::troupe_binary;

namespace {

const std::string tiny_config = TROUPE_SOURCE_DIR "/configs/tiny.toml";

int run(const fs::path& dir, const std::string& name, const std::string& args, const std::string& env = "") {
  child c(dir, name, args, env);
  const int code = c.wait();
  if (code != 0) MESSAGE(name << " stdout:\n" << c.stdout_text() << "\nstderr:\n" << c.stderr_text());
  return code;
}

/// configs/tiny.toml's model and parallel layout (pipeline_stage 2 × data_parallel 2) on small
/// pattern shards, `steps` steps, in run directory `run`.
std::string tiny_sets(const scratch_dir& tmp, const std::string& run, int steps, int ckpt_interval = 0) {
  if (!fs::exists(tmp / "train.bin")) {
    troupe::model::testing::write_pattern_shard(tmp / "train.bin", 40000, 50257, 1);
    troupe::model::testing::write_pattern_shard(tmp / "val.bin", 8000, 50257, 2);
  }
  return "--set data.train='" + (tmp / "train.bin") + "' --set data.val='" + (tmp / "val.bin") +
         "' --set data.tokenizer_dir='' --set runtime.run_dir='" + (tmp / run) +
         "' --set train.steps=" + std::to_string(steps) + " --set train.warmup_steps=1" +
         " --set train.eval_interval=2 --set train.eval_batches=1 --set checkpoint.interval=" +
         std::to_string(ckpt_interval) + " --set runtime.threads=1";
}

std::string launch_args(int port, const std::string& more = "") {
  return "launch --worker_num 4 --master_addr 127.0.0.1 --master_port " + std::to_string(port) + " " + more +
         " '" + tiny_config + "' ";
}

}  // namespace

TEST_CASE("troupe launch with 4 worker processes equals troupe train in one process, bit for bit; its replay matches") {
  scratch_dir tmp("launch_same");
  REQUIRE(run(tmp.path, "train", "train '" + tiny_config + "' " + tiny_sets(tmp, "inproc", 3)) == 0);
  child l(tmp.path, "launch", launch_args(free_port()) + tiny_sets(tmp, "launched", 3));
  const int code = l.wait();
  REQUIRE_MESSAGE(code == 0, l.stderr_text());
  // The launcher shows worker 0's progress lines as they come.
  CHECK(contains(l.stdout_text(), "step 3/3"));
  for (int r = 0; r < 4; ++r) CHECK(fs::exists(tmp.path / "launched" / "messages" / ("rank_" + std::to_string(r) + ".log")));
  require_same_result(tmp.path / "inproc", tmp.path / "launched");

  auto rep = child(tmp.path, "replay", "replay '" + (tmp / "launched") + "' --quiet");
  CHECK_MESSAGE(rep.wait() == 0, rep.stderr_text());
  CHECK(contains(rep.stdout_text(), "replay matched the recorded run bit for bit"));

  // Corrupt one hash in worker 3's log: the replay names that very message.
  const fs::path log = tmp.path / "launched" / "messages" / "rank_3.log";
  std::string text = slurp(log);
  const auto line_start = text.find('\n') + 1;
  const auto at = text.find("\"hash\":\"", line_start);
  REQUIRE(at != std::string::npos);
  const auto record = nlohmann::json::parse(text.substr(line_start, text.find('\n', line_start) - line_start));
  text.replace(at + 8, 16, "ffffffffffffffff");
  std::ofstream(log, std::ios::binary | std::ios::trunc) << text;
  auto bad = child(tmp.path, "replay_bad", "replay '" + (tmp / "launched") + "' --quiet");
  CHECK(bad.wait() == 1);
  CHECK(contains(bad.stderr_text(), "recorded hash ffffffffffffffff"));
  CHECK(contains(bad.stderr_text(), "rank 3, step " + std::to_string(record.at("step").get<int>())));
}

TEST_CASE("troupe launch of model_parallel 2 × pipeline_stage 2 × data_parallel 2 (8 processes) equals troupe "
          "train bit for bit; its whole replay matches, and so does rank 3 alone") {
  scratch_dir tmp("launch_tp");
  const std::string tp = " --set parallel.model_parallel=2 --set parallel.sequence_parallel=true";
  REQUIRE(run(tmp.path, "train", "train '" + tiny_config + "' " + tiny_sets(tmp, "inproc", 2) + tp) == 0);
  child l(tmp.path, "launch",
          "launch --worker_num 8 --master_addr 127.0.0.1 --master_port " + std::to_string(free_port()) +
              " '" + tiny_config + "' " + tiny_sets(tmp, "launched", 2) + tp +
              " --set runtime.record_tensors=true");
  const int code = l.wait();
  REQUIRE_MESSAGE(code == 0, l.stderr_text());
  CHECK(contains(l.stdout_text(), "step 2/2"));
  for (int r = 0; r < 8; ++r) CHECK(fs::exists(tmp.path / "launched" / "messages" / ("rank_" + std::to_string(r) + ".log")));
  require_same_result(tmp.path / "inproc", tmp.path / "launched");

  auto rep = child(tmp.path, "replay", "replay '" + (tmp / "launched") + "' --quiet");
  CHECK_MESSAGE(rep.wait() == 0, rep.stderr_text());
  CHECK(contains(rep.stdout_text(), "replay matched the recorded run bit for bit"));
  // Worker 3 (dp 0, pp 1, tp 1) alone, fed what its group sent it over tcp.
  auto one = child(tmp.path, "replay_rank", "replay '" + (tmp / "launched") + "' --rank 3 --quiet");
  CHECK_MESSAGE(one.wait() == 0, one.stderr_text());
  CHECK(contains(one.stdout_text(), "replay of rank 3 matched the recorded run bit for bit"));

  // The first collective slice worker 3 sent in step 1, its hash changed: rank 3 alone names it.
  const std::string log = (tmp.path / "launched" / "messages" / "rank_3.log").string();
  std::ifstream in(log);
  std::string text, line;
  nlohmann::json record;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (record.is_null() && j.contains("hash") && j.at("step") == 1 &&
        j.at("kind").get<std::string>().rfind("tp_", 0) == 0) {
      record = j;
      line.replace(line.find("\"hash\":\"") + 8, 16, "ffffffffffffffff");
    }
    text += line + "\n";
  }
  in.close();
  REQUIRE_FALSE(record.is_null());
  std::ofstream(log, std::ios::binary | std::ios::trunc) << text;
  auto bad = child(tmp.path, "replay_rank_bad", "replay '" + (tmp / "launched") + "' --rank 3 --quiet");
  CHECK(bad.wait() == 1);
  CHECK(contains(bad.stderr_text(), "recorded hash ffffffffffffffff"));
  const std::string where = "rank 3, step 1, micro-batch " + std::to_string(record.at("mb").get<int>()) + ", ";
  CHECK_MESSAGE(contains(bad.stderr_text(), where), bad.stderr_text());
  CHECK_MESSAGE(contains(bad.stderr_text(), "collective " + record.at("op").get<std::string>() + " ("),
                bad.stderr_text());
}

TEST_CASE("a worker killed with SIGKILL stops the whole job within 30 s naming it; resuming ends bit-identical") {
  scratch_dir tmp("launch_kill");
  const int steps = 8;
  REQUIRE(run(tmp.path, "train", "train '" + tiny_config + "' " + tiny_sets(tmp, "whole", steps, 2)) == 0);

  child l(tmp.path, "launch", launch_args(free_port(), "--grace 30") + tiny_sets(tmp, "killed", steps, 2));
  // Wait until step 3 is logged (the checkpoint of step 2 exists), then kill worker 3.
  const fs::path metrics = tmp.path / "killed" / "metrics.jsonl";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  auto lines = [&] {
    const std::string text = slurp(metrics);
    return std::count(text.begin(), text.end(), '\n');
  };
  while (lines() < 3) {
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline, l.stderr_text());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto workers = nlohmann::json::parse(slurp(tmp.path / "killed" / "logs" / "workers.json"));
  pid_t victim = -1;
  for (auto& w : workers)
    if (w.at("rank").get<int>() == 3) victim = w.at("pid").get<pid_t>();
  REQUIRE(victim > 0);
  REQUIRE(::kill(victim, SIGKILL) == 0);
  const auto killed_at = std::chrono::steady_clock::now();
  const int code = l.wait(std::chrono::seconds(120));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  MESSAGE("SIGKILL: the launcher ended " << took << " s after the kill");
  CHECK(code != 0);
  CHECK(took < 30.0);
  const std::string err = l.stderr_text() + slurp(tmp.path / "killed" / "logs" / "worker_0.log");
  CHECK_MESSAGE(contains(err, "worker rank 3 (host 127.0.0.1"), err);
  CHECK_MESSAGE(contains(err, "died or became unreachable during step"), err);
  CHECK_MESSAGE(contains(err, "its last report"), err);
  // Every worker process is gone.
  for (auto& w : workers) CHECK(::kill(w.at("pid").get<pid_t>(), 0) != 0);

  child r(tmp.path, "resume", launch_args(free_port()) + tiny_sets(tmp, "killed", steps, 2) + " --resume '" +
                                  (tmp / "killed") + "'");
  REQUIRE_MESSAGE(r.wait() == 0, r.stderr_text());
  require_same_result(tmp.path / "whole", tmp.path / "killed");
}

TEST_CASE("--max-restarts: a worker killed mid-run is restarted from the last checkpoint and the run ends bit-identical") {
  scratch_dir tmp("launch_restart");
  const int steps = 8;
  REQUIRE(run(tmp.path, "train", "train '" + tiny_config + "' " + tiny_sets(tmp, "whole", steps, 2)) == 0);

  child l(tmp.path, "launch", launch_args(free_port(), "--grace 30 --max-restarts 2") + tiny_sets(tmp, "restarted", steps, 2));
  // Kill worker 2 once step 3 is logged (the checkpoint of step 2 exists).
  const fs::path run_dir = tmp.path / "restarted";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  auto lines = [&] {
    const std::string text = slurp(run_dir / "metrics.jsonl");
    return std::count(text.begin(), text.end(), '\n');
  };
  while (lines() < 3) {
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline, l.stderr_text());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto workers = nlohmann::json::parse(slurp(run_dir / "logs" / "workers.json"));
  pid_t victim = -1;
  for (auto& w : workers)
    if (w.at("rank").get<int>() == 2) victim = w.at("pid").get<pid_t>();
  REQUIRE(victim > 0);
  REQUIRE(::kill(victim, SIGKILL) == 0);
  const int code = l.wait(std::chrono::seconds(300));
  const std::string err = l.stderr_text();
  REQUIRE_MESSAGE(code == 0, err);
  CHECK_MESSAGE(contains(err, "restart 1 of 2"), err);
  CHECK_MESSAGE(contains(err, "worker rank 2 (pid " + std::to_string(victim)), err);
  CHECK_MESSAGE(contains(err, "restarting from the last checkpoint under"), err);
  CHECK_MESSAGE(contains(l.stdout_text(), "1 restart)"), l.stdout_text());
  // The restart is recorded: an event line, the failed attempt's logs, and the metrics lines
  // written after it.
  const auto event = nlohmann::json::parse(slurp(run_dir / "logs" / "restarts.jsonl"));
  CHECK(event.at("restart").get<int>() == 1);
  CHECK(contains(event.at("cause").get<std::string>(), "SIGKILL"));
  CHECK(fs::exists(run_dir / "logs" / "worker_2.attempt0.log"));
  std::istringstream in(slurp(run_dir / "metrics.jsonl"));
  int restarted_lines = 0, plain_lines = 0;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("restarts")) {
      CHECK(j.at("restarts").get<int>() == 1);
      ++restarted_lines;
    } else {
      ++plain_lines;
    }
  }
  CHECK(plain_lines >= 2);      // the steps kept from before the failure
  CHECK(restarted_lines >= 1);  // the steps run after the restart
  CHECK(plain_lines + restarted_lines == steps);
  // Every worker process of the failed attempt is gone.
  for (auto& w : workers) CHECK(::kill(w.at("pid").get<pid_t>(), 0) != 0);
  require_same_result(tmp.path / "whole", run_dir);
}

TEST_CASE("--max-restarts is refused with --steps (the steps of an invocation would count again)") {
  scratch_dir tmp("launch_restart_bad");
  child a(tmp.path, "steps", launch_args(free_port(), "--max-restarts 1 --steps 2") + tiny_sets(tmp, "r", 4));
  CHECK(a.wait() == 2);
  CHECK_MESSAGE(contains(a.stderr_text(), "--steps cannot be combined with --max-restarts"), a.stderr_text());
}

TEST_CASE("two launch calls on loopback (node_rank 0 and 1, two workers each) form one job equal to troupe train") {
  scratch_dir tmp("launch_nodes");
  REQUIRE(run(tmp.path, "train", "train '" + tiny_config + "' " + tiny_sets(tmp, "inproc", 2)) == 0);
  const int port = free_port();
  const std::string env = "TROUPE_JOB_TOKEN=two-node-test";
  const std::string common = "--local_worker_num 2 --log_dir '" + (tmp / "logs") + "'";
  child n0(tmp.path, "node0", launch_args(port, common + " --node_rank 0") + tiny_sets(tmp, "nodes", 2), env);
  child n1(tmp.path, "node1", launch_args(port, common + " --node_rank 1") + tiny_sets(tmp, "nodes", 2), env);
  CHECK_MESSAGE(n0.wait() == 0, n0.stderr_text());
  CHECK_MESSAGE(n1.wait() == 0, n1.stderr_text());
  require_same_result(tmp.path / "inproc", tmp.path / "nodes");
}

TEST_CASE("a worker that stops making progress (SIGSTOP) is reported by the watchdog with who waits on whom") {
  scratch_dir tmp("launch_hang");
  child l(tmp.path, "launch", launch_args(free_port(), "--grace 2") + tiny_sets(tmp, "hung", 40) +
                                  " --set runtime.watchdog_s=4");
  const fs::path metrics = tmp.path / "hung" / "metrics.jsonl";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  while (slurp(metrics).find('\n') == std::string::npos) {
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline, l.stderr_text());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto workers = nlohmann::json::parse(slurp(tmp.path / "hung" / "logs" / "workers.json"));
  pid_t stopped = -1;
  for (auto& w : workers)
    if (w.at("rank").get<int>() == 3) stopped = w.at("pid").get<pid_t>();
  REQUIRE(stopped > 0);
  REQUIRE(::kill(stopped, SIGSTOP) == 0);
  const int code = l.wait(std::chrono::seconds(120));
  CHECK(code != 0);
  const std::string log0 = slurp(tmp.path / "hung" / "logs" / "worker_0.log");
  CHECK_MESSAGE(contains(log0, "who waits on whom"), log0);
  CHECK_MESSAGE(contains(log0, "stage(dp=1, pp=1) (rank 3): no answer within 2 s"), log0);
  CHECK_MESSAGE(contains(log0, "waiting for"), log0);
  for (auto& w : workers) CHECK(::kill(w.at("pid").get<pid_t>(), 0) != 0);
}
