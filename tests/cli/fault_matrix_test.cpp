// The fault matrix (docs/faults.md): each fault injected into a real `troupe launch` job of four
// worker processes (pipeline_stage 2 × data_parallel 2, a small GPT-2 so that each test takes
// seconds), through the test-only TROUPE_FAULT (core/fault.hpp) or a signal: a connection cut
// mid-transfer, the disk filling during a checkpoint write, worker 0 (the coordinator's host)
// killed, a NaN in one rank's gradient under both non-finite policies, a 5× straggler, a
// tensor-parallel rank that stalls (TROUPE_FAULT=stall, the watchdog names what its partner waits
// for), and two workers killed (TROUPE_FAULT=kill) in two attempts of one `--max-restarts 2` job. Each
// test checks what is said, that every worker process is gone, and — where the job recovers —
// that its final weights and losses equal an uninterrupted `troupe train` of the same config bit
// for bit. The time from the fault to the job's reaction is printed (MESSAGE), never asserted:
// docs/faults.md records it. Run as its own ctest entry, `faults`.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "model/checkpoint.hpp"
#include "tests/cli/child_process.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/cli/train_compare.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using troupe::cli_test::child;
using troupe::cli_test::contains;
using troupe::cli_test::free_port;
using troupe::cli_test::require_same_result;
using troupe::cli_test::slurp;
using troupe::cli_test::troupe_binary;
using troupe::model::testing::scratch_dir;
using clock_type = std::chrono::steady_clock;

