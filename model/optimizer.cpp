#include "model/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "kernels/clip.hpp"

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
  const tensor& low = c.flat_low();
  for (const param_info& p : c.params()) {
    out.push_back(param_slot{p, c.param(p.name), c.grad(p.name),
                             state.exp_avg.slice(p.offset, p.shape),
                             state.exp_avg_sq.slice(p.offset, p.shape),
                             low.defined() ? low.slice(p.offset, p.shape) : tensor{}});
  }
  return out;
}

void tie_gradients(kernels::backend& be, tensor& g_wte, tensor& g_head, bool head_copy) {
  TROUPE_CHECK(g_wte.shape() == g_head.shape(),
               "tied gradients differ in shape: " + core::shape_string(g_wte.shape()) + " vs " +
                   core::shape_string(g_head.shape()));
  be.accumulate(g_head, g_wte);
  if (head_copy) be.copy(g_wte, g_head);
}

void add_sumsq(kernels::backend& be, const std::vector<param_slot>& slots, tensor& acc) {
  auto blocks_of = [](const param_slot& s) {
    return s.info.tied ? 0 : (s.grad.numel() + kernels::norm_block - 1) / kernels::norm_block;
  };
  std::int64_t total = 0;
  for (const param_slot& s : slots) total += blocks_of(s);
  if (total == 0) return;
  // Every slot's blocks into one buffer by one call, summed on the device: a model has hundreds
  // of parameter tensors and ~10^5 blocks per 10^8 parameters, none of which the host needs.
  tensor blocks = be.empty({total}, core::dtype::f64);
  std::vector<tensor> grads;
  grads.reserve(slots.size());
  for (const param_slot& s : slots)
    if (blocks_of(s) > 0) grads.push_back(s.grad);
  be.sumsq_blocks_list(grads, blocks);
  be.exact_sum_add(blocks, acc);
}

namespace {

/// The exact sum that `add` accumulates on the device, read back.
template <class Add>
core::exact_sum device_exact_sum(kernels::backend& be, Add add) {
  tensor acc = be.empty({core::exact_sum_words}, core::dtype::i64);
  be.zero(acc);
  add(acc);
  core::exact_sum s;
  tensor host = tensor::zeros({core::exact_sum_words}, core::dtype::i64);
  be.copy(acc, host);
  s.merge(host.data<std::int64_t>());
  return s;
}

}  // namespace

core::exact_sum gradient_sumsq(kernels::backend& be, const std::vector<param_slot>& slots) {
  return device_exact_sum(be, [&](tensor& acc) { add_sumsq(be, slots, acc); });
}

core::exact_sum exact_sum_of(kernels::backend& be, const tensor& blocks) {
  return device_exact_sum(be, [&](tensor& acc) {
    if (blocks.numel() > 0) be.exact_sum_add(blocks, acc);
  });
}

double global_norm(const core::exact_sum& sumsq) { return std::sqrt(sumsq.value()); }

float clip_scale(double norm, double grad_clip) { return kernels::clip_scale_of(norm, grad_clip); }

device_clip make_device_clip(kernels::backend& be) {
  device_clip dc;
  dc.sumsq = be.empty({core::exact_sum_words}, core::dtype::i64);
  dc.guard = be.empty({core::exact_sum_words}, core::dtype::i64);
  dc.out = be.empty({2}, core::dtype::f64);
  dc.schedule = be.empty({3}, core::dtype::f32);
  dc.host = tensor::zeros({2}, core::dtype::f64);
  dc.schedule_host = tensor::zeros({3}, core::dtype::f32);
  return dc;
}

void set_adamw_schedule(kernels::backend& be, const core::optimizer_config& opt, double lr,
                        std::int64_t t, device_clip& dc) {
  float* h = dc.schedule_host.data<float>();
  h[0] = static_cast<float>(lr);
  h[1] = kernels::adamw_bias_correction(static_cast<float>(opt.beta1), t);
  h[2] = kernels::adamw_bias_correction(static_cast<float>(opt.beta2), t);
  be.copy(dc.schedule_host, dc.schedule);
}

void begin_device_step(kernels::backend& be, device_clip& dc) { be.zero(dc.guard); }

void guard_losses(kernels::backend& be, const tensor& loss_rows, device_clip& dc) {
  tensor blocks = be.empty({(loss_rows.numel() + kernels::norm_block - 1) / kernels::norm_block},
                           core::dtype::f64);
  be.sumsq_blocks(loss_rows, blocks);
  be.exact_sum_add(blocks, dc.guard);
}

