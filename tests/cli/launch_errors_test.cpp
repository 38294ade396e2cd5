// `troupe launch`, run as the built binary: --help, the usage errors caught before anything
// starts (wrong --worker_num, nodes, token), a master port in use, a node that never arrives, a
// stranger at the rendezvous port while a two-node job forms, a worker killed by SIGKILL, a
// SIGTERM to the launcher, and an exception inside an actor (a bad validation shard) under both
// `troupe train` and `troupe launch`. Every launcher runs as a child of the test with a bound on its
// running time, on a free port found by binding port 0; none hangs the test.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/config.hpp"
#include "model/shards.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "transport/rendezvous.hpp"

extern char** environ;

namespace fs = std::filesystem;
using troupe::model::testing::scratch_dir;
using troupe::cli_test::contains;
using troupe::cli_test::slurp;
using troupe::cli_test::troupe_binary;
using namespace std::chrono_literals;

namespace {

// A socket listening on 127.0.0.1 at a port the system chose; closed on destruction.
struct listener {
  int fd = -1;
  int port = 0;
  listener() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd, 4) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = ntohs(a.sin_port);
  }
  ~listener() { ::close(fd); }
};

// A port that was free a moment ago.
int free_port() { return listener().port; }

// A raw TCP connection to 127.0.0.1:port (-1 when refused).
int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// `troupe ARGS...` started in `dir` with extra environment entries, stdout and stderr to files.
struct launched {
  pid_t pid = -1;
  fs::path out, err;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::optional<int> code;  // exit code, or 128 + signal

  std::string stdout_text() const { return slurp(out); }
  std::string stderr_text() const { return slurp(err); }

  // Waits at most `limit` for the process; on time-out kills it (its workers die with it) and
  // returns nothing.
  std::optional<int> wait(std::chrono::milliseconds limit) {
    if (code) return code;
    const auto until = std::chrono::steady_clock::now() + limit;
    int status = 0;
    while (std::chrono::steady_clock::now() < until) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return code;
      }
      std::this_thread::sleep_for(20ms);
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return std::nullopt;
  }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  ~launched() {
    if (!code) wait(0ms);
  }
};

std::unique_ptr<launched> start_troupe(const fs::path& dir, const std::string& tag,
                                       const std::vector<std::string>& args,
                                       const std::vector<std::string>& env_extra = {}) {
  REQUIRE_MESSAGE(fs::exists(troupe_binary), ("build the troupe target first: " + troupe_binary));
  auto l = std::make_unique<launched>();
  l->out = dir / (tag + ".out");
  l->err = dir / (tag + ".err");
  std::vector<std::string> argv_s = {troupe_binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  // Slurm's variables of a test that itself runs under Slurm must not reach these launchers.
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    if (kv.rfind("SLURM_", 0) == 0 || kv.rfind("MASTER_", 0) == 0 || kv.rfind("TROUPE_", 0) == 0)
      continue;
    env_s.push_back(kv);
  }
  env_s.insert(env_s.end(), env_extra.begin(), env_extra.end());
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, l->out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, l->err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addchdir_np(&fa, dir.c_str());
  const int rc =
      posix_spawn(&l->pid, troupe_binary.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE(rc == 0);
  return l;
}

// The tiny test model (2 layers, a few steps) as a config file, for `workers` workers.
struct job_config {
  std::string path;
  std::string run_dir;
};
job_config write_config(const scratch_dir& tmp, int pipeline_stage, int data_parallel, int steps) {
  auto cfg = troupe::model::testing::tiny_run(tmp);
  cfg.parallel.pipeline_stage = pipeline_stage;
  cfg.parallel.data_parallel = data_parallel;
  cfg.train.steps = steps;
  cfg.train.warmup_steps = 1;
  cfg.train.eval_interval = 0;
  const std::string path = tmp / "job.toml";
  std::ofstream(path) << troupe::core::to_toml(cfg);
  return {path, cfg.runtime.run_dir};
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// Polls until `pred` holds or `limit` passes.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return pred();
}

// The pids of workers.json once the launcher has written it.
std::vector<pid_t> worker_pids(const fs::path& listing) {
  std::vector<pid_t> pids;
  REQUIRE_MESSAGE(
      eventually([&] { return fs::exists(listing) && fs::file_size(listing) > 0; }, 20s),
      listing.string());
  std::this_thread::sleep_for(100ms);  // the launcher writes it in one go, right after spawning
  for (const auto& w : nlohmann::json::parse(slurp(listing)))
    pids.push_back(w.at("pid").get<pid_t>());
  return pids;
}

}  // namespace

