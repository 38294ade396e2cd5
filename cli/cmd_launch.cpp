// `troupe launch [options] CONFIG [--set key=value]... [--resume RUN_DIR|CKPT] [--steps N]`:
// starts this node's worker processes (`troupe worker`), one per GPU or CPU rank, like torchrun or
// msrun. Node 0's launcher also serves the rendezvous at master_addr:master_port where every
// worker of the job registers (transport/rendezvous.hpp). Everything that can be checked is
// checked before anything is started; then the launcher supervises: it forwards signals, follows
// local rank 0's log, reports each worker that fails, stops the rest when they do not stop by
// themselves, and exits with the job's code. docs/launch.md is the user's guide.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <fmt/format.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actors/perturb.hpp"
#include "cli/command.hpp"
#include "cli/launch_workers.hpp"
#include "cli/plan_check.hpp"
#include "core/config.hpp"
#include "core/fault.hpp"
#include "core/machine.hpp"
#include "model/checkpoint.hpp"
#include "runtime/preflight.hpp"
#include "transport/rendezvous.hpp"

namespace troupe::cli {
namespace {

namespace fs = std::filesystem;

constexpr int usage_error = 2;

struct launch_args {
  int worker_num = 0;
  int local_worker_num = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int node_rank = 0;
  std::string log_dir;
  double rdzv_timeout = 300;
  double grace = 30;
  std::string config;
  std::vector<std::string> sets;
  std::string resume;
  std::string init;
  int steps = -1;
  int max_restarts = 0;
  std::string device_memory;  // for the plan check (cli/plan_check.hpp)
  bool no_plan_check = false;
  // Which options were given on the command line (those win over Slurm's variables).
  CLI::Option* worker_num_opt = nullptr;
  CLI::Option* local_worker_num_opt = nullptr;
  CLI::Option* master_addr_opt = nullptr;
  CLI::Option* master_port_opt = nullptr;
  CLI::Option* node_rank_opt = nullptr;
};

/// The resolved layout of this launch.
struct launch_plan {
  int worker_num = 0;
  int local_worker_num = 0;
  int nodes = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 0;
  std::string log_dir;
  std::string job_token;
};

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

core::result<int> env_int(const char* name, long lo, long hi) {
  const char* v = env(name);
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || n < lo || n > hi)
    return core::error::make(std::string("environment variable ") + name + "='" + v +
                                 "' is not a number in " + std::to_string(lo) + ".." +
                                 std::to_string(hi),
                             std::string("unset ") + name + " or pass the matching option");
  return static_cast<int>(n);
}

// Slurm's (and the usual MASTER_ADDR / MASTER_PORT) variables, for the options not given.
// Inside an srun step every task is one launcher, a "node" of the job: SLURM_STEP_NUM_TASKS
// launchers, this one number SLURM_PROCID. With one task per node (the usual) those are the
// allocation's nodes and SLURM_NODEID; several tasks per node split a node between launchers.
// Outside a step (the batch script itself) only SLURM_JOB_NUM_NODES and SLURM_NODEID are known.
// Returns the note printed about which values came from where.
core::result<std::string> apply_environment(launch_args& a, std::optional<int>& nodes) {
  std::string note;
  auto add = [&note](const std::string& what) { note += (note.empty() ? "" : ", ") + what; };
  const bool in_step = env("SLURM_STEP_NUM_TASKS") && env("SLURM_PROCID");
  const char* count_var = in_step ? "SLURM_STEP_NUM_TASKS" : "SLURM_JOB_NUM_NODES";
  const char* rank_var = in_step ? "SLURM_PROCID" : "SLURM_NODEID";
  if (env(count_var)) {
    auto n = env_int(count_var, 1, 1 << 20);
    if (!n) return n.err();
    nodes = n.value();
    add(std::to_string(n.value()) + (in_step ? " launcher" : " node") +
        (n.value() == 1 ? "" : "s") + " (" + count_var + ")");
  }
  if (!a.node_rank_opt->count() && env(rank_var)) {
    auto r = env_int(rank_var, 0, 1 << 20);
    if (!r) return r.err();
    a.node_rank = r.value();
    add("node_rank " + std::to_string(a.node_rank) + " (" + rank_var + ")");
  }
  if (!a.master_addr_opt->count()) {
    for (const char* name : {"MASTER_ADDR", "SLURM_LAUNCH_NODE_IPADDR"}) {
      if (!env(name)) continue;
      a.master_addr = env(name);
      add("master_addr " + a.master_addr + " (" + name + ")");
      break;
    }
  }
  if (!a.master_port_opt->count() && env("MASTER_PORT")) {
    auto p = env_int("MASTER_PORT", 1, 65535);
    if (!p) return p.err();
    a.master_port = p.value();
    add("master_port " + std::to_string(a.master_port) + " (MASTER_PORT)");
  }
  return note;
}

std::string random_token() {
  std::random_device rd;
  char hex[33];
  for (int i = 0; i < 4; ++i) std::snprintf(hex + 8 * i, 9, "%08x", static_cast<unsigned>(rd()));
  return std::string(hex, 32);
}

// Everything checked before anything starts; a usage error comes back as the message to print.
core::result<launch_plan> make_plan(launch_args& a, const core::config& cfg) {
  const auto& par = cfg.parallel;
  const int product = par.data_parallel * par.model_parallel * par.pipeline_stage;
  std::optional<int> slurm_nodes;
  auto note = apply_environment(a, slurm_nodes);
  if (!note) return note.err();
  if (!note.value().empty())
    std::printf("troupe launch: from the environment: %s\n", note->c_str());

  launch_plan p;
  const bool n_given = a.worker_num_opt->count() > 0, l_given = a.local_worker_num_opt->count() > 0;
  const int nodes = slurm_nodes.value_or(1);
  if (n_given && l_given) {
    p.worker_num = a.worker_num;
    p.local_worker_num = a.local_worker_num;
  } else if (n_given) {
    p.worker_num = a.worker_num;
    p.local_worker_num = a.worker_num % nodes == 0 ? a.worker_num / nodes : a.worker_num;
  } else if (l_given) {
    p.local_worker_num = a.local_worker_num;
    p.worker_num = nodes * a.local_worker_num;
  } else {
    p.worker_num = product;
    p.local_worker_num = product % nodes == 0 ? product / nodes : product;
  }

  const std::string src = a.config;
  if (p.worker_num != product) {
    const std::string how = n_given ? "--worker_num " + std::to_string(p.worker_num)
                                    : std::to_string(p.worker_num) + " workers (" +
                                          std::to_string(nodes) + " node" +
                                          (nodes == 1 ? "" : "s") + " x --local_worker_num " +
                                          std::to_string(p.local_worker_num) + ")";
    return core::error::at_file(
        src,
        how + " does not match the config: parallel.data_parallel " +
            std::to_string(par.data_parallel) + " x parallel.model_parallel " +
            std::to_string(par.model_parallel) + " x parallel.pipeline_stage " +
            std::to_string(par.pipeline_stage) + " = " + std::to_string(product) + " workers",
        "pass --worker_num " + std::to_string(product) +
            ", or change parallel.* in the config (or with --set parallel.data_parallel=...)");
  }
  if (p.worker_num % p.local_worker_num != 0)
    return core::error::make(
        "--worker_num " + std::to_string(p.worker_num) +
            " is not a multiple of --local_worker_num " + std::to_string(p.local_worker_num) +
            ": the job must split into whole nodes",
        "every node runs the same number of workers; pick a --local_worker_num that divides " +
            std::to_string(p.worker_num));
  p.nodes = p.worker_num / p.local_worker_num;
  if (slurm_nodes && *slurm_nodes != p.nodes && !l_given)
    return core::error::make(std::to_string(p.worker_num) + " workers do not split over Slurm's " +
                                 std::to_string(*slurm_nodes) + " nodes (or srun tasks)",
                             "pass --local_worker_num (workers per node) explicitly");
  if (a.node_rank < 0 || a.node_rank >= p.nodes)
    return core::error::make(
        "--node_rank " + std::to_string(a.node_rank) + " is outside 0.." +
            std::to_string(p.nodes - 1) + " (" + std::to_string(p.worker_num) + " workers, " +
            std::to_string(p.local_worker_num) + " per node = " + std::to_string(p.nodes) +
            " node" + (p.nodes == 1 ? "" : "s") + ")",
        "number the nodes 0 to " + std::to_string(p.nodes - 1) + "; node 0 runs the rendezvous");
  p.node_rank = a.node_rank;
  p.master_addr = a.master_addr;
  p.master_port = a.master_port;
  p.log_dir = a.log_dir.empty() ? (fs::path(cfg.runtime.run_dir) / "logs").string() : a.log_dir;
  p.log_dir = fs::absolute(p.log_dir).lexically_normal().string();

  if (const char* tok = env("TROUPE_JOB_TOKEN")) {
    p.job_token = tok;
  } else if (p.nodes == 1) {
    p.job_token = random_token();
  } else {
    return core::error::make(
        "a job over " + std::to_string(p.nodes) +
            " nodes needs the same job token on every node, and TROUPE_JOB_TOKEN is not set",
        "export TROUPE_JOB_TOKEN=<the same random string> on every node before starting its "
        "launcher, e.g. TROUPE_JOB_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \\n')");
  }
  return p;
}

// The rendezvous server of node 0 and the thread that waits for its outcome.
struct rendezvous_watch {
  std::unique_ptr<transport::rendezvous_server> server;
  std::thread waiter;
  std::mutex mu;
  std::optional<core::result<transport::job_table>> outcome;
  bool reported = false;
  std::string last_logged;
};

// Ends the launch with `code`. server.wait() cannot be cancelled: when the rendezvous has not
// decided yet (every local worker ended before the job formed, or none was started), the process
// exits without running destructors, rather than destroying the server under the thread that
// waits on it while its IO thread still runs.
int finish(rendezvous_watch* rdzv, int code) {
  bool decided;
  {
    std::lock_guard<std::mutex> lk(rdzv->mu);
    decided = rdzv->outcome.has_value() || !rdzv->server;
  }
  if (!decided) {
    std::fflush(nullptr);
    std::_Exit(code);
  }
  if (rdzv->waiter.joinable()) rdzv->waiter.join();
  rdzv->server.reset();  // its IO thread may still log, which takes rdzv->mu
  delete rdzv;
  return code;
}

std::string rank_range(int first, int count) {
  return count == 1 ? "rank " + std::to_string(first)
                    : "ranks " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

// A duration option in seconds that becomes whole milliseconds: finite, at least 1 ms, and at
// most what a worker reads back from TROUPE_RDZV_TIMEOUT_MS (2^30 ms, about 12 days).
core::status check_seconds(const char* option, double s, bool zero_ok) {
  constexpr double most = double(1 << 30) / 1000;
  if (std::isfinite(s) && (zero_ok ? s >= 0 : s >= 0.001) && s <= most) return {};
  return core::error::make(std::string(option) + " " + fmt::format("{}", s) +
                               " is not a number of seconds in " + (zero_ok ? "0" : "0.001") +
                               ".." + fmt::format("{}", most),
                           std::string("pass a finite number of seconds, e.g. ") + option +
                               (zero_ok ? " 30" : " 300"));
}

// How one attempt of the job ended.
struct round_outcome {
  int code = 0;
  std::string cause;       // what failed first
  bool interrupted = false;  // the launcher received SIGINT/SIGTERM first
  bool formed = false;     // the rendezvous formed the job (every worker joined)
  rendezvous_watch* rdzv = nullptr;

  /// Releases the round's rendezvous (finish() above) and returns `code`.
  int finish(int c) {
    rendezvous_watch* w = rdzv;
    rdzv = nullptr;
    return w ? cli::finish(w, c) : c;
  }
};

// One attempt: serves the rendezvous (node 0), starts this node's workers and supervises them.
// Attempt `round` > 0 runs under a job token of its own, so a worker of an earlier attempt can
// never join it, and tells its workers how many restarts came before (TROUPE_RESTARTS).
round_outcome run_round(const launch_args& a, const launch_plan& p, int first_rank, int round,
                        const std::string& resume) {
  round_outcome out;
  const std::string token = round == 0 ? p.job_token : p.job_token + ".r" + std::to_string(round);
  // Node 0 serves the rendezvous; bound before any worker exists, so a port in use starts nothing.
  auto* rdzv = new rendezvous_watch;
  if (p.node_rank == 0) {
    transport::rendezvous_server_options so;
    so.listen = {p.master_addr, static_cast<std::uint16_t>(p.master_port)};
    so.job_token = token;
    so.world_size = p.worker_num;
    so.local_world_size = p.local_worker_num;
    so.timeout = std::chrono::milliseconds(std::llround(a.rdzv_timeout * 1000));
    so.log = [rdzv](const std::string& line) {
      std::lock_guard<std::mutex> lk(rdzv->mu);
      rdzv->last_logged = line;
      std::fprintf(stderr, "troupe launch: %s\n", line.c_str());
    };
    auto server = transport::rendezvous_server::bind(std::move(so));
    if (!server) {
      print_error(server.err().to_string());
      delete rdzv;
      out.code = 1;
      out.cause = server.err().message;
      return out;
    }
    rdzv->server = std::move(server.value());
    rdzv->waiter = std::thread([rdzv] {
      auto r = rdzv->server->wait();
      std::lock_guard<std::mutex> lk(rdzv->mu);
      rdzv->outcome = std::move(r);
    });
  }
  out.rdzv = rdzv;

  std::vector<launch::worker_spec> specs;
  for (int l = 0; l < p.local_worker_num; ++l) {
    launch::worker_spec s;
    s.local_rank = l;
    s.node_rank = p.node_rank;
    s.rank = first_rank + l;
    s.log = (fs::path(p.log_dir) / ("worker_" + std::to_string(s.rank) + ".log")).string();
    s.env = {"TROUPE_MASTER_ADDR=" + p.master_addr,
             "TROUPE_MASTER_PORT=" + std::to_string(p.master_port),
             "TROUPE_WORKER_NUM=" + std::to_string(p.worker_num),
             "TROUPE_LOCAL_WORKER_NUM=" + std::to_string(p.local_worker_num),
             "TROUPE_NODE_RANK=" + std::to_string(p.node_rank),
             "TROUPE_LOCAL_RANK=" + std::to_string(l),
             "TROUPE_RANK=" + std::to_string(s.rank),
             "TROUPE_JOB_TOKEN=" + token,
             "TROUPE_RDZV_TIMEOUT_MS=" + std::to_string(std::llround(a.rdzv_timeout * 1000)),
             "TROUPE_RESTARTS=" + std::to_string(round)};
    specs.push_back(std::move(s));
  }
  std::vector<std::string> argv = {"troupe", "worker", fs::absolute(a.config).string()};
  for (const auto& s : a.sets) argv.insert(argv.end(), {"--set", s});
  if (!resume.empty()) argv.insert(argv.end(), {"--resume", resume});
  if (a.steps >= 0) argv.insert(argv.end(), {"--steps", std::to_string(a.steps)});

  std::printf("troupe launch: node %d of %d, %s of %d; rendezvous at %s:%d%s; logs in %s\n",
              p.node_rank, p.nodes, rank_range(first_rank, p.local_worker_num).c_str(),
              p.worker_num, p.master_addr.c_str(), p.master_port,
              p.node_rank == 0 ? " (served here)" : "", p.log_dir.c_str());
  std::fflush(stdout);

  auto group = launch::worker_group::spawn("/proc/self/exe", argv, specs);
  if (!group) {
    print_error(group.err().to_string());
    out.code = 1;
    out.cause = group.err().message;
    return out;
  }

  std::string listing = "[";
  for (const auto& w : group->workers()) {
    nlohmann::ordered_json row = {{"rank", w.spec.rank},
                                  {"local_rank", w.spec.local_rank},
                                  {"node_rank", w.spec.node_rank},
                                  {"pid", w.pid},
                                  {"log", w.spec.log}};
    listing += (listing.size() > 1 ? ",\n " : "") + row.dump();
  }
  listing += "]";
  // Nodes may share the log directory (one run directory on a shared file system).
  const std::string listing_path =
      (fs::path(p.log_dir) / (p.nodes == 1
                                  ? std::string("workers.json")
                                  : "workers_node" + std::to_string(p.node_rank) + ".json"))
          .string();
  if (!(std::ofstream(listing_path) << listing << '\n'))
    std::fprintf(stderr, "troupe launch: warning: cannot write %s\n", listing_path.c_str());

  launch::supervise_options so;
  so.grace = std::chrono::milliseconds(std::llround(a.grace * 1000));
  so.job_failed = [rdzv]() -> std::optional<core::error> {
    std::lock_guard<std::mutex> lk(rdzv->mu);
    if (rdzv->reported || !rdzv->outcome || rdzv->outcome->ok()) return std::nullopt;
    rdzv->reported = true;
    return rdzv->outcome->err();
  };
  so.report_job_failure = [rdzv](const core::error& e) {
    std::string logged;
    {
      std::lock_guard<std::mutex> lk(rdzv->mu);
      logged = rdzv->last_logged;
    }
    // The rendezvous logs its failure as it happens; repeat only the hint then.
    if (logged == e.message)
      std::fprintf(stderr, "troupe launch: hint: %s\n", e.hint.c_str());
    else
      print_error(e.to_string());
  };
  out.code = group->supervise(so);
  out.cause = group->first_failure();
  out.interrupted = group->interrupted();
  {
    // Node 0 knows whether the job formed; the other nodes assume it did when a worker ran at
    // all (their workers fail fast when it could not form).
    std::lock_guard<std::mutex> lk(rdzv->mu);
    out.formed = rdzv->server ? (rdzv->outcome && rdzv->outcome->ok()) : true;
  }
  return out;
}

int run_launch(launch_args& a) {
  const auto started = std::chrono::steady_clock::now();
  for (auto st : {check_seconds("--rdzv_timeout", a.rdzv_timeout, false),
                  check_seconds("--grace", a.grace, true)})
    if (!st) {
      print_error(st.err().to_string());
      return usage_error;
    }
  auto cfg = core::load_config(a.config, a.sets);
  if (!cfg) {
    print_error(cfg.err().to_string());
    return usage_error;
  }
  if (auto st = actors::preflight(cfg.value()); !st) {
    print_error(st.err().to_string());
    return usage_error;
  }
  if (const char* spec = env("TROUPE_PERTURB_SEND")) {  // read by the workers; checked here first
    if (auto p = actors::parse_perturbation(spec, "TROUPE_PERTURB_SEND"); !p) {
      print_error(p.err().to_string());
      return usage_error;
    }
  }
  auto fault = core::fault_from_env();  // read by the workers; checked here first
  if (!fault) {
    print_error(fault.err().to_string());
    return usage_error;
  }
  if (!a.no_plan_check)
    if (int rc = check_plan(cfg.value(), a.device_memory, true)) return rc;
  auto planned = make_plan(a, cfg.value());
  if (!planned) {
    print_error(planned.err().to_string());
    return usage_error;
  }
  const launch_plan& p = planned.value();
  for (const auto& f : fault.value()) {
    if (f.rank >= p.worker_num) {
      print_error(core::error::make(f.label() + " names rank " + std::to_string(f.rank) +
                                        " in a job of " + std::to_string(p.worker_num) + " workers",
                                    "test only; ranks are 0 .. --worker_num - 1 (docs/faults.md)")
                      .to_string());
      return usage_error;
    }
    if (f.attempt > a.max_restarts) {
      print_error(core::error::make(f.label() + " fires in attempt " + std::to_string(f.attempt) +
                                        ", but --max-restarts " + std::to_string(a.max_restarts) +
                                        " allows attempts 0 .. " + std::to_string(a.max_restarts),
                                    "test only; raise --max-restarts or lower the fault's ATTEMPT "
                                    "(docs/faults.md)")
                      .to_string());
      return usage_error;
    }
    if (f.kind == core::fault_kind::poison) {
      const auto& par = cfg.value().parallel;
      const std::int64_t sequences = static_cast<std::int64_t>(par.data_parallel) *
                                     par.micro_batch_num *
                                     cfg.value().train.gradient_accumulation_steps *
                                     par.micro_batch_size;
      if (f.sequence >= sequences) {
        print_error(core::error::make(f.label() + " names global sequence " +
                                          std::to_string(f.sequence) + " of a step of " +
                                          std::to_string(sequences) + " sequences",
                                      "test only; sequences are 0 .. data_parallel x "
                                      "micro_batch_num x gradient_accumulation_steps x "
                                      "micro_batch_size - 1 (docs/faults.md)")
                        .to_string());
        return usage_error;
      }
    }
  }
  if (auto st = core::check_local_workers(
          cfg.value(), p.local_worker_num, true,
          std::to_string(p.local_worker_num) + " workers on this node (--local_worker_num)");
      !st) {
    print_error(st.err().to_string());
    return usage_error;
  }
  const int first_rank = p.node_rank * p.local_worker_num;
  if (a.max_restarts > 0 && a.steps >= 0) {
    print_error(core::error::make("--steps cannot be combined with --max-restarts: after a "
                                  "restart the steps of 'this invocation' would be counted again",
                                  "set train.steps (e.g. --set train.steps=N) instead")
                    .to_string());
    return usage_error;
  }

  // The log directory first: a launch that cannot write its logs starts nothing.
  std::error_code ec;
  fs::create_directories(p.log_dir, ec);
  if (ec) {
    print_error(core::error::at_file(p.log_dir, "cannot create the log directory: " + ec.message(),
                                     "pass a writable --log_dir")
                    .to_string());
    return 1;
  }
  const std::string ckpt_root = cfg->checkpoint.dir.empty()
                                    ? (fs::path(cfg->runtime.run_dir) / "checkpoints").string()
                                    : cfg->checkpoint.dir;
  launch::install_signal_handlers();

  std::string resume = a.resume;
  for (int round = 0;; ++round) {
    round_outcome r = run_round(a, p, first_rank, round, resume);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (r.code == 0) {
      std::printf("troupe launch: all %d worker%s of node %d exited with code 0 (%.1f s%s)\n",
                  p.local_worker_num, p.local_worker_num == 1 ? "" : "s", p.node_rank, secs,
                  round == 0 ? ""
                             : fmt::format(", {} restart{}", round, round == 1 ? "" : "s").c_str());
      return r.finish(0);
    }
    // Restart from the last complete checkpoint, unless the user stopped the job, the job
    // never formed (nothing ran: a restart would fail the same way), or restarts are used up.
    std::string why_not;
    if (round >= a.max_restarts)
      why_not = a.max_restarts == 0 ? "" : "no restarts left (--max-restarts " +
                                               std::to_string(a.max_restarts) + ")";
    else if (r.interrupted)
      why_not = "the launcher was stopped by a signal";
    else if (!r.formed)
      why_not = "the job never formed";
    if (round >= a.max_restarts || r.interrupted || !r.formed) {
      if (!why_not.empty()) std::fprintf(stderr, "troupe launch: not restarting: %s\n", why_not.c_str());
      std::fprintf(stderr,
                   "troupe launch: the job failed (exit code %d) after %.1f s%s; worker logs in "
                   "%s\n",
                   r.code, secs,
                   round == 0 ? ""
                              : fmt::format(" and {} restart{}", round, round == 1 ? "" : "s")
                                    .c_str(),
                   p.log_dir.c_str());
      return r.finish(r.code);
    }
    r.finish(r.code);
    auto from = model::checkpoint::resolve(ckpt_root);
    std::string from_text;
    if (from) {
      resume = ckpt_root;
      from_text = "the last checkpoint under " + ckpt_root;
    } else {
      from_text = a.resume.empty() ? std::string("step 0 (no checkpoint written yet)")
                                   : "--resume " + a.resume + " (no newer checkpoint written)";
    }
    std::fprintf(stderr, "troupe launch: restart %d of %d after %.1f s: %s; restarting from %s\n",
                 round + 1, a.max_restarts, secs, r.cause.c_str(), from_text.c_str());
    std::fflush(stderr);
    nlohmann::ordered_json event = {{"restart", round + 1},
                                    {"max_restarts", a.max_restarts},
                                    {"elapsed_s", secs},
                                    {"cause", r.cause},
                                    {"exit_code", r.code},
                                    {"resume", resume}};
    const std::string events = (fs::path(p.log_dir) / "restarts.jsonl").string();
    if (!(std::ofstream(events, std::ios::app) << event.dump() << '\n'))
      std::fprintf(stderr, "troupe launch: warning: cannot write %s\n", events.c_str());
    // Keep the failed attempt's logs and its list of workers (their pids) beside the new ones.
    const std::string listing = p.nodes == 1 ? std::string("workers")
                                             : "workers_node" + std::to_string(p.node_rank);
    fs::rename(fs::path(p.log_dir) / (listing + ".json"),
               fs::path(p.log_dir) / (listing + ".attempt" + std::to_string(round) + ".json"), ec);
    for (int l = 0; l < p.local_worker_num; ++l) {
      const fs::path log = fs::path(p.log_dir) / ("worker_" + std::to_string(first_rank + l) + ".log");
      fs::rename(log,
                 fs::path(p.log_dir) / ("worker_" + std::to_string(first_rank + l) + ".attempt" +
                                        std::to_string(round) + ".log"),
                 ec);
    }
  }
}

const command_registrar reg{command{
    "launch",
    "Start this node's worker processes of a multi-process job (like torchrun) and supervise them",
    [](CLI::App& app) {
      auto a = std::make_shared<launch_args>();
      a->worker_num_opt =
          app.add_option("--worker_num", a->worker_num,
                         "workers in the whole job; must equal data_parallel x model_parallel x "
                         "pipeline_stage of the config (default: that product, or nodes x "
                         "--local_worker_num)")
              ->check(CLI::PositiveNumber);
      a->local_worker_num_opt =
          app.add_option("--local_worker_num", a->local_worker_num,
                         "workers started on this node (default: --worker_num, i.e. one node; "
                         "under Slurm --worker_num / the number of srun tasks or nodes)")
              ->check(CLI::PositiveNumber);
      a->master_addr_opt = app.add_option(
          "--master_addr", a->master_addr,
          "address of node 0, where the rendezvous listens (default 127.0.0.1; under Slurm "
          "MASTER_ADDR or SLURM_LAUNCH_NODE_IPADDR)");
      a->master_port_opt =
          app.add_option("--master_port", a->master_port,
                         "port of the rendezvous on node 0 (default 29500; or MASTER_PORT)")
              ->check(CLI::Range(1, 65535));
      a->node_rank_opt = app.add_option("--node_rank", a->node_rank,
                                        "this node's number, 0 .. nodes-1 (default 0; under "
                                        "srun SLURM_PROCID, else SLURM_NODEID)")
                             ->check(CLI::NonNegativeNumber);
      app.add_option("--log_dir", a->log_dir,
                     "where worker_<RANK>.log and workers.json go (default "
                     "<runtime.run_dir>/logs)");
      app.add_option("--rdzv_timeout", a->rdzv_timeout,
                     "seconds for every worker to join the rendezvous, then again for every "
                     "worker to be ready (default 300)")
          ->check(CLI::PositiveNumber);
      app.add_option("--grace", a->grace,
                     "seconds the other workers get to stop by themselves after one fails, "
                     "before SIGTERM (then SIGKILL 5 s later) (default 30)")
          ->check(CLI::NonNegativeNumber);
      app.add_option("config", a->config, "run configuration (TOML)")->required();
      app.add_option("--set", a->sets,
                     "override a config key, e.g. --set train.steps=50 (repeatable; passed to "
                     "every worker)")
          ->allow_extra_args(false);
      app.add_option("--resume", a->resume,
                     "continue from a run directory or checkpoint directory (passed to every "
                     "worker)");
      app.add_option("--init", a->init,
                     "start from the weights of a Hugging Face model directory or a troupe "
                     "checkpoint (= --set model.init=DIR, passed to every worker)");
      app.add_option("--device-memory", a->device_memory,
                     "bytes of one device for the plan check, e.g. 80GiB (default: the GPU's own "
                     "size on CUDA; no check on the CPU)");
      app.add_flag("--no-plan-check", a->no_plan_check,
                   "start even when `troupe plan` says the layout does not fit");
      app.add_option("--steps", a->steps, "stop after N steps in this invocation (passed on)")
          ->check(CLI::NonNegativeNumber);
      app.add_option("--max-restarts", a->max_restarts,
                     "when a worker fails, stop every worker and restart the job from the last "
                     "complete checkpoint, up to N times (default 0: the job fails)")
          ->check(CLI::Range(0, 1000000));
      app.footer(
          R"(Each worker runs `troupe worker CONFIG [--set ...] [--resume ...] [--steps ...]` with
  TROUPE_MASTER_ADDR, TROUPE_MASTER_PORT, TROUPE_WORKER_NUM, TROUPE_LOCAL_WORKER_NUM,
  TROUPE_NODE_RANK, TROUPE_LOCAL_RANK, TROUPE_RANK (= node_rank x local_worker_num + local_rank),
  TROUPE_JOB_TOKEN and TROUPE_RDZV_TIMEOUT_MS in its environment; its stdout and stderr go to
  LOG_DIR/worker_<RANK>.log, and LOG_DIR/workers.json (workers_node<N>.json in a multi-node
  job) lists rank, local_rank, node_rank, pid and log of each worker started here. Local rank
  0's log is copied to this launcher's output as it grows.

Environment:
  TROUPE_JOB_TOKEN  shared secret every worker presents at the rendezvous; a single-node launch
                    generates one, a multi-node job needs the same value exported on every node.
  TROUPE_FAULT      test only: an injected fault (drop:RANK:STEP, enospc:STEP, nan:RANK:STEP,
                    slow:RANK:FACTOR, stall:RANK:STEP, poison:STEP:SEQ[:LOSS]), checked here, acted on by the
                    named worker in the first attempt; or kill:RANK:STEP[:ATTEMPT], acted on in
                    attempt ATTEMPT (default 0); several separated by ',', one per attempt
                    (docs/faults.md).
  Slurm: inside an srun step each task is one launcher: SLURM_PROCID (node_rank) and
  SLURM_STEP_NUM_TASKS (number of nodes); outside a step SLURM_NODEID and SLURM_JOB_NUM_NODES.
  MASTER_ADDR or SLURM_LAUNCH_NODE_IPADDR (master_addr) and MASTER_PORT (master_port) are used
  for the options not given on the command line; the launcher prints which values it took.
  Start one launcher per node: srun --ntasks-per-node=1 troupe launch --local_worker_num 4 CONFIG
  (examples/slurm/job.sbatch).

Failures: when a worker exits non-zero or is killed, the launcher names it (rank, pid, host, code
  or signal), gives the others --grace seconds to stop by themselves, then sends SIGTERM and 5 s
  later SIGKILL, and prints the end of the failed workers' logs. SIGINT/SIGTERM sent to the
  launcher are forwarded to the workers; a second one kills them.

Restarts: with --max-restarts N, after such a failure the launcher starts every worker again
  with --resume from the last complete checkpoint (or from the start when none was written),
  up to N times. Each restart is logged with its cause, appended to LOG_DIR/restarts.jsonl, and
  counted in every later metrics.jsonl line ("restarts"); the failed attempt's logs are kept as
  worker_<RANK>.attempt<K>.log, its workers.json as workers.attempt<K>.json. No restart
  follows a signal to the launcher or a job that never formed. Over several nodes, give every
  node's launcher the same --max-restarts: a failure stops the whole job, each launcher
  restarts its own workers, and they form the job again; the checkpoints must be on storage
  every node shares (workers that would start at different steps stop at once, saying so).

Exit status: 0 when every worker exited 0 (in the last attempt); 2 for a usage or config error (nothing started);
  1 when the rendezvous port is in use, the job could not form, or a worker could not start;
  otherwise the first failed worker's exit code (128 + N when killed by signal N), or 128 + N
  when the launcher itself received signal N first.
See docs/launch.md.)");
      return [a] {
        if (!a->init.empty()) {
          if (!a->resume.empty()) {
            print_error(core::error::make("--init and --resume together",
                                          "--init starts a fresh run from weights (step 0, new "
                                          "optimizer); --resume continues a run: pass one")
                            .to_string());
            return usage_error;
          }
          a->sets.push_back("model.init=" + a->init);
        }
        return run_launch(*a);
      };
    }}};

}  // namespace
}  // namespace troupe::cli
