#include "model/optimizer.hpp"

#include <algorithm>
#include <cmath>
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
  for (const param_slot& s : slots) {
    if (s.info.tied) continue;
    std::int64_t n = s.grad.numel();
    if (n == 0) continue;
    std::int64_t nb = (n + kernels::norm_block - 1) / kernels::norm_block;
    tensor out = be.empty({nb}, core::dtype::f64);
    be.sumsq_blocks(s.grad, out);
    tensor host = be.to_host(out);
    const double* p = host.data<double>();
    blocks.insert(blocks.end(), p, p + nb);
  }
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
  kernels::adamw_params base;
  base.lr = static_cast<float>(lr);
  base.beta1 = static_cast<float>(opt.beta1);
  base.beta2 = static_cast<float>(opt.beta2);
  base.eps = static_cast<float>(opt.eps);
  base.grad_scale = grad_scale;
  base.step = step + 1;
  tensor no_low;
  for (param_slot& s : slots) {
    kernels::adamw_params p = base;
    p.weight_decay = s.info.decay ? static_cast<float>(opt.weight_decay) : 0.0f;
    be.adamw(s.param, s.grad, s.exp_avg, s.exp_avg_sq, p, no_low);
  }
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
