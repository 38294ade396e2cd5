// One run policy for both training loops (docs/design.md, "one policy, one place"): the
// single-rank loop (model/trainer.cpp) and the actor runtime's coordinator
// (actors/coordinator_engine.hpp) both call these, so where a run writes, when it evaluates,
// checkpoints and prints, what a step's metrics line holds and what the run's summary says are
// decided once.
//
//  - open_run: resolves --resume (the checkpoint's next step; the checkpoint must hold the
//    config's model, and differences that break bit-identical resumption are noted), the steps of
//    this invocation (to train.steps, or --steps more), creates runtime.run_dir, writes
//    config.toml (a failed write is an error) and names the checkpoint root.
//  - cadence: after `done` steps of an invocation that ends at end_step: evaluate when there is
//    validation data and train.eval_interval divides done, or done == end_step; checkpoint when
//    checkpoint.interval divides done, or done == end_step; print the progress line when
//    train.log_interval divides done, after an evaluation, and at done == end_step.
//  - run_log: per step one metrics.jsonl line (a failed write stops the run), the progress line
//    when due, then the step-end hooks (where per-step side work such as reports plugs in); the
//    run's summary.
//  - validation_loss: Σ loss_sum over eval_cut(0 .. eval_batches-1) / their unmasked targets
//    (eval_batches × B × T for token shards),
//    forward only, each micro-batch released after use.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "model/loader.hpp"
#include "model/metrics.hpp"

namespace troupe::model {

/// What a run did.
struct train_summary {
  int first_step = 0;                  // step the run started at (after a resume: the next one)
  int end_step = 0;                    // one past the last step run
  std::vector<double> losses;          // per step run, in order
  std::vector<double> grad_norms;
  std::optional<double> final_val_loss;
  std::string checkpoint;              // the last checkpoint written ("" if none)
  double seconds = 0;                  // training time (without evaluation and checkpoints)
};

/// Where an invocation starts and ends, and where it writes.
struct run_start {
  int first_step = 0;                        // 0, or the resumed checkpoint's next step
  int end_step = 0;                          // one past the last step of this invocation
  std::string ckpt_root;                     // checkpoint.dir, or <run_dir>/checkpoints
  std::optional<checkpoint::reader> resume;  // the checkpoint resumed from
  std::string resumed_from;                  // its directory ("" when starting fresh)
  int restarts = 0;                          // automatic restarts before this invocation
                                             // (`troupe launch --max-restarts`); metrics lines
                                             // carry it when > 0
};

/// Resolves the start of a run: `resume` ("" = fresh; else a run or checkpoint directory),
/// `max_steps` (-1 = run to train.steps), creates runtime.run_dir and, when `write_config`,
/// writes config.toml there. Notes (resume point, config differences) go to `log` (null = quiet).
/// Errors name the file or key.
core::result<run_start> open_run(const core::config& cfg, const std::string& resume,
                                 int max_steps, bool write_config, std::FILE* log);

/// What is due after a step.
struct step_cadence {
  bool evaluate = false;
  bool checkpoint = false;
  bool log = false;  // print the progress line
};

/// The cadence after `done` steps (1-based) of an invocation that ends at `end_step`.
step_cadence cadence(const core::config& cfg, int done, int end_step, bool has_validation);

/// What one step computed, in either loop.
struct step_outcome {
  int step = 0;              // 0-based
  double loss = 0;           // mean token loss of the global batch
  double grad_norm = 0;      // before clipping
  double lr = 0;
  std::int64_t tokens = 0;   // tokens of the global batch
  double seconds = 0;        // the step's training time
  bool scaled = false;       // dynamic loss scaling is on: the next three are logged
  float loss_scale = 1;
  bool skipped = false;
  float next_loss_scale = 1;
  std::optional<double> val_loss;  // when validation ran after this step
};

/// The per-step record of a run: metrics.jsonl, progress lines, step-end hooks and the summary.
class run_log {
 public:
  /// Called after each step's metrics line is written: per-step side work (reports, ...). An
  /// error stops the run.
  using step_hook = std::function<core::status(const step_metrics&)>;

  /// Opens <run_dir>/metrics.jsonl (dropping lines of steps >= first_step: a resumed run rewrites
  /// them). `log`: progress lines and notes (null = quiet). The clock for elapsed_s starts now.
  static core::result<run_log> open(const core::config& cfg, const run_start& start,
                                     std::FILE* log);

  void add_step_hook(step_hook h) { hooks_.push_back(std::move(h)); }

  /// Records step `o`: the summary, its metrics line (a JSON object; `extra_fields` — `"k":v,...`
  /// without braces — are appended inside it), the progress line when cadence says so, then the
  /// hooks. Errors: the metrics file could not be written, or a hook failed.
  core::status step_end(const step_outcome& o, const std::string& extra_fields = "");
  /// A line of its own for an event at `step` that has no step line (step forensics stopping the
  /// run): {"step":S,<fields>}.
  core::status event(int step, const std::string& fields);
  /// A checkpoint was written: noted on the log and in the summary.
  void checkpoint_written(const std::string& path);
  /// The run is over: the summary (notes on the log when no step was left to run).
  train_summary finish();

  const train_summary& summary() const { return summary_; }
  const std::string& metrics_path() const { return metrics_.path(); }

 private:
  run_log(const core::config& cfg, const run_start& start, std::FILE* log, metrics_writer w);

  core::config cfg_;
  std::FILE* log_;
  int end_step_;
  int restarts_ = 0;
  metrics_writer metrics_;
  std::chrono::steady_clock::time_point t_start_;
  train_summary summary_;
  std::vector<step_hook> hooks_;
};

/// The validation loss of the model formed by `chunks` (in forward order, on `be`) over
/// eval_batches micro-batches of `val`. Throws core::failure when a batch cannot be cut (a token
/// id out of range names its shard file and position).
double validation_loss(const loader& val, int eval_batches, kernels::backend& be,
                       std::vector<chunk*> chunks);

}  // namespace troupe::model
