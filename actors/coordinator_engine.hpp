// The behaviour of the coordinator as a plain class (docs/design.md, rule 4; actors/coordinator.cpp
// only moves messages), one per job. It starts each step, gathers the last stages' losses and the
// shards' gradient-norm sums, decides the clip scale and learning rate (model::decide_step, the
// single-rank trainer's own decision), waits for every stage and shard to finish, and then does
// what the run policy (model/run_policy.hpp) says is due: metrics line and progress line,
// evaluation, checkpoint. It writes trace.json, and stops the job — with a message naming the
// actor, rank, step and instruction — when an actor fails, a loss is not finite, or nothing
// progresses.
//
// Phases of a step: gathering (losses, norm sums) → [re-executing: step forensics looks into a
// suspicious step (model/forensics.hpp): the shards forget their reduction, then the step runs
// once more and its results are gathered again] → updating (decision sent; stage and shard
// reports) → evaluating (only when due: waiting for the parameter snapshot) → the next step's
// gathering, or, after the last step, finishing (checkpoints still being written) → stopped.
// Any failure goes to stopped at once. The engine never blocks and knows nothing of CAF: each
// event may queue commands (take_commands) for the host to send, in order.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "actors/layout.hpp"
#include "core/files.hpp"
#include "actors/wire.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"
#include "model/forensics.hpp"
#include "model/loader.hpp"
#include "model/optimizer.hpp"
#include "model/run_policy.hpp"

namespace troupe::actors {

/// Where the coordinator is (see the top of this file).
enum class coordinator_phase { idle, gathering, reexecuting, updating, evaluating, finishing, stopped };

/// "gathering", ... (for tests and messages).
const char* phase_name(coordinator_phase p);

/// What the coordinator needs beyond the config and layout.
struct coordinator_plan {
  int first_step = 0;
  int end_step = 0;
  std::shared_ptr<model::loader> train;      // the loss's denominator (trained targets); null:
                                             // every token of the global batch
  std::shared_ptr<model::loader> val;        // null: no validation
  int halt_after = -1;                       // stop once this step is done (-1 = end_step)
  int restarts = 0;                          // automatic restarts so far (run_start::restarts)
  std::optional<model::loss_scaler> scaler;  // a resumed run's loss scaler; none: from the config
  std::vector<model::run_log::step_hook> step_hooks;  // run after each step's metrics line
};

/// Commands for the host, in the order they must be sent.
struct begin_step_cmd {  // to every loader (step) and every stage (step, loss scale)
  std::int64_t step = 0;
  float loss_scale = 1;
};
struct snapshot_cmd {  // to the stages of replica 0: copy parameters to `dests` (to_writer, ...)
  std::int64_t step = 0;
  std::int32_t dests = 0;
};
struct checkpoint_cmd {  // to the writer (announce, with the loss scaler's state), then to the
                         // shards holding moments (snapshot to the writer)
  std::int64_t step = 0;
  std::vector<double> scaler;  // empty when dynamic loss scaling is off
};
struct forget_cmd {  // step forensics, to every shard: forget the step's reduction, then answer
  std::int64_t step = 0;
};
struct reexecute_cmd {  // step forensics, to every loader (cut the step again) and every stage
                        // (execute it again from the state before it)
  std::int64_t step = 0;
  float loss_scale = 1;
};
// clip_decision goes to every shard.
using coordinator_command = std::variant<begin_step_cmd, clip_decision, snapshot_cmd, checkpoint_cmd,
                                         forget_cmd, reexecute_cmd>;

/// A stage computing at least this many times as long in a step as the median of the other
/// replicas of its pipeline stage, and at least straggler_excess_s longer (shorter differences are
/// the noise of a busy host), is reported as a straggler (coordinator_engine, metrics "skew").
inline constexpr double straggler_ratio = 2.0;
inline constexpr double straggler_excess_s = 0.05;

/// What the watchdog should do after a tick.
enum class watchdog_action {
  wait,       // tick again in a second
  ask,        // nothing progressed for too long: ask every stage what it does, add each answer
              // (or the lack of one) with hang_line, tick again in three seconds
};

class coordinator_engine {
 public:
  using clock = std::chrono::steady_clock;

  /// `log`: progress lines and notes (null = quiet). `watchdog`: how long nothing may progress.
  /// REQUIRES: cfg outlives the engine.
  coordinator_engine(const core::config& cfg, job_layout layout, coordinator_plan plan,
                     std::FILE* log, std::chrono::milliseconds watchdog = std::chrono::seconds(60));

