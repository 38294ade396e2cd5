// The plain single-rank training loop: the oracle the actor runtime reproduces bit for bit
// (docs/training.md). One training step, with M = micro-batches of the global batch
// (data_parallel × micro_batch_num × gradient_accumulation_steps; the loader's sequence numbering
// makes data-parallel replica r's micro-batch mb the single rank's micro-batch r·M/dp + mb) and
// tokens_per_step = M × micro_batch_size × seq_length, and trained = the unmasked targets of the
// step's global batch (loader::trained_targets; = tokens_per_step for token shards, fewer for
// instruction data, whose prompt and padding targets are masked; at least 1):
//
//  1. zero all gradients.
//  2. for mb = 0 .. M-1 in order: (tokens, targets) = loader.cut(step, 0, mb); forward through the
//     chunks in order, the last with grad_scale = loss_scale / float(trained) (loss_scale
//     is 1 unless dynamic loss scaling is on; model/optimizer.hpp), with the dropout masks of
//     (train.seed, step, global sequence mb × micro_batch_size) (model::training_dropout);
//     loss_total (double) += last.loss_sum(mb); backward through the chunks in reverse order.
//  3. tied embeddings (GPT-2): g_wte += g_lm_head; g_lm_head = g_wte           (tie_gradients)
//  4. norm = sqrt(Σ sumsq_blocks(grad) over every parameter, skipping the tied lm_head copy; the
//     fp64 blocks' exact sum, rounded once (core/exact_sum.hpp), so no order is involved)
//  5. clip = grad_clip > 0 && norm > grad_clip ? float(grad_clip / (norm + 1e-6)) : 1.0f
//     (with dynamic loss scaling: norm / loss_scale, and a non-finite norm skips steps 7 and the
//     update of AdamW's t, and halves the scale — decide_step in model/optimizer.hpp; without it
//     a non-finite norm stops training with the parameters not updated). Without dynamic loss
//     scaling steps 4, 5 and 7 are queued on the device at once (clip_and_update_on_device): the
//     host reads the norm once AdamW is queued, not before.
//  6. lr = step < warmup ? lr·(step+1)/warmup
//                        : min_lr + ½(lr − min_lr)(1 + cos(π·min(1, (step−warmup)/max(1, steps−warmup))))
//     in double, passed to the kernel as float.
//  7. AdamW on every parameter tensor (tied copy included), t = step + 1 (with dynamic loss
//     scaling: applied updates + 1), grad_scale = clip (/ loss_scale),
//     weight decay only where param_info.decay, writing each chunk's low-precision weight copy in
//     the same pass (one adamw_runs call per chunk).
//  8. reported loss = loss_total / trained (mean loss of the trained targets, double).
//
// Validation loss: model::validation_loss (model/run_policy.hpp), the coordinator's too.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "kernels/backend.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "model/forensics.hpp"
#include "model/loader.hpp"
#include "model/optimizer.hpp"
#include "model/run_policy.hpp"

namespace troupe::model {

/// What one training step computed.
struct step_result {
  double loss = 0;       // mean loss of the trained targets (step 8)
  double grad_norm = 0;  // before clipping (step 4)
  float clip = 1;        // step 5
  double lr = 0;         // step 6
  std::int64_t tokens = 0;
  bool skipped = false;        // dynamic loss scaling skipped the update (overflow)
  float loss_scale = 1;        // the scale this step used
  float next_loss_scale = 1;   // the scale the next step uses
};

/// The model, its optimizer state and its data on one rank.
class trainer {
 public:
  /// Builds `chunks` chunks (1 in the single-rank loop; more only to check split invariance) on
  /// `be` and initialises them from train.seed. Opens data.train, and data.val when set.
  static core::result<std::unique_ptr<trainer>> create(const core::config& cfg,
                                                       kernels::backend& be, int chunks = 1);
  ~trainer();
  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;

  /// Steps 1–8 for 0-based `step`. A non-finite loss is an error naming the step and micro-batch
  /// (the parameters are left untouched).
  core::result<step_result> train_step(int step);
  /// train_step under step forensics (model/forensics.hpp, runtime.forensics): steps 1-3 and the
  /// norm's sum, then, when the step is suspicious, the same again from the state before it (the
  /// update has not run) and the comparison of the two; the update (4-7, decided on the host as
  /// under dynamic loss scaling, with the same bits) only once the step may go ahead. `history`:
  /// the applied steps' losses. `field`: set to the metrics line's "forensics" field when the step
  /// was looked into (also when the returned error stops the run). Notes go to `log`.
  core::result<step_result> examined_step(int step, loss_history& history, std::FILE* log,
                                          std::string& field);
  /// Arms a test-only fault (TROUPE_FAULT nan with rank 0, or poison; core/fault.hpp).
  void inject(const core::fault_spec& f) { fault_ = f; }
  /// True once steps replay a recorded CUDA graph (runtime.cuda_graph).
  bool replays_graph() const { return graph_ready_; }
  /// Why runtime.cuda_graph is not in effect although asked for (empty when it is, or not asked).
  const std::string& graph_note() const { return graph_note_; }
  /// Mean loss of the trained targets of eval_batches validation micro-batches (every target for
  /// token shards). REQUIRES: has_validation().
  double validation_loss();
  bool has_validation() const { return val_.has_value(); }

