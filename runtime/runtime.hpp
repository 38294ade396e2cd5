// The actor runtime's entry point: runs a whole data_parallel × pipeline_stage job as CAF actors in
// this process, on the in-process transport, executing the configured schedule. The result is
// bit-identical to model::train_single_rank for data_parallel = 1 (docs/design.md, Determinism
// contract). No CAF in this header: the CLI and tests include it cheaply.
#pragma once

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "actors/perturb.hpp"
#include "actors/recorder.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "model/trainer.hpp"

namespace troupe::actors {

struct run_options {
  std::string resume;       // run directory or checkpoint to continue from ("" = fresh)
  int max_steps = -1;       // stop after this many steps in this invocation (-1 = train.steps)
  std::FILE* log = stdout;  // progress lines; null = quiet
  int kernel_threads = 0;   // threads of the CPU ops' pool (0 = runtime.threads); 1 gives every
                            // stage exactly one core, the simulator's model of a pipeline
  /// Stop once this step is done, as if the job had been stopped there: unlike max_steps, the
  /// step is not the last one (no forced checkpoint or evaluation). -1 = never. For replay.
  int halt_after_step = -1;
  /// Sees every tensor the job sends instead of the recorder (replay's verifier); null = record
  /// as runtime.record says.
  std::shared_ptr<message_sink> sink;
  /// Per-step side work (reports, ...): the coordinator runs these after each step's metrics line
  /// (model::run_log::step_hook; an error stops the job). Only the process hosting worker 0 runs
  /// them.
  std::vector<model::run_log::step_hook> step_hooks;
  /// Flips one bit of one tensor sent (actors/perturb.hpp, test only); null = none.
  std::shared_ptr<send_perturbation> perturb;
  /// The injected fault of this attempt (TROUPE_FAULT, core/fault.hpp; test only); none = none.
  std::optional<core::fault_spec> fault;
  /// Automatic restarts of the job so far (`troupe launch --max-restarts`, TROUPE_RESTARTS):
  /// written into every metrics line when > 0.
  int restarts = 0;
};

/// Trains `cfg` as actors. Errors name the failed actor, rank, step and instruction.
core::result<model::train_summary> run_actor_job(const core::config& cfg, const run_options& opt);

}  // namespace troupe::actors