namespace {

const std::string tiny_config = TROUPE_SOURCE_DIR "/configs/tiny.toml";

/// A small GPT-2 (2 layers, C=32, V=64) on configs/tiny.toml's layout, `steps` steps, a checkpoint
/// every 2 steps, in run directory `run`; pattern shards written once per scratch directory.
std::string sets(const scratch_dir& tmp, const std::string& run, int steps, const std::string& more = "") {
  if (!fs::exists(tmp / "train.bin")) {
    troupe::model::testing::write_pattern_shard(tmp / "train.bin", 40000, 64, 1);
    troupe::model::testing::write_pattern_shard(tmp / "val.bin", 4000, 64, 2);
  }
  return "--set data.train='" + (tmp / "train.bin") + "' --set data.val='" + (tmp / "val.bin") +
         "' --set data.tokenizer_dir='' --set model.vocab_size=64 --set model.hidden_size=32"
         " --set model.num_layers=2 --set model.seq_length=16 --set parallel.micro_batch_size=2"
         " --set parallel.micro_batch_num=2 --set runtime.run_dir='" + (tmp / run) +
         "' --set train.steps=" + std::to_string(steps) +
         " --set train.warmup_steps=1 --set train.eval_interval=4 --set train.eval_batches=1"
         " --set checkpoint.interval=2 --set runtime.threads=1 " + more;
}

std::string launch_args(int port, const std::string& more = "") {
  return "launch --worker_num 4 --master_addr 127.0.0.1 --master_port " + std::to_string(port) +
         " --grace 30 " + more + " '" + tiny_config + "' ";
}

/// The uninterrupted reference: `troupe train` of the same config in one process.
void train_whole(const scratch_dir& tmp, const std::string& run, int steps, const std::string& more = "") {
  child t(tmp.path, "train_" + run, "train '" + tiny_config + "' " + sets(tmp, run, steps, more));
  REQUIRE_MESSAGE(t.wait() == 0, t.stderr_text());
}

/// Waits until `file` contains `text`; the moment it was seen. Fails after `limit`.
clock_type::time_point wait_for_text(const fs::path& file, const std::string& text, child& job,
                                     std::chrono::seconds limit = std::chrono::seconds(120)) {
  const auto until = clock_type::now() + limit;
  while (!contains(slurp(file), text)) {
    REQUIRE_MESSAGE(clock_type::now() < until, "no '" << text << "' in " << file << "\n" << job.stderr_text());
    const bool alive = job.running() || contains(slurp(file), text);
    REQUIRE_MESSAGE(alive, "the job ended without '" << text << "' in " << file << "\n" << job.stderr_text());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return clock_type::now();
}

double seconds_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::vector<pid_t> worker_pids(const fs::path& run) {
  std::vector<pid_t> out;
  for (auto& w : nlohmann::json::parse(slurp(run / "logs" / "workers.json")))
    out.push_back(w.at("pid").get<pid_t>());
  REQUIRE(out.size() == 4);
  return out;
}

/// Every process in `pids` is gone.
void require_gone(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    const bool gone = ::kill(p, 0) != 0;
    CHECK_MESSAGE(gone, "worker pid " << p << " is still running");
  }
}

std::vector<nlohmann::json> metrics(const fs::path& run) {
  std::vector<nlohmann::json> out;
  std::istringstream in(slurp(run / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

/// The launcher restarted the job once, from a checkpoint, and the attempt logs are kept.
void require_one_restart(child& l, const fs::path& run) {
  const std::string err = l.stderr_text();
  CHECK_MESSAGE(contains(err, "restart 1 of 1"), err);
  CHECK_MESSAGE(contains(l.stdout_text(), "1 restart)"), l.stdout_text());
  CHECK_MESSAGE(!contains(err, "sending SIGTERM"), err);  // every worker stopped by itself
  CHECK(fs::exists(run / "logs" / "worker_0.attempt0.log"));
}

}  // namespace

TEST_CASE("fault matrix: a connection cut mid-transfer stops the job naming both ranks; --max-restarts recovers bit-identical") {
  scratch_dir tmp("fault_drop");
  const int steps = 6;
  train_whole(tmp, "whole", steps);
  const fs::path run = tmp.path / "dropped";
  child l(tmp.path, "launch", launch_args(free_port(), "--max-restarts 1") + sets(tmp, "dropped", steps),
          "TROUPE_FAULT=drop:1:3");
  const auto cut = wait_for_text(run / "logs" / "worker_1.log", "was cut by TROUPE_FAULT=drop:1:3", l);
  const auto pids = worker_pids(run);  // the first attempt's
  const auto restarted = wait_for_text(l.err, "restart 1 of 1", l);
  MESSAGE("drop: every worker of the attempt stopped " << seconds_between(cut, restarted)
                                                       << " s after the cut");
  REQUIRE_MESSAGE(l.wait() == 0, l.stderr_text());
  require_gone(pids);
  require_gone(worker_pids(run));
  require_one_restart(l, run);
  // The attempt's error names the rank that lost its peer and the peer, and says how.
  const std::string log0 = slurp(run / "logs" / "worker_0.attempt0.log");
  const std::string log1 = slurp(run / "logs" / "worker_1.attempt0.log");
  MESSAGE("drop: worker 0 said:\n" << log0.substr(log0.find("troupe: error")));
  CHECK_MESSAGE(contains(log0, "troupe: error"), log0);
  CHECK_MESSAGE(contains(log0, "rank 1"), log0);
  const std::string both = log0 + log1;
  CHECK_MESSAGE(contains(both, "connection to rank"), both);
  CHECK_MESSAGE(contains(log1, "halfway through step 3"), log1);
  // The restart continued from the checkpoint of step 2, written before the cut.
  CHECK_MESSAGE(contains(l.stderr_text(), "restarting from the last checkpoint"), l.stderr_text());
  require_same_result(tmp.path / "whole", run);
}

TEST_CASE("fault matrix, two nodes: a connection cut stops both nodes' workers; each launcher restarts its own and the job ends bit-identical") {
  scratch_dir tmp("fault_drop_nodes");
  const int steps = 6;
  train_whole(tmp, "whole", steps);
  const fs::path run = tmp.path / "nodes";
  const int port = free_port();
  const std::string env = "TROUPE_JOB_TOKEN=two-node-restart TROUPE_FAULT=drop:1:3";
  const std::string common = "--local_worker_num 2 --max-restarts 1";
  child n0(tmp.path, "node0", launch_args(port, common + " --node_rank 0") + sets(tmp, "nodes", steps), env);
  child n1(tmp.path, "node1", launch_args(port, common + " --node_rank 1") + sets(tmp, "nodes", steps), env);
  wait_for_text(run / "logs" / "worker_1.log", "was cut by TROUPE_FAULT=drop:1:3", n0);
  REQUIRE_MESSAGE(n0.wait() == 0, n0.stderr_text());
  REQUIRE_MESSAGE(n1.wait() == 0, n1.stderr_text());
  for (child* n : {&n0, &n1}) {
    CHECK_MESSAGE(contains(n->stderr_text(), "restart 1 of 1"), n->stderr_text());
    CHECK_MESSAGE(contains(n->stderr_text(), "restarting from the last checkpoint"), n->stderr_text());
    CHECK_MESSAGE(contains(n->stdout_text(), "1 restart)"), n->stdout_text());
  }
  // Each node's first attempt is kept beside the second.
  for (int r = 0; r < 4; ++r)
    CHECK(fs::exists(run / "logs" / ("worker_" + std::to_string(r) + ".attempt0.log")));
  const std::string metrics_text = slurp(run / "metrics.jsonl");
  CHECK_MESSAGE(contains(metrics_text, "\"restarts\":1"), metrics_text);
  require_same_result(tmp.path / "whole", run);
}

TEST_CASE("two nodes that see different checkpoints stop at formation naming both steps, instead of training a mix") {
  scratch_dir tmp("fault_nodes_mismatch");
  const int steps = 4;
  // A finished run whose checkpoints only node 1 is pointed at: node 0 starts from step 0.
  train_whole(tmp, "done", steps);
  const fs::path run = tmp.path / "mix";
  const int port = free_port();
  const std::string env = "TROUPE_JOB_TOKEN=two-node-mismatch";
  const std::string common = "--local_worker_num 2";
  child n0(tmp.path, "node0", launch_args(port, common + " --node_rank 0") + sets(tmp, "mix", steps + 2), env);
  child n1(tmp.path, "node1",
           launch_args(port, common + " --node_rank 1 --resume '" + (tmp / "done") + "'") +
               sets(tmp, "mix", steps + 2),
           env);
  CHECK(n0.wait() != 0);
  CHECK(n1.wait() != 0);
  std::string logs;
  for (int r = 0; r < 4; ++r) logs += slurp(run / "logs" / ("worker_" + std::to_string(r) + ".log"));
  CHECK_MESSAGE(contains(logs, "starts at step " + std::to_string(steps) + " and this worker at step 0"), logs);
  CHECK_MESSAGE(contains(logs, "the nodes see different checkpoints"), logs);
  const bool trained = fs::exists(run / "metrics.jsonl") && !slurp(run / "metrics.jsonl").empty();
  CHECK_MESSAGE(!trained, slurp(run / "metrics.jsonl"));
}

TEST_CASE("fault matrix: the disk filling during a checkpoint write names the file, keeps the previous checkpoint whole, and a resume from it ends bit-identical") {
  scratch_dir tmp("fault_enospc");
  const int steps = 6;
  train_whole(tmp, "whole", steps);
  const fs::path run = tmp.path / "full";
  child l(tmp.path, "launch", launch_args(free_port()) + sets(tmp, "full", steps), "TROUPE_FAULT=enospc:4");
  const auto full = wait_for_text(run / "logs" / "worker_0.log", "the disk fills up", l);
  const auto pids = worker_pids(run);
  const int code = l.wait();
  const auto stopped = clock_type::now();
  MESSAGE("enospc: the launcher ended " << seconds_between(full, stopped) << " s after the failed write");
  CHECK(code == 1);
  require_gone(pids);
  CHECK_MESSAGE(!contains(l.stderr_text(), "sending SIGTERM"), l.stderr_text());
  const std::string log0 = slurp(run / "logs" / "worker_0.log");
  MESSAGE("enospc: worker 0 said:\n" << log0.substr(log0.find("troupe: error")));
  CHECK_MESSAGE(contains(log0, "the checkpoint of step 4 could not be written"), log0);
  CHECK_MESSAGE(contains(log0, ".step_000004.tmp/optimizer-chunk000.safetensors"), log0);
  CHECK_MESSAGE(contains(log0, "No space left on device"), log0);
  // The previous checkpoint is whole (every hash checks), `latest` still names it, and nothing of
  // the failed one is left that could pass for a checkpoint.
  const fs::path root = run / "checkpoints";
  CHECK(slurp(root / "latest") == "step_000002\n");
  CHECK_FALSE(fs::exists(root / "step_000004"));
  CHECK_FALSE(fs::exists(root / ".step_000004.tmp"));
  auto resolved = troupe::model::checkpoint::resolve(run.string());
  REQUIRE_MESSAGE(resolved.ok(), resolved.err().to_string());
  CHECK(fs::path(resolved.value()).filename() == "step_000002");
  auto opened = troupe::model::checkpoint::reader::open(resolved.value());
  CHECK_MESSAGE(opened.ok(), (opened.ok() ? "" : opened.err().to_string()));

  // Resuming the run directory continues from step 2 and ends as an uninterrupted run.
  child r(tmp.path, "resume", launch_args(free_port()) + sets(tmp, "full", steps) + " --resume '" + run.string() + "'");
  REQUIRE_MESSAGE(r.wait() == 0, r.stderr_text());
  CHECK_MESSAGE(contains(slurp(run / "logs" / "worker_0.log"), "step_000002"), slurp(run / "logs" / "worker_0.log"));
  require_gone(worker_pids(run));
  require_same_result(tmp.path / "whole", run);
}

TEST_CASE("fault matrix: worker 0 (the coordinator's host) killed: the others stop by themselves naming it; --max-restarts recovers bit-identical") {
  scratch_dir tmp("fault_coordinator");
  const int steps = 40;
  train_whole(tmp, "whole", steps);
  const fs::path run = tmp.path / "headless";
  child l(tmp.path, "launch", launch_args(free_port(), "--max-restarts 1") + sets(tmp, "headless", steps));
  // Once step 3 is logged (the checkpoint of step 2 exists), kill worker 0.
  const auto until = clock_type::now() + std::chrono::seconds(120);
  while (metrics(run).size() < 3) {
    REQUIRE_MESSAGE(clock_type::now() < until, l.stderr_text());
    REQUIRE_MESSAGE(l.running(), l.stderr_text());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto pids = worker_pids(run);
  REQUIRE(::kill(pids[0], SIGKILL) == 0);
  const auto killed = clock_type::now();
  const auto restarted = wait_for_text(l.err, "restart 1 of 1", l);
  MESSAGE("coordinator killed: every other worker stopped " << seconds_between(killed, restarted)
                                                            << " s after the kill");
  REQUIRE_MESSAGE(l.wait() == 0, l.stderr_text());
  require_gone(pids);
  require_gone(worker_pids(run));
  require_one_restart(l, run);
  CHECK_MESSAGE(contains(l.stderr_text(), "worker rank 0 (pid " + std::to_string(pids[0])), l.stderr_text());
  CHECK_MESSAGE(contains(l.stderr_text(), "SIGKILL"), l.stderr_text());
  // Each other worker found out by itself (its connection to worker 0 dropped) and said so.
  for (int r = 1; r < 4; ++r) {
    const std::string log = slurp(run / "logs" / ("worker_" + std::to_string(r) + ".attempt0.log"));
    CHECK_MESSAGE(contains(log, "worker rank 0 (host 127.0.0.1), which runs the coordinator, died or became unreachable"), log);
    CHECK_MESSAGE(contains(log, "worker rank " + std::to_string(r) + " stops"), log);
  }
  const std::string log3 = slurp(run / "logs" / "worker_3.attempt0.log");
  MESSAGE("coordinator killed: worker 3 said:\n" << log3.substr(log3.find("troupe: error")));
  require_same_result(tmp.path / "whole", run);
}

TEST_CASE("fault matrix: a NaN in one rank's gradient stops the job naming the rank, step and tensor; --max-restarts recovers bit-identical") {
  scratch_dir tmp("fault_nan_stop");
  const int steps = 6;
  train_whole(tmp, "whole", steps);
  const fs::path run = tmp.path / "nan";
  child l(tmp.path, "launch", launch_args(free_port(), "--max-restarts 1") + sets(tmp, "nan", steps),
          "TROUPE_FAULT=nan:3:3");
  const auto injected = wait_for_text(run / "logs" / "worker_3.log", "put a NaN", l);
  const auto pids = worker_pids(run);
  const auto restarted = wait_for_text(l.err, "restart 1 of 1", l);
  MESSAGE("nan (stop): every worker of the attempt stopped " << seconds_between(injected, restarted)
                                                             << " s after the injection");
  REQUIRE_MESSAGE(l.wait() == 0, l.stderr_text());
  require_gone(pids);
  require_gone(worker_pids(run));
  require_one_restart(l, run);
  const std::string log0 = slurp(run / "logs" / "worker_0.attempt0.log");
  const std::string log3 = slurp(run / "logs" / "worker_3.attempt0.log");
  MESSAGE("nan (stop): worker 0 said:\n" << log0.substr(log0.find("troupe: error")));
  // The stage's note names the element and tensor it hit; the coordinator's error names the same,
  // as the optimizer shard found them in the gradient it received.
  const std::string note = "put a NaN into element ";
  const auto at = log3.find(note);
  REQUIRE(at != std::string::npos);
  const auto of = log3.find(" of the gradient of ", at);
  const std::string element = log3.substr(at + note.size(), of - at - note.size());
  const auto name_at = of + std::string(" of the gradient of ").size();
  const std::string tensor = log3.substr(name_at, log3.find(' ', name_at) - name_at);
  CHECK_MESSAGE(contains(log0, "the gradient norm is NaN at step 3: NaN in the gradient of " + tensor +
                                   " (element " + element + " of it; chunk 1) from stage(dp=1, pp=1) "
                                   "(rank 3); the parameters were not updated"),
                log0);
  require_same_result(tmp.path / "whole", run);
}

TEST_CASE("fault matrix: a NaN in one rank's gradient under dynamic loss scaling skips that step, naming the rank and tensor, and the run goes on") {
  scratch_dir tmp("fault_nan_skip");
  const int steps = 6;
  const std::string dls = "--set precision.dynamic_loss_scale=true";
  const fs::path run = tmp.path / "skip";
  child l(tmp.path, "launch", launch_args(free_port()) + sets(tmp, "skip", steps, dls), "TROUPE_FAULT=nan:2:3");
  const auto injected = wait_for_text(run / "logs" / "worker_2.log", "put a NaN", l);
  const auto said = wait_for_text(run / "logs" / "worker_0.log", "the step is skipped", l);
  MESSAGE("nan (skip): reported " << seconds_between(injected, said) << " s after the injection");
  REQUIRE_MESSAGE(l.wait() == 0, l.stderr_text());
  require_gone(worker_pids(run));
  const std::string log0 = slurp(run / "logs" / "worker_0.log");
  const auto line = log0.find("the gradient is not finite at step 3");
  REQUIRE_MESSAGE(line != std::string::npos, log0);
  MESSAGE("nan (skip): worker 0 said:\n" << log0.substr(line, log0.find('\n', line) - line));
  CHECK_MESSAGE(contains(log0, "from stage(dp=1, pp=0) (rank 2); the step is skipped"), log0);
  // Step 3 alone is skipped (the loss scale halves), and the metrics line says whose NaN it was.
  const auto m = metrics(run);
  REQUIRE(m.size() == static_cast<std::size_t>(steps));
  for (const auto& j : m) {
    const bool three = j.at("step").get<int>() == 3;
    CHECK(j.at("skipped").get<bool>() == three);
    CHECK(j.contains("nonfinite") == three);
    if (three) CHECK(contains(j.at("nonfinite").get<std::string>(), "(rank 2)"));
  }
  CHECK(m[4].at("loss_scale").get<double>() == m[3].at("loss_scale").get<double>() / 2);
}

TEST_CASE("fault matrix: a worker 5x slower is reported as a straggler with its step-time skew, without a hang report, and ends bit-identical") {
  scratch_dir tmp("fault_slow");
  const int steps = 4;
  // Larger than the other rows' model, so that a slowed step takes longer than the watchdog's
  // second: a watchdog that took a slow step for a hang would stop this job.
  const std::string bigger =
      "--set model.hidden_size=128 --set model.seq_length=64 --set parallel.micro_batch_size=4"
      " --set parallel.micro_batch_num=4 --set runtime.watchdog_s=1";
  train_whole(tmp, "whole", steps, bigger);
  const fs::path run = tmp.path / "slow";
  child l(tmp.path, "launch", launch_args(free_port()) + sets(tmp, "slow", steps, bigger), "TROUPE_FAULT=slow:3:5");
  const auto started = clock_type::now();
  const auto reported = wait_for_text(run / "logs" / "worker_0.log", "straggler at step", l);
  MESSAGE("slow: reported " << seconds_between(started, reported) << " s after the launch");
  const int code = l.wait();
  REQUIRE_MESSAGE(code == 0, l.stderr_text() << slurp(run / "logs" / "worker_0.log"));
  require_gone(worker_pids(run));
  const std::string log0 = slurp(run / "logs" / "worker_0.log");
  CHECK_MESSAGE(!contains(log0, "no progress"), log0);
  const auto line = log0.find("straggler at step");
  MESSAGE("slow: worker 0 said:\n" << log0.substr(line, log0.find('\n', line) - line));
  CHECK_MESSAGE(contains(log0.substr(line), "stage(dp=1, pp=1) (rank 3) computed for"), log0);
  // Every step's metrics line names the worst rank and its skew; the straggler is it in most.
  int named = 0;
  double slowest_step = 0;
  for (const auto& j : metrics(run)) {
    REQUIRE(j.contains("skew"));
    if (j.at("skew").at("rank").get<int>() == 3) ++named;
    MESSAGE("slow: step " << j.at("step").get<int>() << " skew " << j.at("skew").dump());
    for (const auto& s : j.at("stages"))
      slowest_step = std::max(slowest_step, s.at("busy_s").get<double>() + s.at("wait_s").get<double>() + s.at("comm_s").get<double>());
  }
  MESSAGE("slow: the slowest stage-step took " << slowest_step << " s against a 1 s watchdog");
  CHECK(named * 2 > steps);
  require_same_result(tmp.path / "whole", run);
}

TEST_CASE("fault matrix: a tensor-parallel rank that stalls: the watchdog names the collective, op, layer, micro-batch and peer its partner in another process waits for") {
  scratch_dir tmp("fault_tp_stall");
  const fs::path run = tmp.path / "stalled";
  // model_parallel 2 × pipeline_stage 2: workers 0 and 1 are pipeline stage 0's group. Worker 0
  // (which hosts the coordinator) stalls as step 1 begins; worker 1, in its own process, waits in
  // the vocabulary-parallel embedding's sum (an all-reduce without sequence parallel,
  // docs/model.md) for worker 0's part, and its node actor's heartbeat says so.
  const std::string tp = "--set parallel.model_parallel=2 --set parallel.data_parallel=1 --set runtime.watchdog_s=1";
  child l(tmp.path, "launch", launch_args(free_port()) + sets(tmp, "stalled", 4, tp), "TROUPE_FAULT=stall:0:1");
  const auto started = clock_type::now();
  const auto reported = wait_for_text(run / "logs" / "worker_0.log", "who waits on whom", l);
  MESSAGE("tp stall: reported " << seconds_between(started, reported) << " s after the launch");
  const int code = l.wait();
  MESSAGE("tp stall: the launcher exited " << seconds_between(reported, clock_type::now())
                                           << " s after the report");
  CHECK(code == 1);
  require_gone(worker_pids(run));
  const std::string log0 = slurp(run / "logs" / "worker_0.log");
  const auto line = log0.find("no progress for");
  REQUIRE_MESSAGE(line != std::string::npos, log0);
  MESSAGE("tp stall: worker 0 said:\n" << log0.substr(line, log0.find("hint:", line) - line));
  CHECK_MESSAGE(contains(log0, "stage(dp=0, pp=0, tp=1) (rank 1): blocked in the tensor-parallel all_reduce "
                               "(its reduce-scatter half, collective 0 of embedding_forward) of the embedding, "
                               "micro-batch 0, step 1: waiting to receive from rank 0 (stage(dp=0, pp=0, tp=0)) for "),
                log0);
  CHECK_MESSAGE(contains(log0, "stage(dp=0, pp=0) (rank 0): no answer within 2 s"), log0);
}

TEST_CASE("fault matrix: step forensics: a one-off NaN in one rank's gradient is classified transient, the step is retried, and the run ends bit-identical without a restart") {
  scratch_dir tmp("fault_forensics_transient");
  const int steps = 6;
  train_whole(tmp, "whole", steps);  // runtime.forensics off
  const fs::path run = tmp.path / "retry";
  child l(tmp.path, "launch",
          launch_args(free_port()) + sets(tmp, "retry", steps, "--set runtime.forensics=stop"),
          "TROUPE_FAULT=nan:3:3");
  const auto injected = wait_for_text(run / "logs" / "worker_3.log", "put a NaN", l);
  const auto said = wait_for_text(run / "logs" / "worker_0.log", "is transient", l);
  MESSAGE("forensics (transient): classified " << seconds_between(injected, said)
                                                << " s after the injection");
  REQUIRE_MESSAGE(l.wait() == 0, l.stderr_text());
  require_gone(worker_pids(run));
  const std::string log0 = slurp(run / "logs" / "worker_0.log");
  const auto at = log0.find("step forensics: the gradient is not finite at step 3");
  REQUIRE_MESSAGE(at != std::string::npos, log0);
  MESSAGE("forensics (transient): worker 0 said:\n"
          << log0.substr(at, log0.find("stands", at) + 6 - at));
  CHECK_MESSAGE(contains(log0, "step forensics: step 3 is transient"), log0);
  CHECK_MESSAGE(!contains(l.stderr_text(), "restart"), l.stderr_text());
  for (const auto& j : metrics(run)) {
    const bool three = j.at("step").get<int>() == 3;
    CHECK(j.contains("forensics") == three);
    if (three) {
      CHECK(j["forensics"]["verdict"] == "transient");
      CHECK(j["forensics"]["action"] == "retry");
    }
  }
  require_same_result(tmp.path / "whole", run);
}

TEST_CASE("fault matrix: step forensics: a poisoned sequence is classified deterministic, named by micro-batch and shard position, and stops the job") {
  scratch_dir tmp("fault_forensics_poison");
  const fs::path run = tmp.path / "poison";
  // 2 replicas × 2 micro-batches × 2 sequences: global sequence 5 is row 1 of replica 1's
  // micro-batch 0.
  child l(tmp.path, "launch",
          launch_args(free_port()) + sets(tmp, "poison", 6, "--set runtime.forensics=stop"),
          "TROUPE_FAULT=poison:3:5");
  const auto injected = wait_for_text(run / "logs" / "worker_3.log", "global sequence 5", l);
  CHECK(l.wait() == 1);
  const auto stopped = clock_type::now();
  MESSAGE("forensics (deterministic): stopped within " << seconds_between(injected, stopped)
                                                        << " s of the injection");
  require_gone(worker_pids(run));
  const std::string log0 = slurp(run / "logs" / "worker_0.log");
  const auto at = log0.find("troupe: error");
  REQUIRE_MESSAGE(at != std::string::npos, log0);
  MESSAGE("forensics (deterministic): worker 0 said:\n" << log0.substr(at));
  CHECK_MESSAGE(contains(log0, "step forensics: step 3 is deterministic: the loss is NaN at step 3, "
                               "micro-batch 0 (replica 1)"),
                log0);
  CHECK_MESSAGE(contains(log0, "micro-batch 0 of replica 1, global sequence 5 (row 1 of the "
                               "micro-batch): mean loss NaN, from " + (tmp / "train.bin") +
                               " token offset "),
                log0);
  const auto m = metrics(run);
  REQUIRE(!m.empty());
  const auto& f = m.back().at("forensics");
  CHECK(f["verdict"] == "deterministic");
  CHECK(f["action"] == "stop");
  CHECK(f["sequences"][0]["sequence"] == 5);
  CHECK(contains(log0, "token offset " + f["sequences"][0]["offset"].dump()));
}

namespace {

/// Waits until one of `files` contains `text` (a worker's log may be renamed to its attempt's name
/// by the time it is read); the moment it was seen. Fails after `limit`.
clock_type::time_point wait_for_any(const std::vector<fs::path>& files, const std::string& text,
                                    child& job, std::chrono::seconds limit = std::chrono::seconds(120)) {
  const auto until = clock_type::now() + limit;
  auto seen = [&] {
    return std::any_of(files.begin(), files.end(), [&](const fs::path& f) { return contains(slurp(f), text); });
  };
  while (!seen()) {
    REQUIRE_MESSAGE(clock_type::now() < until, "no '" << text << "' in " << files[0] << "\n" << job.stderr_text());
    const bool alive = job.running() || seen();
    REQUIRE_MESSAGE(alive, "the job ended without '" << text << "' in " << files[0] << "\n" << job.stderr_text());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return clock_type::now();
}

/// The step an attempt started at, from its worker 0 log ("resumed from … at step N"; 0 without).
int resumed_at(const std::string& log) {
  const std::string key = " at step ";
  const auto at = log.find("resumed from ");
  if (at == std::string::npos) return 0;
  return std::stoi(log.substr(log.find(key, at) + key.size()));
}

/// The step of the last checkpoint a worker 0 log says was written ("checkpoint: …/step_N"), or 0.
int last_checkpoint_noted(const std::string& log) {
  const std::string key = "checkpoint: ";
  int last = 0;
  for (auto at = log.find(key); at != std::string::npos; at = log.find(key, at + 1)) {
    const auto end = log.find('\n', at);
    const std::string path = log.substr(at + key.size(), end - at - key.size());
    const auto s = path.rfind("step_");
    if (s != std::string::npos) last = std::stoi(path.substr(s + 5));
  }
  return last;
}

std::vector<pid_t> pids_in(const fs::path& listing) {
  std::vector<pid_t> out;
  for (auto& w : nlohmann::json::parse(slurp(listing))) out.push_back(w.at("pid").get<pid_t>());
  REQUIRE(out.size() == 4);
  return out;
}

}  // namespace

TEST_CASE("fault matrix: two workers killed in two attempts (TROUPE_FAULT=kill:2:3,kill:1:8:1): --max-restarts 2 restarts twice, each from the newest checkpoint, and ends bit-identical") {
  scratch_dir tmp("fault_two_kills");
  const int steps = 10;
  train_whole(tmp, "whole", steps);
  const fs::path run = tmp.path / "twice";
  const fs::path logs = run / "logs";
  // Attempt 0: worker 2 dies by SIGKILL at step 3. Attempt 1 (after restart 1, resumed from the
  // checkpoint of step 2 or from step 0): worker 1 dies at step 8. Attempt 2 finishes.
  child l(tmp.path, "launch", launch_args(free_port(), "--max-restarts 2") + sets(tmp, "twice", steps),
          "TROUPE_FAULT=kill:2:3,kill:1:8:1");
  const auto kill1 = wait_for_any({logs / "worker_2.log", logs / "worker_2.attempt0.log"},
                                  "TROUPE_FAULT=kill:2:3: sending SIGKILL", l);
  const auto restart1 = wait_for_text(l.err, "restart 1 of 2", l);
  const auto kill2 = wait_for_any({logs / "worker_1.log", logs / "worker_1.attempt1.log"},
                                  "TROUPE_FAULT=kill:1:8:1: sending SIGKILL", l);
  const auto restart2 = wait_for_text(l.err, "restart 2 of 2", l);
  MESSAGE("two kills: every worker of attempt 0 stopped " << seconds_between(kill1, restart1)
          << " s after the first kill, of attempt 1 " << seconds_between(kill2, restart2)
          << " s after the second");
  REQUIRE_MESSAGE(l.wait() == 0, l.stderr_text());
  const std::string err = l.stderr_text();
  CHECK_MESSAGE(contains(l.stdout_text(), "2 restarts)"), l.stdout_text());
  CHECK_MESSAGE(!contains(err, "sending SIGTERM"), err);  // every worker stopped by itself

  // Each attempt's workers are listed; every one of them is gone, and the one killed is named.
  const std::vector<std::vector<pid_t>> attempts = {
      pids_in(logs / "workers.attempt0.json"), pids_in(logs / "workers.attempt1.json"),
      pids_in(logs / "workers.json")};
  for (const auto& pids : attempts) require_gone(pids);
  const std::string victim1 = "worker rank 2 (pid " + std::to_string(attempts[0][2]) + ",";
  const std::string victim2 = "worker rank 1 (pid " + std::to_string(attempts[1][1]) + ",";
  CHECK_MESSAGE(contains(slurp(logs / "worker_2.attempt0.log"),
                         "sending SIGKILL to this worker (pid " + std::to_string(attempts[0][2]) + ") at step 3"),
                slurp(logs / "worker_2.attempt0.log"));
  CHECK_MESSAGE(contains(slurp(logs / "worker_1.attempt1.log"),
                         "sending SIGKILL to this worker (pid " + std::to_string(attempts[1][1]) + ") at step 8"),
                slurp(logs / "worker_1.attempt1.log"));
  CHECK_MESSAGE(contains(err, "restart 1 of 2 after"), err);
  CHECK_MESSAGE(contains(err, "restart 2 of 2 after"), err);
  for (const auto& line : {"restart 1 of 2", "restart 2 of 2"}) {
    const auto at = err.find(line);
    if (at != std::string::npos) MESSAGE("two kills: the launcher said: " << err.substr(at, err.find('\n', at) - at));
  }

  // Two restart events, each with its cause (the killed worker, by rank, pid and signal).
  std::vector<nlohmann::json> events;
  {
    std::istringstream in(slurp(logs / "restarts.jsonl"));
    for (std::string line; std::getline(in, line);) events.push_back(nlohmann::json::parse(line));
  }
  REQUIRE(events.size() == 2);
  for (int k = 0; k < 2; ++k) {
    CHECK(events[k].at("restart").get<int>() == k + 1);
    CHECK(events[k].at("max_restarts").get<int>() == 2);
    const std::string cause = events[k].at("cause").get<std::string>();
    CHECK_MESSAGE(contains(cause, k == 0 ? victim1 : victim2), cause);
    CHECK_MESSAGE(contains(cause, "SIGKILL"), cause);
  }

  // Each restart resumed from the newest checkpoint: at least the last one its failed attempt
  // said was written, no later than the step it died at; the second from a newer one than the
  // first (attempt 1 wrote checkpoints of its own before it died).
  const std::string log0[3] = {slurp(logs / "worker_0.attempt0.log"), slurp(logs / "worker_0.attempt1.log"),
                               slurp(logs / "worker_0.log")};
  const int from1 = resumed_at(log0[1]), from2 = resumed_at(log0[2]);
  MESSAGE("two kills: attempt 1 resumed at step " << from1 << ", attempt 2 at step " << from2);
  CHECK(resumed_at(log0[0]) == 0);
  CHECK(from1 >= last_checkpoint_noted(log0[0]));
  CHECK(from1 <= 3);
  CHECK(last_checkpoint_noted(log0[1]) > from1);
  CHECK(from2 >= last_checkpoint_noted(log0[1]));
  CHECK(from2 <= 8);
  CHECK(from2 > from1);

  // Every step is in metrics.jsonl once, in order, written by the attempt that ran it last: the
  // steps before attempt 1's start without "restarts", then "restarts":1 up to attempt 2's start,
  // then "restarts":2.
  const auto m = metrics(run);
  REQUIRE(m.size() == static_cast<std::size_t>(steps));
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    CHECK(m[s].at("step").get<int>() == s);
    const int expected = s < from1 ? 0 : s < from2 ? 1 : 2;
    CHECK(m[s].value("restarts", 0) == expected);
    CHECK(m[s].contains("restarts") == (expected > 0));
  }
  require_same_result(tmp.path / "whole", run);
  // The message recording, cut back at each resume, replays as one run.
  child rep(tmp.path, "replay", "replay '" + run.string() + "' --quiet");
  CHECK_MESSAGE(rep.wait() == 0, rep.stderr_text());
  CHECK_MESSAGE(contains(rep.stdout_text(), "replay matched the recorded run bit for bit"), rep.stdout_text());
}
