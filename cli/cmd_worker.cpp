// `troupe worker CONFIG [--set key=value]... [--resume RUN_DIR|CKPT] [--steps N]`: one worker
// process of a launched job (runtime/worker.hpp). `troupe launch` starts one per local rank and
// passes who it is in the environment: TROUPE_MASTER_ADDR, TROUPE_MASTER_PORT, TROUPE_WORKER_NUM,
// TROUPE_LOCAL_WORKER_NUM, TROUPE_NODE_RANK, TROUPE_LOCAL_RANK, TROUPE_JOB_TOKEN and, optionally,
// TROUPE_RDZV_TIMEOUT_MS and TROUPE_RESTARTS. Started by hand (with those variables set) it
// behaves the same.
// TROUPE_PERTURB_SEND (test only, actors/perturb.hpp) flips one bit of one tensor it sends;
// TROUPE_FAULT (test only, core/fault.hpp) injects a fault: kill in the attempt it names, every
// other fault in the first attempt only.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime/worker.hpp"
#include "cli/command.hpp"
#include "runtime/preflight.hpp"
#include "cli/live_report.hpp"
#include "core/config.hpp"
#include "core/fault.hpp"

namespace troupe::cli {
namespace {

struct worker_args {
  std::string config;
  std::vector<std::string> sets;
  std::string resume;
  int steps = -1;
};

/// The value of environment variable `name`, or an error naming it.
core::result<std::string> env_text(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v)
    return core::error::make(std::string("environment variable ") + name + " is not set",
                             "troupe worker is started by `troupe launch`, which sets it; run "
                             "`troupe launch --help`");
  return std::string(v);
}

core::result<int> env_int(const char* name, int lo, int hi) {
  auto t = env_text(name);
  if (!t) return t.err();
  try {
    std::size_t used = 0;
    long v = std::stol(t.value(), &used);
    if (used == t.value().size() && v >= lo && v <= hi) return static_cast<int>(v);
  } catch (const std::exception&) {
  }
  return core::error::make(std::string("environment variable ") + name + " = '" + t.value() +
                               "' is not an integer in [" + std::to_string(lo) + ", " +
                               std::to_string(hi) + "]",
                           "troupe launch sets it; do not edit it by hand");
}

core::result<actors::worker_options> options_from_env() {
  actors::worker_options o;
  auto addr = env_text("TROUPE_MASTER_ADDR");
  if (!addr) return addr.err();
  auto port = env_int("TROUPE_MASTER_PORT", 1, 65535);
  if (!port) return port.err();
  auto token = env_text("TROUPE_JOB_TOKEN");
  if (!token) return token.err();
  auto world = env_int("TROUPE_WORKER_NUM", 1, 1 << 20);
  if (!world) return world.err();
  auto local = env_int("TROUPE_LOCAL_WORKER_NUM", 1, world.value());
  if (!local) return local.err();
  auto node = env_int("TROUPE_NODE_RANK", 0, world.value() / local.value() - 1);
  if (!node) return node.err();
  auto lrank = env_int("TROUPE_LOCAL_RANK", 0, local.value() - 1);
  if (!lrank) return lrank.err();
  o.master = {addr.value(), static_cast<std::uint16_t>(port.value())};
  o.job_token = token.value();
  o.world_size = world.value();
  o.local_world_size = local.value();
  o.node_rank = node.value();
  o.local_rank = lrank.value();
  if (std::getenv("TROUPE_RDZV_TIMEOUT_MS")) {
    auto t = env_int("TROUPE_RDZV_TIMEOUT_MS", 1, 1 << 30);
    if (!t) return t.err();
    o.rendezvous_timeout = std::chrono::milliseconds(t.value());
  }
  return o;
}

int run_worker_command(const worker_args& a) {
  auto opt = options_from_env();
  if (!opt) {
    print_error(opt.err().to_string());
    return 2;
  }
  const int rank = opt->node_rank * opt->local_world_size + opt->local_rank;
  auto cfg = core::load_config(a.config, a.sets);
  if (!cfg) {
    print_error(cfg.err().to_string());
    return 1;
  }
  if (auto st = actors::preflight(cfg.value()); !st) {
    print_error(st.err().to_string());
    return 1;
  }
  opt->run.resume = a.resume;
  opt->run.max_steps = a.steps;
  if (std::getenv("TROUPE_RESTARTS")) {
    auto n = env_int("TROUPE_RESTARTS", 0, 1 << 20);
    if (!n) {
      print_error(n.err().to_string());
      return 2;
    }
    opt->run.restarts = n.value();
  }
  if (const char* spec = std::getenv("TROUPE_PERTURB_SEND"); spec && *spec) {
    auto p = actors::parse_perturbation(spec, "TROUPE_PERTURB_SEND");
    if (!p) {
      print_error(p.err().to_string());
      return 2;
    }
    opt->run.perturb = p.value();
  }
  auto fault = core::fault_from_env();
  if (!fault) {
    print_error(fault.err().to_string());
    return 2;
  }
  for (const auto& f : fault.value())
    if (f.rank >= opt->world_size) {
      print_error(core::error::make(f.label() + " names rank " + std::to_string(f.rank) +
                                        " in a job of " + std::to_string(opt->world_size) + " workers")
                      .to_string());
      return 2;
    }
  // A fault stands for a one-off failure: each fires in one attempt only (kill in its ATTEMPT,
  // every other in the first), and the attempts after it run without it.
  opt->run.fault = core::fault_for_attempt(fault.value(), opt->run.restarts);
  if (opt->run.restarts > 0)
    if (auto first = core::fault_for_attempt(fault.value(), 0);
        first && (first->rank == rank || (first->rank < 0 && rank == 0)))
      std::fprintf(stderr, "troupe worker rank %d: %s is not injected again after a restart\n", rank,
                   first->label().c_str());
  bool reported = false;
  opt->report = [&reported](const core::error& e) {
    print_error(e.to_string());
    std::fflush(stderr);
    reported = true;
  };
  // Worker 0 runs the coordinator, which runs the step hooks: the live report is written there.
  auto live = rank == 0 ? attach_live_report(cfg.value(), opt->run.step_hooks) : nullptr;
  auto summary = actors::run_worker(cfg.value(), opt.value());
  finish_live_report(live);
  if (!summary) {
    if (!reported) print_error(summary.err().to_string());
    return 1;
  }
  if (opt->run.perturb && opt->run.perturb->rank == rank && !opt->run.perturb->done)
    std::fprintf(stderr,
                 "troupe worker rank %d: warning: TROUPE_PERTURB_SEND=%s matched no tensor this "
                 "worker sent (instructions as the message logs write them)\n",
                 rank, opt->run.perturb->spec.c_str());
  std::printf("worker rank %d: done\n", rank);
  return 0;
}

const command_registrar reg{command{
    "worker", "One worker process of a launched job (started by `troupe launch`)", [](CLI::App& app) {
      auto a = std::make_shared<worker_args>();
      app.add_option("config", a->config, "run configuration (TOML)")->required();
      app.add_option("--set", a->sets, "override a config key (repeatable)")->allow_extra_args(false);
      app.add_option("--resume", a->resume, "continue from a run directory or checkpoint directory");
      app.add_option("--steps", a->steps, "stop after N steps in this invocation")
          ->check(CLI::NonNegativeNumber);
      app.footer(
          "Environment (set by troupe launch): TROUPE_MASTER_ADDR, TROUPE_MASTER_PORT,\n"
          "TROUPE_WORKER_NUM, TROUPE_LOCAL_WORKER_NUM, TROUPE_NODE_RANK, TROUPE_LOCAL_RANK,\n"
          "TROUPE_JOB_TOKEN, TROUPE_RDZV_TIMEOUT_MS (optional), TROUPE_RESTARTS (optional: restarts so\n"
          "far, written into metrics lines).\n"
          "Test only: TROUPE_PERTURB_SEND=rank:step:instruction flips the lowest bit of the\n"
          "first tensor that instruction sends, to show what troupe replay finds (docs/replay.md).\n"
          "Test only: TROUPE_FAULT=drop:RANK:STEP | enospc:STEP | nan:RANK:STEP | slow:RANK:FACTOR\n"
          "| stall:RANK:STEP | poison:STEP:SEQ[:LOSS] injects one fault in the first attempt of the job;\n"
          "kill:RANK:STEP[:ATTEMPT] kills worker RANK at step STEP of attempt ATTEMPT (default 0);\n"
          "several separated by ',', one per attempt (docs/faults.md).\n"
          "Exit status: 0 the job finished; 1 the job failed (the message names the rank);\n"
          "2 the environment is incomplete.");
      return [a] { return run_worker_command(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
