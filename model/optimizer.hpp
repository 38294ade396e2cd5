// The optimizer half of a training step, as free functions over lists of parameter slots, so the
// single-rank trainer and the actor runtime's optimizer shards (which own slices of the same
// tensors) run literally the same code. The arithmetic is the oracle described in
// docs/training.md and model/trainer.hpp, steps 3 to 7:
//   3. tied embeddings: g_wte += g_lm_head, then g_lm_head = g_wte        (tie_gradients)
//   4. norm = sqrt(Σ over the fp64 sumsq blocks of every param, tied copy skipped, the exact sum
//      rounded once to double: core/exact_sum.hpp)                         (add_sumsq,
//                                                                           gradient_sumsq,
//                                                                           global_norm)
//   5. clip = grad_clip > 0 && norm > grad_clip ? grad_clip / (norm + 1e-6) : 1, as float
//                                                                          (clip_scale)
//   6. lr(step): linear warm-up, then cosine to min_lr                     (learning_rate)
//   7. AdamW per tensor, decay only where param_info.decay, t = step + 1, grads scaled by clip
//                                                                          (adamw_update)
//
// Dynamic loss scaling (precision.dynamic_loss_scale, loss_scaler): the loss gradient is multiplied
// by the scale S (loss_grad_scale), so every gradient and every norm block is S times the true
// one. decide_step then takes norm = sqrt(Σ blocks) / S; a non-finite Σ (an overflow in some
// gradient) skips the step everywhere — no AdamW call, moments, parameters and AdamW's t
// untouched — and halves S; loss_scale_window applied steps in a row double it. AdamW's gradient
// factor is clip / S (the unscale folded into the clip), and t counts applied updates.
//
// Because the sum in step 4 is exact, it does not depend on the order or the grouping of the
// blocks: optimizer shards send their partial sums (core::exact_sum) and the coordinator merges
// them, and without loss scaling a single process decides the clip on the device
// (clip_and_update_on_device) with the same bits and no host round trip.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/exact_sum.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"

