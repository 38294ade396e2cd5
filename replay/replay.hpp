// Deterministic replay of a recorded run (docs/replay.md): re-runs the job of a run directory in
// this process, all workers as actors on the local transport, and compares every tensor sent with
// the run's message logs (actors/recorder.hpp) by (sender worker, receiver worker, tag). The first
// difference stops the replay and is reported with its rank, step, micro-batch and instruction.
// With `rank` set, only that worker's stage and optimizer shard run, fed by the tensors its
// neighbours sent it in the recorded run (runtime.record_tensors).
// No CAF in this header.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace troupe::actors {

struct replay_options {
  std::string run_dir;      // the recorded run
  int until_step = -1;      // stop after this step (-1 = the last recorded one)
  std::string dump_dir;     // write the last replayed step's tensors here ("" = no)
  int rank = -1;            // replay this worker alone (-1 = the whole job)
  std::string work_dir;     // the replay's own run directory; "" = a temporary one, removed after
  std::FILE* log = stdout;  // progress lines; null = quiet
};

struct replay_report {
  bool matched = false;
  std::int64_t messages = 0;  // tensors compared
  int first_step = 0;         // steps replayed: [first_step, last_step]
  int last_step = -1;
  std::string mismatch;       // the first difference, when !matched
  std::string dump_file;      // the safetensors file written for dump_dir
  int steps() const { return last_step - first_step + 1; }
};

/// Two recorded runs set side by side, message by message (`troupe replay A --compare B`).
struct run_comparison {
  bool same = false;
  std::int64_t messages = 0;    // distinct messages in either run
  std::int64_t differing = 0;   // of which differ (hash, dtype or shape, or in one run only)
  std::int64_t first_step = -1; // the earliest step with a difference (-1: none)
  std::int64_t differing_in_first_step = 0;
  int steps = 0;                // steps with messages, in either run
  bool configs_differ = false;  // the runs' config.toml texts differ
  // Per worker that sent a differing message in first_step: the first such message in its log,
  // described with both hashes and where each run logged it. Ordered by worker rank.
  std::vector<std::string> first_differences;
  // Optimizer shards whose clip record (scale, learning rate, loss scale) of first_step differs.
  std::vector<std::string> clip_differences;
};

/// Compares the message logs of two recorded runs without re-running either. An error when either
/// is not a recorded run, or their logs use different hash definitions.
core::result<run_comparison> compare_runs(const std::string& run_a, const std::string& run_b);

/// Replays `opt.run_dir`. An error when it cannot be replayed (not a run directory, not recorded,
/// damaged logs, missing data); a report with matched = false when it ran and differed.
core::result<replay_report> replay_run(const replay_options& opt);

}  // namespace troupe::actors
