// What one process hosts of a job: the pieces every actor of the process shares (actors/job.hpp),
// built from the config for a chosen set of workers. The in-process runtime (runtime/runtime.cpp)
// hosts every worker; a launched worker process (runtime/worker.cpp) hosts one. Both build the
// same chunks, shards and loaders in the same way, which is what keeps a launched job bit-identical
// to `troupe train` of the same config.
#pragma once

#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/actors.hpp"
#include "runtime/runtime.hpp"
#include "model/checkpoint.hpp"

namespace troupe::actors {

struct hosted_job {
  std::shared_ptr<job> j;                      // endpoints sized to every worker, all null
  std::vector<int> workers;                    // the workers this process hosts, ascending
  int first_step = 0;
  int end_step = 0;
  std::optional<model::loss_scaler> scaler;    // a resumed run's loss scaler (coordinator_setup)
  int threads = 1;                             // CAF scheduler threads
  std::string ckpt_root;
  std::shared_ptr<model::loader> train;
  std::shared_ptr<model::loader> val;          // null: no validation split
  std::map<std::tuple<int, int, int>, std::shared_ptr<stage_bundle>> stages;  // (dp, pp, tp), hosted
  std::map<std::tuple<int, int, int>, std::shared_ptr<shard_bundle>> shards;  // (pp, part, tp), hosted
  std::shared_ptr<recorder> rec;               // null: not recording (or a caller's sink)
  std::vector<model::run_log::step_hook> step_hooks;  // the coordinator's (run_options)
  int restarts = 0;                                   // run_options::restarts

  bool hosts(int w) const;
};

/// Resolves the resume point, creates the run directory (config.toml is written by the process
/// hosting worker 0), opens the data, sizes the CPU ops' pool, opens the message log of the hosted
/// workers and builds their stages and shards. Logs the job's one-line summary when worker 0 is
/// hosted. Errors name the config key or file.
core::result<hosted_job> prepare_job(const core::config& cfg, const run_options& opt,
                                     std::vector<int> workers);

/// Spawns the actors of the hosted workers — stage, optimizer shard, data loader (on pipeline
/// rank 0) and, with worker 0, the checkpoint writer and the coordinator — and enters them in the
/// job's directory. The coordinator is told nothing yet: send it start_atom once the directory is
/// complete.
void spawn_hosted(caf::actor_system& sys, hosted_job& h, int halt_after,
                  std::shared_ptr<std::promise<core::result<model::train_summary>>> done);

/// Closes the message log, warning on `log` when it could not be written completely: the run
/// itself is not lost when its log is, and replay reports the gap.
void close_recorder(hosted_job& h);

/// Prints the closing line of a finished job to `log`.
void print_summary(std::FILE* log, const core::result<model::train_summary>& r);

}  // namespace troupe::actors