  /// The checkpoint of the current state after `steps_done` steps (views of live tensors on the
  /// CPU: write it before the next step).
  checkpoint::save_request snapshot(int steps_done);
  /// Loads parameters, AdamW moments and the loss-scaler state by name.
  core::status restore(const checkpoint::reader& ck);
  /// Loads the parameters from model.init (model/hf.hpp); the optimizer state stays fresh.
  core::status load_init();
  /// Dynamic loss scaling state (inert unless precision.dynamic_loss_scale).
  const loss_scaler& scaler() const { return scaler_; }

  const core::config& config() const { return cfg_; }
  std::vector<chunk>& chunks() { return chunks_; }
  /// Micro-batches per step (M) and tokens per step.
  int micro_batches() const { return micro_batches_; }
  std::int64_t tokens_per_step() const { return tokens_per_step_; }

 private:
  trainer(const core::config& cfg, kernels::backend& be, loader train);

  tensor to_device(const tensor& host);
  std::vector<param_slot> all_slots();
  void tie(const std::vector<param_slot>& slots);
  /// train_step under dynamic loss scaling: the host decides from the norm's sum.
  core::result<step_result> scaled_step(int step);
  /// train_step without it: steps 4-7 on the device, the step recorded once as a graph.
  core::result<step_result> device_step(int step);
  /// Queues steps 1-7 of a device step on inputs_ and clip_ (recordable: no host copy, no wait).
  void queue_device_step(int step, std::int64_t trained);
  /// The dropout masks of micro-batch mb of `step` (global micro-batch mb starts at global
  /// sequence mb × micro_batch_size, as the loader numbers them).
  dropout_ctx dropout_of(int step, int mb) const;
  /// The step's unmasked targets over the global batch (at least 1).
  std::int64_t trained_targets(int step) const;
  /// One execution of steps 1-3 for step forensics: every micro-batch's loss sum (and, `again`,
  /// every sequence's), the norm's exact sum and the fingerprint; the gradients stay in place.
  struct execution {
    std::vector<double> mb_losses, seq_losses;
    core::exact_sum sumsq;
    step_fingerprint print;
    std::vector<param_slot> slots;
  };
  execution execute(int step, bool again);
  void inject_faults(int step, int mb);
  void inject_nan(int step);

  core::config cfg_;
  kernels::backend& be_;
  loader train_;
  std::optional<loader> val_;
  std::vector<chunk> chunks_;
  std::vector<optimizer_state> states_;
  loss_scaler scaler_;
  std::string base_source_, base_xxh64_;  // the frozen base ([lora]), named in checkpoints
  device_clip clip_;  // steps 4-7 on the device, without dynamic loss scaling
  struct device_inputs {
    tensor tokens, targets;  // int32 [B*T] on the device: the graph's inputs
    tensor doc_starts;       // host int32 [B*T] of packed rows (model/loader.hpp), else undefined
  };
  std::vector<device_inputs> inputs_;  // per micro-batch
  std::vector<tensor> loss_rows_;      // per micro-batch: the last chunk's per-row losses
  bool graph_wanted_ = true;
  bool graph_ready_ = false;
  std::uint64_t graph_id_ = 0;
  int steps_queued_ = 0;
  std::string graph_note_;
  int micro_batches_ = 0;
  std::int64_t tokens_per_step_ = 0;
  std::optional<core::fault_spec> fault_;  // test only (inject)
  bool nan_injected_ = false;
};

/// The checkpoint tensor holding a loss scaler's state (loss_scaler_tensor_name, fp64 [3]).
safetensors::named_tensor loss_scaler_tensor(const loss_scaler& s);
/// The loss scaler a resumed run continues with: the saved state, or — when the checkpoint has
/// none (written with scaling off) or scaling is off — a fresh one that counts next_step updates.
core::result<loss_scaler> restore_loss_scaler(const checkpoint::reader& ck,
                                              const core::precision_config& p);

/// How `train_single_rank` runs beyond the config.
struct train_options {
  std::string resume;       // RUN_DIR or checkpoint directory to continue from; "" = start fresh
  int max_steps = -1;       // stop after this many steps in this invocation (-1 = run to
                            // train.steps); the learning-rate schedule still spans train.steps
  std::FILE* log = stdout;  // progress lines and notes; null = quiet
  /// Per-step side work (reports, ...): run after each step's metrics line (run_log::step_hook);
  /// an error stops the run.
  std::vector<run_log::step_hook> step_hooks;
  /// One injected fault (TROUPE_FAULT, core/fault.hpp; test only): nan with rank 0, or poison.
  std::optional<core::fault_spec> fault;
};

/// `troupe train` on one rank under the run policy of model/run_policy.hpp (run directory,
/// cadence of evaluation, checkpoints and progress lines, metrics.jsonl). Parallel sizes > 1
/// are run as the same global batch on one rank (with a note).
core::result<train_summary> train_single_rank(const core::config& cfg, const train_options& opt);

}  // namespace troupe::model