TEST_CASE("launch --help documents every option, the environment, Slurm and the exit codes") {
  scratch_dir tmp("launch_help");
  auto l = start_troupe(tmp.path, "help", {"launch", "--help"});
  REQUIRE(l->wait(20s) == 0);
  const auto out = l->stdout_text();
  for (const char* part :
       {"--worker_num", "--local_worker_num", "--master_addr", "--master_port", "--node_rank",
        "--log_dir", "--rdzv_timeout", "--grace", "--set", "--resume", "--steps",
        "TROUPE_JOB_TOKEN", "TROUPE_RANK", "SLURM_NODEID", "SLURM_JOB_NUM_NODES",
        "SLURM_LAUNCH_NODE_IPADDR", "MASTER_PORT", "workers.json", "Exit status"})
    CHECK_MESSAGE(contains(out, part), part);
}

TEST_CASE(
    "a --worker_num that is not the config's product exits 2 naming the sizes, and starts "
    "nothing") {
  scratch_dir tmp("launch_worker_num");
  auto job = write_config(tmp, 2, 1, 2);
  auto l = start_troupe(
      tmp.path, "bad_n",
      {"launch", "--worker_num", "3", "--master_port", std::to_string(free_port()), job.path});
  REQUIRE(l->wait(20s).has_value());
  CHECK(*l->code == 2);
  const auto err = l->stderr_text();
  CHECK(contains(err, "troupe: error: " + job.path));
  CHECK(contains(err, "--worker_num 3 does not match the config"));
  CHECK(contains(err,
                 "parallel.data_parallel 1 x parallel.model_parallel 1 x "
                 "parallel.pipeline_stage 2 = 2 workers"));
  CHECK(contains(err, "pass --worker_num 2"));
  CHECK_FALSE(fs::exists(job.run_dir));  // no log directory, no run directory
}

TEST_CASE(
    "launch refuses a layout that does not split into nodes (or srun tasks), a node_rank outside "
    "them, a multi-node job without a token and a malformed TROUPE_PERTURB_SEND or TROUPE_FAULT, "
    "before starting anything") {
  scratch_dir tmp("launch_usage");
  auto job = write_config(tmp, 2, 2, 2);  // 4 workers
  const std::string port = std::to_string(free_port());
  struct bad_case {
    std::vector<std::string> args;
    std::vector<std::string> env;
    std::string says;
  };
  const std::vector<bad_case> cases = {
      {{"--worker_num", "4", "--local_worker_num", "3"},
       {},
       "--worker_num 4 is not a multiple of --local_worker_num 3"},
      {{"--worker_num", "4", "--local_worker_num", "2", "--node_rank", "2"},
       {"TROUPE_JOB_TOKEN=t"},
       "--node_rank 2 is outside 0..1"},
      {{"--worker_num", "4", "--local_worker_num", "2"}, {}, "TROUPE_JOB_TOKEN is not set"},
      {{"--worker_num", "4"}, {"SLURM_JOB_NUM_NODES=3"}, "do not split over Slurm's 3 nodes"},
      // Inside an srun step each task is a launcher: 3 tasks cannot share 4 workers either.
      {{"--worker_num", "4"},
       {"SLURM_JOB_NUM_NODES=1", "SLURM_STEP_NUM_TASKS=3", "SLURM_PROCID=1"},
       "do not split over Slurm's 3 nodes"},
      {{}, {"TROUPE_PERTURB_SEND=3:x:1SEND_B2->0"}, "TROUPE_PERTURB_SEND='3:x:1SEND_B2->0' is not rank:step:instruction"},
      {{}, {"TROUPE_FAULT=melt:1:2"}, "TROUPE_FAULT='melt:1:2' names no known fault 'melt'"},
      {{}, {"TROUPE_FAULT=slow:1:0.5"}, "TROUPE_FAULT='slow:1:0.5' is not slow:RANK:FACTOR"},
      {{}, {"TROUPE_FAULT=drop:4:1"}, "TROUPE_FAULT=drop:4:1 names rank 4 in a job of 4 workers"},
      {{}, {"TROUPE_FAULT=poison:1:100000"}, "TROUPE_FAULT=poison:1:100000 names global sequence 100000 of a step of "},
      {{}, {"TROUPE_FAULT=kill:1:x"}, "TROUPE_FAULT='kill:1:x' is not kill:RANK:STEP[:ATTEMPT]"},
      {{}, {"TROUPE_FAULT=kill:1:2,drop:0:3"}, "names two faults for attempt 0 (kill:1:2 and drop:0:3)"},
      {{}, {"TROUPE_FAULT=kill:1:2,kill:5:3:1"}, "TROUPE_FAULT=kill:5:3:1 names rank 5 in a job of 4 workers"},
      {{"--max-restarts", "1"}, {"TROUPE_FAULT=kill:1:2:2"},
       "TROUPE_FAULT=kill:1:2:2 fires in attempt 2, but --max-restarts 1 allows attempts 0 .. 1"},
  };
  int i = 0;
  for (const auto& c : cases) {
    CAPTURE(c.says);
    std::vector<std::string> args = {"launch", "--master_port", port};
    args.insert(args.end(), c.args.begin(), c.args.end());
    args.push_back(job.path);
    auto l = start_troupe(tmp.path, "usage" + std::to_string(i++), args, c.env);
    REQUIRE(l->wait(20s).has_value());
    CHECK(*l->code == 2);
    CHECK(contains(l->stderr_text(), c.says));
    CHECK_FALSE(fs::exists(job.run_dir));
  }
}