namespace troupe::model {

/// One parameter tensor (or a slice of one) as the optimizer sees it: master weights, gradient
/// and the AdamW moments, all fp32 views of the same shape. `info` names the parameter and says
/// whether it decays and whether it is the tied LM-head copy.
struct param_slot {
  param_info info;
  tensor param;
  tensor grad;
  tensor exp_avg;     // AdamW first moment m
  tensor exp_avg_sq;  // AdamW second moment v
  tensor low{};       // the bf16/fp16 working copy AdamW refreshes, or undefined
};

/// AdamW moments of one chunk: fp32 flat buffers laid out exactly like the chunk's flat params.
struct optimizer_state {
  tensor exp_avg;
  tensor exp_avg_sq;
};

/// Zero-filled moments shaped like `c`'s flat parameter buffer, on the backend's device.
optimizer_state make_optimizer_state(kernels::backend& be, chunk& c);

/// Slots for every parameter of `c` in its parameter order, viewing `state` at the same offsets,
/// and c.flat_low() when the chunk has a low-precision copy: AdamW then writes it, so the caller
/// need not call c.params_updated() after adamw_update.
std::vector<param_slot> slots_of(chunk& c, optimizer_state& state);

/// Step 3: sums the two uses of a tied embedding in the fixed order (embedding, then head) and
/// gives the head copy the same gradient: g_wte += g_head; g_head = g_wte. Without `head_copy`
/// (a chunk whose head shares the embedding, chunk::shares_head) only the sum.
void tie_gradients(kernels::backend& be, tensor& g_wte, tensor& g_head, bool head_copy = true);

/// Step 4, first half, on the device: acc (int64 [core::exact_sum_words] on be's device, an
/// exact_sum_add accumulator) += the exact sum of the per-block fp64 sums of squares of each
/// slot's gradient, tied copies skipped. Blocks are kernels::norm_block elements of one tensor.
void add_sumsq(kernels::backend& be, const std::vector<param_slot>& slots, tensor& acc);

/// The same sum on the host (one copy of 568 bytes, whatever the number of blocks): what an
/// optimizer shard sends to the coordinator.
core::exact_sum gradient_sumsq(kernels::backend& be, const std::vector<param_slot>& slots);
/// The exact sum of norm blocks computed elsewhere (f64 `blocks` on be's device; the stage's
/// backend::message_hash_sumsq_blocks): gradient_sumsq's value when they are its slots' blocks.
core::exact_sum exact_sum_of(kernels::backend& be, const tensor& blocks);

/// Step 4, second half: sqrt of the sum, rounded once to double.
double global_norm(const core::exact_sum& sumsq);

/// Step 5: the factor gradients are multiplied by before AdamW.
float clip_scale(double norm, double grad_clip);

/// Step 6: learning rate of 0-based `step`: lr·(step+1)/warmup during warm-up, then cosine from lr
/// to min_lr over [warmup, steps). Computed in double.
double learning_rate(const core::optimizer_config& opt, const core::train_config& train, int step);

/// Step 7: one AdamW update of every slot (tied copies included, so both copies move identically)
/// at 0-based `step`, with the given learning rate and gradient scale; a slot's `low` copy, when
/// defined, receives the rounded new weights. Consecutive slots that view the same flat buffers
/// (one chunk's, one shard's) go to the backend as one adamw_runs call; the numbers are those of
/// one adamw call per slot.
void adamw_update(kernels::backend& be, std::vector<param_slot>& slots,
                  const core::optimizer_config& opt, double lr, float grad_scale, int step);
/// The same with AdamW's 1-based t given (dynamic loss scaling counts applied updates), and
/// optionally kernels::adamw_params::grad_factor and ::schedule (device values replacing
/// grad_scale, and lr with t's bias corrections).
void adamw_update_t(kernels::backend& be, std::vector<param_slot>& slots,
                    const core::optimizer_config& opt, double lr, float grad_scale,
                    std::int64_t t, const tensor& grad_factor = {},
                    const tensor& schedule = {});
/// adamw_update_t of `slots`, which all view the flat buffers of `whole` (its param, grad, moments
/// and low copy, laid out alike), as one adamw_runs_hashed call over the whole buffer: `blocks`
/// (int64 [kernels::message_hash_blocks_of(whole.param.bytes())]) receives the first level of
/// the message hash of whole.param after the update, for backend::message_hash_of_blocks_async.
/// The parameters get the bits adamw_update_t gives them.
void adamw_update_hashed(kernels::backend& be, const std::vector<param_slot>& slots,
                         const core::optimizer_config& opt, double lr, float grad_scale,
                         std::int64_t t, param_slot& whole, tensor& blocks);

/// The state of dynamic loss scaling, carried by whoever decides steps (the single-rank trainer, the
/// coordinator) and saved in checkpoints. Disabled, it is inert: scale 1, AdamW's t = step + 1.
struct loss_scaler {
  bool enabled = false;
  float scale = 1;           // the loss gradient is multiplied by this
  int window = 1000;         // applied steps in a row before the scale doubles
  int good_steps = 0;        // applied steps since the scale last changed
  std::int64_t updates = 0;  // optimizer updates applied so far (AdamW's t of the next is this + 1)

