// The optimizer half of a training step, as free functions over lists of parameter slots, so the
// single-rank trainer and the actor runtime's optimizer shards (which own slices of the same
// tensors) run literally the same code. The arithmetic is the oracle described in
// docs/training.md and model/trainer.hpp, steps 3 to 7:
//   3. tied embeddings: g_wte += g_lm_head, then g_lm_head = g_wte        (tie_gradients)
//   4. norm = sqrt(Σ over fp64 sumsq blocks, params in global order, tied copy skipped, summed
//      sequentially in double)                                             (append_sumsq_blocks,
//                                                                           global_norm)
//   5. clip = grad_clip > 0 && norm > grad_clip ? grad_clip / (norm + 1e-6) : 1, as float
//                                                                          (clip_scale)
//   6. lr(step): linear warm-up, then cosine to min_lr                     (learning_rate)
//   7. AdamW per tensor, decay only where param_info.decay, t = step + 1, grads scaled by clip
//                                                                          (adamw_update)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
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
};

/// AdamW moments of one chunk: fp32 flat buffers laid out exactly like the chunk's flat params.
struct optimizer_state {
  tensor exp_avg;
  tensor exp_avg_sq;
};

/// Zero-filled moments shaped like `c`'s flat parameter buffer, on the backend's device.
optimizer_state make_optimizer_state(kernels::backend& be, chunk& c);

/// Slots for every parameter of `c` in its parameter order, viewing `state` at the same offsets.
std::vector<param_slot> slots_of(chunk& c, optimizer_state& state);

/// Step 3: sums the two uses of a tied embedding in the fixed order (embedding, then head) and
/// gives the head copy the same gradient: g_wte += g_head; g_head = g_wte.
void tie_gradients(kernels::backend& be, tensor& g_wte, tensor& g_head);

/// Step 4, first half: appends the per-block fp64 sums of squares of each slot's gradient, slots in
/// the given order, skipping tied copies. Blocks are kernels::norm_block elements of one tensor.
void append_sumsq_blocks(kernels::backend& be, const std::vector<param_slot>& slots,
                         std::vector<double>& blocks);

/// Step 4, second half: sqrt of the sequential double sum of `blocks` in order.
double global_norm(const std::vector<double>& blocks);

/// Step 5: the factor gradients are multiplied by before AdamW.
float clip_scale(double norm, double grad_clip);

/// Step 6: learning rate of 0-based `step`: lr·(step+1)/warmup during warm-up, then cosine from lr
/// to min_lr over [warmup, steps). Computed in double.
double learning_rate(const core::optimizer_config& opt, const core::train_config& train, int step);

/// Step 7: one AdamW update of every slot (tied copies included, so both copies move identically)
/// at 0-based `step`, with the given learning rate and gradient scale.
void adamw_update(kernels::backend& be, std::vector<param_slot>& slots,
                  const core::optimizer_config& opt, double lr, float grad_scale, int step);

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