TEST_CASE("a master port already in use exits 1 naming the port, and starts no worker") {
  scratch_dir tmp("launch_port");
  auto job = write_config(tmp, 2, 1, 2);
  listener taken;
  auto l = start_troupe(tmp.path, "port",
                        {"launch", "--master_port", std::to_string(taken.port), job.path});
  REQUIRE(l->wait(20s).has_value());
  CHECK(*l->code == 1);
  const auto err = l->stderr_text();
  CHECK(contains(err, "port " + std::to_string(taken.port) + " on 127.0.0.1 is already in use"));
  CHECK(contains(err, "--master_port"));
  CHECK_FALSE(fs::exists(fs::path(job.run_dir) / "logs" / "workers.json"));
}

TEST_CASE(
    "a node that never arrives: the rendezvous time-out names its ranks, and the launch "
    "ends non-zero well before 30 s") {
  scratch_dir tmp("launch_missing");
  auto job = write_config(tmp, 2, 2, 2);  // 4 workers: node 0 (ranks 0-1) and node 1 (ranks 2-3)
  auto l =
      start_troupe(tmp.path, "node0",
                   {"launch", "--worker_num", "4", "--local_worker_num", "2", "--node_rank", "0",
                    "--master_port", std::to_string(free_port()), "--rdzv_timeout", "3", job.path},
                   {"TROUPE_JOB_TOKEN=missing-node-test"});
  const auto code = l->wait(60s);
  REQUIRE_MESSAGE(code.has_value(), "the launcher was still running after 60 s");
  CHECK(*code != 0);
  CHECK(l->seconds() < 25);
  const auto err = l->stderr_text();
  CHECK_MESSAGE(contains(err, "timed out after 3000 ms with 2 of 4 workers registered"), err);
  CHECK_MESSAGE(contains(err, "node 1 (ranks 2-3; none of its workers arrived)"), err);
  // The workers were told too, and say so in their logs.
  for (int r : {0, 1})
    CHECK(contains(slurp(fs::path(job.run_dir) / "logs" / ("worker_" + std::to_string(r) + ".log")),
                   "none of its workers arrived"));
}