  /// Fresh state from the config, `updates_done` updates already applied (a resumed run).
  static loss_scaler from(const core::precision_config& p, std::int64_t updates_done = 0);
  /// AdamW's 1-based t for 0-based `step` if it is applied.
  std::int64_t adam_step(int step) const { return enabled ? updates + 1 : step + 1; }
  /// Advances the state after a step: applied (good) or skipped (overflow).
  void record(bool applied);
  /// {scale, good_steps, updates} as fp64, the checkpoint tensor `loss_scaler_tensor_name`.
  std::vector<double> to_vector() const;
  /// The state a to_vector() wrote (enabled and window come from the config). Errors name `where`.
  static core::result<loss_scaler> from_vector(const core::precision_config& p,
                                               const std::vector<double>& v,
                                               const std::string& where);
};

/// Name of the checkpoint tensor (in an optimizer file) that holds a loss_scaler's state.
inline constexpr const char* loss_scaler_tensor_name = "troupe.loss_scaler";

/// The cross-entropy's grad_scale: d(step loss)/d(token loss) times the loss scale,
/// loss_scale / tokens_per_step as float (1.0f / tokens when scaling is off).
float loss_grad_scale(float loss_scale, std::int64_t tokens_per_step);

/// What the optimizer does with one step (steps 4-6 plus dynamic loss scaling).
struct step_decision {
  double grad_norm = 0;     // of the unscaled gradients, before clipping; not finite on overflow
  float clip = 1;
  double lr = 0;
  float grad_scale = 1;     // AdamW's gradient factor: clip / loss scale
  bool skip = false;        // non-finite gradients under dynamic loss scaling: no update
  std::int64_t adam_step = 1;  // AdamW's t when applied
  float loss_scale = 1;     // the scale this step's loss gradient used
  float next_loss_scale = 1;
};

/// Decides step `step` from the exact sum of its gradients' norm blocks (computed from gradients
/// scaled by scaler.scale) and advances `scaler`. The coordinator calls this, and so does the
/// single-rank trainer under dynamic loss scaling, so they decide identically.
step_decision decide_step(const core::exact_sum& sumsq, loss_scaler& scaler,
                          const core::optimizer_config& opt, const core::train_config& train,
                          int step);

/// The device buffers of a step decided on the device, kept across steps (and, in a recorded
/// CUDA graph, across replays: everything that changes between steps lives here).
struct device_clip {
  tensor sumsq;     // int64 [core::exact_sum_words]: the accumulator of step 4
  tensor guard;     // int64 [core::exact_sum_words]: the losses' sumsq blocks (guard_losses)
  tensor out;       // f64 [2] {norm, factor}: clip_factor's output, AdamW's grad_factor is out[1]
  tensor schedule;  // f32 [3] {lr, bc1, bc2}: AdamW's adamw_params::schedule
  tensor host;      // f64 [2] host copy of out
  tensor schedule_host;  // f32 [3]
};
device_clip make_device_clip(kernels::backend& be);

/// Before a step's work: writes AdamW's learning rate and bias corrections for t into
/// dc.schedule (a copy from the host, so not while a graph is being recorded).
void set_adamw_schedule(kernels::backend& be, const core::optimizer_config& opt, double lr,
                        std::int64_t t, device_clip& dc);

/// The first op of a step decided on the device: clears the loss guard.
void begin_device_step(kernels::backend& be, device_clip& dc);

/// Adds the sumsq blocks of a micro-batch's per-row losses to the guard: a NaN or infinite loss
/// makes the clip factor NaN, so AdamW skips the step before the host has seen the loss.
void guard_losses(kernels::backend& be, const tensor& loss_rows, device_clip& dc);

/// Steps 4, 5 and 7 of a step without dynamic loss scaling, queued without waiting for the device:
/// the norm's exact sum and the clip factor are computed on the device and AdamW (lr and t from
/// dc.schedule) reads the factor there, skipping the update when the norm or a guarded loss is
/// not finite. The bits are those of decide_step followed by adamw_update_t; read_device_clip
/// gives the norm and the clip.
void clip_and_update_on_device(kernels::backend& be, std::vector<param_slot>& slots,
                               const core::optimizer_config& opt, const core::train_config& train,
                               device_clip& dc);

/// The norm and the clip factor of the last clip_and_update_on_device (waits for the device). The
/// factor is NaN when AdamW skipped the step (the norm or a guarded loss not finite).
struct device_clip_result {
  double grad_norm = 0;
  double clip = 1;
};
device_clip_result read_device_clip(kernels::backend& be, device_clip& dc);

/// What one optimizer step computed, for logs and metrics.
struct optimizer_step_stats {
  double grad_norm = 0;  // before clipping
  float clip = 1;
  double lr = 0;
};

/// Steps 4 to 7 over slots already in global order (tied gradients summed by the caller):
/// norm, clip, learning rate, AdamW.
optimizer_step_stats optimizer_step(kernels::backend& be, std::vector<param_slot>& slots,
                                    const core::optimizer_config& opt,
                                    const core::train_config& train, int step);

}  // namespace troupe::model
