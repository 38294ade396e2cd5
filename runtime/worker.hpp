// One worker process of a launched job (`troupe launch` starts them; cli/cmd_worker.cpp reads the
// launcher's environment into worker_options). The worker joins the rendezvous, connects its tcp
// transport to every peer (tensor bytes) and its CAF middleman to every peer's node actor (control
// messages), fills the job's directory with every worker's actors, and runs its own: the stage,
// optimizer shard and, on pipeline rank 0, the data loader of its rank; worker 0 also hosts the
// coordinator and the checkpoint writer. The job is the same job `troupe train` runs in one
// process — same actors, same order of every sum — so its results are bit-identical to it.
//
// When a worker process dies, the coordinator stops the job naming the dead rank, its host, the
// step and the instruction it was last reported at; when worker 0 dies, every other worker stops
// naming it. No CAF in this header.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "runtime/runtime.hpp"
#include "transport/tcp_wire.hpp"

namespace troupe::actors {

struct worker_options {
  run_options run;                 // resume, max_steps, log
  transport::endpoint master;      // the rendezvous (launcher of node 0)
  std::string job_token;
  int world_size = 1;              // TROUPE_WORKER_NUM
  int local_world_size = 1;        // TROUPE_LOCAL_WORKER_NUM
  int node_rank = 0;
  int local_rank = 0;
  std::chrono::milliseconds rendezvous_timeout{300000};
  /// Called once with the job's error as soon as this worker knows the job failed, before the
  /// (bounded) goodbyes to the other workers, so the reason reaches the log even if the launcher
  /// stops this process meanwhile. Empty = not called.
  std::function<void(const core::error&)> report;
};

/// Runs this process's worker of `cfg`'s job until the job ends. Worker 0 returns the job's
/// summary; the others return an empty summary when the job succeeded. Errors name the rank, the
/// peer or the config key at fault. Once the job's outcome is known the rest of the process's life
/// is bounded: if shutting down (actors, transport, exit) takes over 45 s, the process says where
/// it was stuck and exits with the outcome — call it only from a worker process.
core::result<model::train_summary> run_worker(const core::config& cfg, const worker_options& opt);

}  // namespace troupe::actors