TEST_CASE(
    "strangers at the rendezvous port (garbage, an oversized frame, no token) are refused "
    "and logged while a two-node job forms, and the job completes") {
  scratch_dir tmp("launch_stranger");
  auto job = write_config(tmp, 2, 1, 3);  // 2 workers, one per "node"
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> token = {"TROUPE_JOB_TOKEN=stranger-test-token"};
  auto node = [&](int n) {
    return std::vector<std::string>{
        "launch",          "--worker_num",  "2",  "--local_worker_num", "1",  "--node_rank",
        std::to_string(n), "--master_port", port, "--rdzv_timeout",     "60", job.path};
  };
  auto node0 = start_troupe(tmp.path, "node0", node(0), token);
  // Node 0's worker has registered; the job waits for node 1's.
  const auto worker0_log = fs::path(job.run_dir) / "logs" / "worker_0.log";
  REQUIRE_MESSAGE(eventually([&] { return contains(node0->stderr_text(), "(1 of 2)"); }, 30s),
                  node0->stderr_text());

  int garbage = connect_to(std::stoi(port));
  REQUIRE(garbage >= 0);
  const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  REQUIRE(::write(garbage, junk.data(), junk.size()) == static_cast<ssize_t>(junk.size()));
  // A rendezvous header announcing a 2 GiB body: refused before anything is allocated.
  int oversized = connect_to(std::stoi(port));
  REQUIRE(oversized >= 0);
  const unsigned char header[12] = {'T', 'R', 'R', 'V', 1, 0, 1, 0, 0, 0, 0, 0x80};
  REQUIRE(::write(oversized, header, sizeof header) == static_cast<ssize_t>(sizeof header));
  // A worker-like client that does not know the job token, claiming node 1's slot.
  troupe::transport::rendezvous_client_options tokenless;
  tokenless.master = {"127.0.0.1", static_cast<std::uint16_t>(std::stoi(port))};
  tokenless.job_token = "";
  tokenless.node_rank = 1;
  tokenless.local_rank = 0;
  tokenless.timeout = 10s;
  auto refused = troupe::transport::rendezvous_client::join(tokenless);
  REQUIRE_FALSE(refused.ok());
  CHECK(contains(refused.err().to_string(), "wrong job token"));
  ::close(garbage);
  ::close(oversized);

  auto node1 = start_troupe(tmp.path, "node1", node(1), token);
  const auto c1 = node1->wait(120s);
  const auto c0 = node0->wait(30s);
  REQUIRE_MESSAGE(c1.has_value(), "node 1's launcher did not finish");
  REQUIRE_MESSAGE(c0.has_value(), "node 0's launcher did not finish");
  CHECK_MESSAGE(*c0 == 0, node0->stderr_text(), slurp(worker0_log));
  CHECK_MESSAGE(*c1 == 0, node1->stderr_text());
  // All 3 steps were trained.
  const auto metrics = slurp(fs::path(job.run_dir) / "metrics.jsonl");
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 3);
  const auto err0 = node0->stderr_text();
  CHECK(contains(err0, "refused a connection from 127.0.0.1:"));
  CHECK(contains(err0, "bad magic"));
  CHECK(contains(err0, "a frame of 2147483648 bytes, over the limit"));
  CHECK(contains(err0, "refused a worker from 127.0.0.1:"));
  CHECK(contains(err0, "wrong job token"));
  // Each node lists its own workers; two nodes sharing a run directory do not overwrite them.
  CHECK(fs::exists(fs::path(job.run_dir) / "logs" / "workers_node0.json"));
  CHECK(fs::exists(fs::path(job.run_dir) / "logs" / "workers_node1.json"));
}