  /// Opens metrics.jsonl and trace.json and begins the first step (or stops at once when no step
  /// is left). `hosts`: worker rank -> host of a launched job's workers (empty in one process).
  void start(std::map<int, std::string> hosts = {});
  void on_loss(loss_report r);
  void on_norm(norm_part n);
  void on_stage_report(stage_report r);
  void on_shard_report(const shard_report& r);
  /// Chunk `chunk`'s parameters for the evaluation that is due.
  void on_snapshot(int chunk, core::tensor params) { on_snapshot(chunk, 0, std::move(params)); }
  /// Tensor-parallel rank `tp`'s slices of the chunk's parameters.
  void on_snapshot(int chunk, int tp, core::tensor params);
  void on_checkpoint(const checkpoint_written& w);
  /// Shard (pp, part) forgot step `step` (step forensics); once all have, the step runs again.
  void on_forgotten(std::int64_t step, int pp, int part);
  /// A worker's heartbeat at `now`: its stage's status line; a line that changed since the
  /// worker's last heartbeat counts as progress (a slow stage is not a hung one).
  void on_heartbeat(worker_heartbeat h, clock::time_point now = clock::now());
  /// An actor reported a failure. Across processes (`defer` true) a survivor often fails first,
  /// on the lost connection to a dead worker: the failure is held until on_deferred_timeout so the
  /// dead process's down message, which names the real culprit, can come first. Returns true when
  /// the host must call on_deferred_timeout later.
  bool on_failure(const actor_failure& f, bool defer);
  void on_deferred_timeout();
  /// The actor at `who` ended. `unreachable`: its process's connection is lost (that stops the job
  /// naming the process); otherwise, unless a failure report is already held, the job stops naming
  /// the actor.
  void on_down(const address& who, bool unreachable, const std::string& reason);
  /// The watchdog's tick at `now`.
  watchdog_action on_tick(clock::time_point now);
  /// A stage's answer to the watchdog's question (or the note that it did not answer).
  void hang_line(std::string line) { hang_lines_.push_back(std::move(line)); }
  /// For a stage of worker `rank` that did not answer: what its worker's last heartbeat says it
  /// is blocked on in a tensor-parallel collective ("… waiting to receive from rank 1 (…) for
  /// 4.2 s"), when that heartbeat came within the last 3 s; else "".
  std::string blocked_line(int rank, clock::time_point now = clock::now()) const;
  /// Stops the job with `e` (ignored once stopped).
  void fail(core::error e);

  std::vector<coordinator_command> take_commands();
  coordinator_phase phase() const { return phase_; }
  std::int64_t step() const { return step_; }
  /// Set once stopped: the summary, or the error that stopped the job.
  const std::optional<core::result<model::train_summary>>& outcome() const { return outcome_; }
  const job_layout& layout() const { return layout_; }

 private:
  void begin_step(std::int64_t step);
  void maybe_decide();
  /// Step forensics on the gathered step: true when the decision may go ahead (`d` possibly made
  /// a skip); false when the step runs again or the job stopped.
  bool investigate(model::step_decision& d, const core::exact_sum& sumsq);
  void reexecute();
  void maybe_finish_step();
  void evaluate();
  void record_step(const model::step_outcome& o);
  void next_or_finish();
  void complete();
  void close_trace();
  void write_trace();
  std::string stage_fields();
  std::string device_costs() const;  // the metrics line's "device_costs" (device runs)
  std::string skew_fields();
  void print_memory();
  core::error process_lost(int rank, const std::string& why) const;
  int expected_norm_parts() const;
  void progressed(clock::time_point at = clock::now()) { last_progress_ = std::max(last_progress_, at); }

  const core::config& cfg_;
  job_layout layout_;
  coordinator_plan plan_;
  std::FILE* log_;
  std::map<int, std::string> hosts_;
  std::chrono::milliseconds watchdog_;

  coordinator_phase phase_ = coordinator_phase::idle;
  std::vector<coordinator_command> out_;
  std::optional<core::result<model::train_summary>> outcome_;
  std::optional<model::run_log> run_;
  core::sealed_file trace_;  // trace.json
  bool trace_first_ = true;
  std::set<std::pair<int, int>> device_tracks_;  // (pid, tid) of device tracks already named
  static constexpr int device_track = 1000;        // tid of pipeline rank 0's device track

  // this step
  std::int64_t step_ = 0;
  clock::time_point t_step_;
  std::map<int, std::vector<double>> losses_;                        // dp -> per-mb loss sums
  std::map<std::pair<int, int>, std::vector<std::int64_t>> norms_;   // (chunk, part) -> exact sum
  std::string nonfinite_;  // the first shard's note on a non-finite gradient this step
  std::map<int, std::vector<double>> seq_losses_;                    // dp -> per-sequence sums
  std::map<std::pair<int, int>, std::uint64_t> grad_hashes_;         // (chunk, part) -> hash
  // step forensics (model/forensics.hpp)
  model::loss_history history_;
  int executions_ = 1;                    // of this step so far
  int forgotten_ = 0;                     // shards that forgot the step being re-executed
  std::string why_;                       // why the step is looked into
  model::step_fingerprint last_print_;    // the previous execution's fingerprint
  model::step_fingerprint first_print_;
  std::string forensics_fields_;          // the metrics line's "forensics" field
  model::loss_scaler scaler_;
  model::step_decision decision_;
  std::vector<stage_report> reports_;
  int shard_reports_ = 0;
  std::map<std::pair<int, int>, std::uint64_t> shard_bytes_;  // (pp, part) -> optimizer state
  std::map<std::pair<int, int>, std::uint64_t> shard_peak_;   // (pp, part) -> device peak bytes
  std::optional<model::step_outcome> pending_;                // waiting for its evaluation
  std::string pending_fields_;
  int pending_checkpoints_ = 0;

  // evaluation
  std::unique_ptr<kernels::backend> be_;
  std::unique_ptr<model::chunk> eval_model_;
  std::optional<core::error> setup_error_;  // the evaluation model could not be made (model.init)
  std::map<std::pair<int, int>, core::tensor> snapshot_;  // (chunk, tensor-parallel rank)

  // supervision
  std::map<int, std::pair<worker_heartbeat, clock::time_point>> beats_;  // launched jobs
  std::optional<core::error> deferred_;
  clock::time_point last_progress_ = clock::now();
  bool asking_ = false;  // the watchdog asked the stages; the next tick reports
  clock::time_point asked_at_;
  int straggler_ = -1;   // the rank last reported as a straggler (-1: none now)
  std::vector<std::string> hang_lines_;
};

/// The error that stops a job when `f` failed: "stage(dp=1, pp=1) (rank 3) at step 1,
/// instruction 1B2 failed: ...", with the rank set.
core::error failure_error(const actor_failure& f);

}  // namespace troupe::actors
