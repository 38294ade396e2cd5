#include "model/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

namespace troupe::model {

optimizer_state make_optimizer_state(kernels::backend& be, chunk& c) {
  const core::shape_t& s = c.flat_params().shape();
  optimizer_state st{be.empty(s, core::dtype::f32), be.empty(s, core::dtype::f32)};
  be.zero(st.exp_avg);
  be.zero(st.exp_avg_sq);
  return st;
}

std::vector<param_slot> slots_of(chunk& c, optimizer_state& state) {
  std::vector<param_slot> out;
  out.reserve(c.params().size());
  for (const param_info& p : c.params()) {
    out.push_back(param_slot{p, c.param(p.name), c.grad(p.name),
                             state.exp_avg.slice(p.offset, p.shape),
                             state.exp_avg_sq.slice(p.offset, p.shape)});
  }
  return out;
}

void tie_gradients(kernels::backend& be, tensor& g_wte, tensor& g_head) {
  TROUPE_CHECK(g_wte.shape() == g_head.shape(),
               "tied gradients differ in shape: " + core::shape_string(g_wte.shape()) + " vs " +
                   core::shape_string(g_head.shape()));
  be.accumulate(g_head, g_wte);
  be.copy(g_wte, g_head);
}

void append_sumsq_blocks(kernels::backend& be, const std::vector<param_slot>& slots,
                         std::vector<double>& blocks) {
  auto blocks_of = [](const param_slot& s) {
    return s.info.tied ? 0 : (s.grad.numel() + kernels::norm_block - 1) / kernels::norm_block;
  };
  std::int64_t total = 0;
  for (const param_slot& s : slots) total += blocks_of(s);
  if (total == 0) return;
  // Every slot's blocks into one buffer, then one copy to the host: on a GPU each to_host waits
  // for the stream, and a model has hundreds of parameter tensors.
  tensor out = be.empty({total}, core::dtype::f64);
  std::int64_t at = 0;
  for (const param_slot& s : slots) {
    const std::int64_t nb = blocks_of(s);
    if (nb == 0) continue;
    tensor part = out.slice(at, {nb});
    be.sumsq_blocks(s.grad, part);
    at += nb;
  }
  tensor host = be.to_host(out);
  const double* p = host.data<double>();
  blocks.insert(blocks.end(), p, p + total);
}

double global_norm(const std::vector<double>& blocks) {
  double total = 0;
  for (double b : blocks) total += b;
  return std::sqrt(total);
}

float clip_scale(double norm, double grad_clip) {
  if (grad_clip > 0 && norm > grad_clip) return static_cast<float>(grad_clip / (norm + 1e-6));
  return 1.0f;
}

double learning_rate(const core::optimizer_config& opt, const core::train_config& train,
                     int step) {
  const int warmup = train.warmup_steps;
  if (step < warmup) return opt.lr * (step + 1) / warmup;
  double progress =
      static_cast<double>(step - warmup) / std::max(1, train.steps - warmup);
  progress = std::min(progress, 1.0);  // steps past the schedule (a longer resume) stay at min_lr
  return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

void adamw_update(kernels::backend& be, std::vector<param_slot>& slots,
                  const core::optimizer_config& opt, double lr, float grad_scale, int step) {
  adamw_update_t(be, slots, opt, lr, grad_scale, static_cast<std::int64_t>(step) + 1);
}

void adamw_update_t(kernels::backend& be, std::vector<param_slot>& slots,
                    const core::optimizer_config& opt, double lr, float grad_scale,
                    std::int64_t t) {
  kernels::adamw_params base;
  base.lr = static_cast<float>(lr);
  base.beta1 = static_cast<float>(opt.beta1);
  base.beta2 = static_cast<float>(opt.beta2);
  base.eps = static_cast<float>(opt.eps);
  base.grad_scale = grad_scale;
  base.step = static_cast<int>(t);
  tensor no_low;
  for (param_slot& s : slots) {
    kernels::adamw_params p = base;
    p.weight_decay = s.info.decay ? static_cast<float>(opt.weight_decay) : 0.0f;
    be.adamw(s.param, s.grad, s.exp_avg, s.exp_avg_sq, p, no_low);
  }
}

loss_scaler loss_scaler::from(const core::precision_config& p, std::int64_t updates_done) {
  loss_scaler s;
  s.enabled = p.dynamic_loss_scale;
  s.scale = s.enabled ? static_cast<float>(p.loss_scale) : 1.0f;
  s.window = p.loss_scale_window;
  s.updates = updates_done;
  return s;
}

void loss_scaler::record(bool applied) {
  if (!enabled) {
    ++updates;
    return;
  }
  if (!applied) {
    // Halving a normal float is exact; the floor keeps a scale that keeps overflowing (a model that
    // diverged, not a scale that is too large) from reaching zero and turning every gradient to 0.
    scale = std::max(scale * 0.5f, std::numeric_limits<float>::min());
    good_steps = 0;
    return;
  }
  ++updates;
  if (++good_steps >= window) {
    good_steps = 0;
    const float grown = scale * 2.0f;
    if (std::isfinite(grown)) scale = grown;
  }
}

std::vector<double> loss_scaler::to_vector() const {
  return {static_cast<double>(scale), static_cast<double>(good_steps),
          static_cast<double>(updates)};
}

core::result<loss_scaler> loss_scaler::from_vector(const core::precision_config& p,
                                                   const std::vector<double>& v,
                                                   const std::string& where) {
  if (v.size() != 3 || !(v[0] > 0) || !std::isfinite(v[0]) || v[1] < 0 || v[2] < 0)
    return core::error::at_file(where, std::string("tensor ") + loss_scaler_tensor_name +
                                           " is not a loss-scaler state {scale, good steps, "
                                           "updates}",
                                "the checkpoint is damaged or not written by troupe");
  loss_scaler s = from(p, static_cast<std::int64_t>(v[2]));
  s.scale = static_cast<float>(v[0]);
  s.good_steps = static_cast<int>(v[1]);
  return s;
}

float loss_grad_scale(float loss_scale, std::int64_t tokens_per_step) {
  return loss_scale / static_cast<float>(tokens_per_step);
}

step_decision decide_step(const std::vector<double>& blocks, loss_scaler& scaler,
                          const core::optimizer_config& opt, const core::train_config& train,
                          int step) {
  step_decision d;
  d.loss_scale = scaler.scale;
  const double scaled = global_norm(blocks);
  d.grad_norm = scaler.enabled ? scaled / static_cast<double>(scaler.scale) : scaled;
  d.lr = learning_rate(opt, train, step);
  d.skip = scaler.enabled && !std::isfinite(scaled);
  d.clip = d.skip ? 1.0f : clip_scale(d.grad_norm, train.grad_clip);
  d.grad_scale = scaler.enabled ? d.clip / scaler.scale : d.clip;
  d.adam_step = scaler.adam_step(step);
  scaler.record(!d.skip);
  d.next_loss_scale = scaler.scale;
  return d;
}

optimizer_step_stats optimizer_step(kernels::backend& be, std::vector<param_slot>& slots,
                                    const core::optimizer_config& opt,
                                    const core::train_config& train, int step) {
  std::vector<double> blocks;
  append_sumsq_blocks(be, slots, blocks);
  optimizer_step_stats st;
  st.grad_norm = global_norm(blocks);
  st.clip = clip_scale(st.grad_norm, train.grad_clip);
  st.lr = learning_rate(opt, train, step);
  adamw_update(be, slots, opt, st.lr, st.clip, step);
  return st;
}

}  // namespace troupe::model