void clip_and_update_on_device(kernels::backend& be, std::vector<param_slot>& slots,
                               const core::optimizer_config& opt, const core::train_config& train,
                               device_clip& dc) {
  be.zero(dc.sumsq);
  add_sumsq(be, slots, dc.sumsq);
  be.clip_factor(dc.sumsq, dc.guard, train.grad_clip, dc.out);
  // lr and t are placeholders: dc.schedule replaces them on the device.
  adamw_update_t(be, slots, opt, 0.0, 1.0f, 1, dc.out.slice(1, {1}), dc.schedule);
}

device_clip_result read_device_clip(kernels::backend& be, device_clip& dc) {
  be.copy(dc.out, dc.host);
  const double* h = dc.host.data<double>();
  return {h[0], h[1]};
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

namespace {

std::int64_t element_offset(const tensor& t) {
  return static_cast<std::int64_t>(t.byte_offset() / core::dtype_size(t.type()));
}

/// Element offset of slot b's tensor `field` relative to slot a's, when both view one storage.
template <class F>
bool same_shift(const param_slot& a, const param_slot& b, F field, std::int64_t shift) {
  const tensor& x = field(a);
  const tensor& y = field(b);
  if (x.defined() != y.defined()) return false;
  if (!x.defined()) return true;
  return x.store() == y.store() && x.type() == y.type() &&
         element_offset(y) - element_offset(x) == shift;
}

/// True when slot b sits in the same flat buffers as slot a at one common shift, so both can be
/// runs of one adamw_runs call.
bool same_buffers(const param_slot& a, const param_slot& b) {
  if (a.param.store() != b.param.store() || a.param.type() != b.param.type()) return false;
  const std::int64_t shift = element_offset(b.param) - element_offset(a.param);
  return same_shift(a, b, [](const param_slot& s) -> const tensor& { return s.grad; }, shift) &&
         same_shift(a, b, [](const param_slot& s) -> const tensor& { return s.exp_avg; }, shift) &&
         same_shift(a, b, [](const param_slot& s) -> const tensor& { return s.exp_avg_sq; }, shift) &&
         same_shift(a, b, [](const param_slot& s) -> const tensor& { return s.low; }, shift);
}

/// A view of `t`'s storage from `from` elements after t's start, `n` elements long.
tensor span_of(const tensor& t, std::int64_t from, std::int64_t n) {
  if (!t.defined()) return {};
  const std::int64_t begin = element_offset(t) + from;
  return tensor::over(t.store(), static_cast<std::size_t>(begin) * core::dtype_size(t.type()), {n},
                      t.type());
}

/// The runs sorted, adjacent runs with the same decay flag made one (fewer runs, the same
/// element-wise arithmetic).
std::vector<kernels::adamw_run> merge_runs(std::vector<kernels::adamw_run> runs) {
  std::sort(runs.begin(), runs.end(),
            [](const kernels::adamw_run& a, const kernels::adamw_run& b) { return a.begin < b.begin; });
  std::vector<kernels::adamw_run> merged;
  for (const kernels::adamw_run& r : runs) {
    if (!merged.empty() && merged.back().end == r.begin && merged.back().decay == r.decay)
      merged.back().end = r.end;
    else
      merged.push_back(r);
  }
  return merged;
}

/// AdamW's arguments for adamw_update_t.
kernels::adamw_params adamw_params_of(const core::optimizer_config& opt, double lr,
                                      float grad_scale, std::int64_t t, const tensor& grad_factor,
                                      const tensor& schedule) {
  kernels::adamw_params base;
  base.lr = static_cast<float>(lr);
  base.beta1 = static_cast<float>(opt.beta1);
  base.beta2 = static_cast<float>(opt.beta2);
  base.eps = static_cast<float>(opt.eps);
  base.grad_scale = grad_scale;
  base.grad_factor = grad_factor;
  base.schedule = schedule;
  base.step = static_cast<int>(t);
  base.weight_decay = static_cast<float>(opt.weight_decay);
  return base;
}

/// One adamw_runs call over slots [first, last), which all pass same_buffers with slots[first].
void adamw_group(kernels::backend& be, std::vector<param_slot>& slots, std::size_t first,
                 std::size_t last, const kernels::adamw_params& p) {
  const param_slot& base = slots[first];
  std::int64_t lo = 0, hi = 0;
  bool any = false;
  for (std::size_t i = first; i < last; ++i) {
    const std::int64_t at = element_offset(slots[i].param) - element_offset(base.param);
    const std::int64_t n = slots[i].param.numel();
    for (const tensor* t : {&slots[i].grad, &slots[i].exp_avg, &slots[i].exp_avg_sq, &slots[i].low})
      TROUPE_CHECK(!t->defined() || t->numel() == n,
                   "optimizer slot " + slots[i].info.name + ": its tensors differ in size");
    if (n == 0) continue;
    lo = any ? std::min(lo, at) : at;
    hi = any ? std::max(hi, at + n) : at + n;
    any = true;
  }
  if (!any) return;
  std::vector<kernels::adamw_run> runs;
  for (std::size_t i = first; i < last; ++i) {
    const std::int64_t n = slots[i].param.numel();
    if (n == 0) continue;
    const std::int64_t at = element_offset(slots[i].param) - element_offset(base.param) - lo;
    runs.push_back({at, at + n, slots[i].info.decay});
  }
  const std::vector<kernels::adamw_run> merged = merge_runs(std::move(runs));
  const std::int64_t n = hi - lo;
  tensor param = span_of(base.param, lo, n), grad = span_of(base.grad, lo, n);
  tensor m = span_of(base.exp_avg, lo, n), v = span_of(base.exp_avg_sq, lo, n);
  tensor low = span_of(base.low, lo, n);
  be.adamw_runs(param, grad, m, v, merged, p, low);
}

}  // namespace

void adamw_update(kernels::backend& be, std::vector<param_slot>& slots,
                  const core::optimizer_config& opt, double lr, float grad_scale, int step) {
  adamw_update_t(be, slots, opt, lr, grad_scale, static_cast<std::int64_t>(step) + 1);
}

void adamw_update_t(kernels::backend& be, std::vector<param_slot>& slots,
                    const core::optimizer_config& opt, double lr, float grad_scale,
                    std::int64_t t, const tensor& grad_factor, const tensor& schedule) {
  const kernels::adamw_params base = adamw_params_of(opt, lr, grad_scale, t, grad_factor, schedule);
  for (std::size_t first = 0; first < slots.size();) {
    std::size_t last = first + 1;
    while (last < slots.size() && same_buffers(slots[first], slots[last])) ++last;
    adamw_group(be, slots, first, last, base);
    first = last;
  }
}

void adamw_update_hashed(kernels::backend& be, const std::vector<param_slot>& slots,
                         const core::optimizer_config& opt, double lr, float grad_scale,
                         std::int64_t t, param_slot& whole, tensor& blocks) {
  kernels::adamw_params p = adamw_params_of(opt, lr, grad_scale, t, {}, {});
  std::vector<kernels::adamw_run> runs;
  for (const param_slot& s : slots) {
    const std::int64_t n = s.param.numel();
    if (n == 0) continue;
    const std::int64_t at = element_offset(s.param) - element_offset(whole.param);
    TROUPE_CHECK(at >= 0 && at + n <= whole.param.numel() && same_buffers(whole, s),
                 "optimizer slot " + s.info.name + " does not lie in the buffers it is updated with");
    for (const tensor* x : {&s.grad, &s.exp_avg, &s.exp_avg_sq, &s.low})
      TROUPE_CHECK(!x->defined() || x->numel() == n,
                   "optimizer slot " + s.info.name + ": its tensors differ in size");
    runs.push_back({at, at + n, s.info.decay});
  }
  be.adamw_runs_hashed(whole.param, whole.grad, whole.exp_avg, whole.exp_avg_sq, merge_runs(runs),
                       p, whole.low, blocks);
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

step_decision decide_step(const core::exact_sum& sumsq, loss_scaler& scaler,
                          const core::optimizer_config& opt, const core::train_config& train,
                          int step) {
  step_decision d;
  d.loss_scale = scaler.scale;
  const double scaled = global_norm(sumsq);
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
  optimizer_step_stats st;
  st.grad_norm = global_norm(gradient_sumsq(be, slots));
  st.clip = clip_scale(st.grad_norm, train.grad_clip);
  st.lr = learning_rate(opt, train, step);
  adamw_update(be, slots, opt, st.lr, st.clip, step);
  return st;
}

}  // namespace troupe::model