TEST_CASE(
    "a worker killed by SIGKILL is named with pid and signal; one that does not stop gets "
    "SIGTERM after --grace and SIGKILL 5 s later; the launcher exits 137") {
  scratch_dir tmp("launch_kill");
  auto job = write_config(tmp, 2, 1, 100000);  // runs until killed
  auto l = start_troupe(
      tmp.path, "kill",
      {"launch", "--master_port", std::to_string(free_port()), "--grace", "2", job.path});
  auto pids = worker_pids(fs::path(job.run_dir) / "logs" / "workers.json");
  REQUIRE(pids.size() == 2);
  REQUIRE_MESSAGE(
      eventually([&] { return fs::exists(fs::path(job.run_dir) / "metrics.jsonl"); }, 60s),
      l->stdout_text(), l->stderr_text());
  // Rank 0 stands for a worker that hangs: stopped, it acts on no signal but SIGKILL.
  REQUIRE(::kill(pids[0], SIGSTOP) == 0);
  REQUIRE(::kill(pids[1], SIGKILL) == 0);
  const auto code = l->wait(60s);
  REQUIRE_MESSAGE(code.has_value(), "the launcher was still running 60 s after the kill");
  CHECK(*code == 137);
  const auto err = l->stderr_text();
  CHECK_MESSAGE(
      contains(err, "troupe launch: worker rank 1 (pid " + std::to_string(pids[1]) + ", host "),
      err);
  CHECK(contains(err, ") was killed by signal 9 (SIGKILL)\n"));
  CHECK(contains(err, "rank 0 still running 2 s after worker rank 1 failed; sending SIGTERM"));
  CHECK(contains(err, "rank 0 still running 5 s after SIGTERM; sending SIGKILL"));
  CHECK(contains(err, "troupe launch: worker rank 0 (pid " + std::to_string(pids[0]) + ", host "));
  CHECK(contains(err, ") was killed by signal 9 (SIGKILL) (stopped by the launcher)"));
  CHECK(contains(err, "worker_1.log (rank 1, was killed by signal 9 (SIGKILL))"));
  CHECK(contains(err, "worker_0.log (rank 0, was killed by signal 9 (SIGKILL))"));
  CHECK_FALSE(alive(pids[0]));
}

TEST_CASE(
    "SIGTERM to the launcher is forwarded to every worker, nothing outlives it, and it exits 143") {
  scratch_dir tmp("launch_term");
  auto job = write_config(tmp, 2, 1, 100000);
  auto l = start_troupe(
      tmp.path, "term",
      {"launch", "--master_port", std::to_string(free_port()), "--grace", "2", job.path});
  auto pids = worker_pids(fs::path(job.run_dir) / "logs" / "workers.json");
  REQUIRE(pids.size() == 2);
  REQUIRE(::kill(l->pid, SIGTERM) == 0);
  const auto code = l->wait(60s);
  REQUIRE_MESSAGE(code.has_value(), "the launcher was still running 60 s after SIGTERM");
  CHECK(*code == 128 + SIGTERM);
  CHECK(contains(l->stderr_text(), "received SIGTERM; forwarded it to the workers"));
  for (pid_t p : pids) CHECK_FALSE(alive(p));
}

TEST_CASE(
    "a token id outside the vocabulary in the validation shard stops `troupe train` and `troupe "
    "launch` with a non-zero exit, naming the shard file and the token") {
  scratch_dir tmp("launch_val_token");
  auto job = write_config(tmp, 2, 1, 2);  // validation after the last step
  const std::string val = tmp / "val.bin";
  REQUIRE(troupe::model::write_shard(val, std::vector<std::uint16_t>(4000, 99)).ok());

  auto t = start_troupe(tmp.path, "train", {"train", job.path});
  const auto tc = t->wait(120s);
  REQUIRE_MESSAGE(tc.has_value(), "troupe train was still running after 120 s");
  CHECK(*tc == 1);
  const auto terr = t->stderr_text();
  CHECK_MESSAGE(contains(terr, "coordinator (rank 0) at step 1, instruction evaluation failed: "
                               "token id 99"),
                terr);
  CHECK_MESSAGE(contains(terr, val), terr);

  auto l = start_troupe(tmp.path, "launch",
                        {"launch", "--master_port", std::to_string(free_port()), "--grace", "2",
                         "--log_dir", tmp / "launch_logs", job.path});
  const auto lc = l->wait(120s);
  REQUIRE_MESSAGE(lc.has_value(), "troupe launch was still running after 120 s");
  CHECK(*lc != 0);
  const auto worker0 = slurp(tmp.path / "launch_logs" / "worker_0.log");
  CHECK_MESSAGE(contains(worker0, "instruction evaluation failed: token id 99"), worker0);
  CHECK_MESSAGE(contains(worker0, val), worker0);
  // Worker 1 learns from worker 0 how the job ended, and stops too.
  const auto worker1 = slurp(tmp.path / "launch_logs" / "worker_1.log");
  CHECK_MESSAGE(contains(worker1, "token id 99"), worker1);
}
