#include "model/optimizer.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "kernels/select.hpp"

namespace {

using troupe::core::tensor;
using namespace troupe::model;
namespace core = troupe::core;
namespace kernels = troupe::kernels;

std::unique_ptr<troupe::kernels::backend> cpu() { return troupe::kernels::make_backend("cpu"); }

tensor filled(troupe::core::shape_t shape, float start, float step) {
  tensor t = tensor::zeros(std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + step * static_cast<float>(i % 97);
  return t;
}

param_slot make_slot(const std::string& name, troupe::core::shape_t shape, bool decay,
                     bool tied, float p0, float g0) {
  param_slot s;
  s.info.name = name;
  s.info.shape = shape;
  s.info.numel = troupe::core::numel_of(shape);
  s.info.decay = decay;
  s.info.tied = tied;
  s.param = filled(shape, p0, 0.01f);
  s.grad = filled(shape, g0, -0.003f);
  s.exp_avg = tensor::zeros(shape);
  s.exp_avg_sq = tensor::zeros(shape);
  return s;
}

// AdamW as PyTorch defines it (decoupled decay applied to the old weights), in double.
struct scalar_adamw {
  double p, m = 0, v = 0;
  void step(double g, double lr, double b1, double b2, double eps, double wd, int t) {
    p -= lr * wd * p;
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    double mhat = m / (1 - std::pow(b1, t));
    double vhat = v / (1 - std::pow(b2, t));
    p -= lr * mhat / (std::sqrt(vhat) + eps);
  }
};

troupe::core::optimizer_config opt_config() {
  troupe::core::optimizer_config o;
  o.lr = 1e-2;
  o.min_lr = 1e-3;
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  return o;
}

}  // namespace

TEST_CASE("learning rate warms up linearly, then follows a cosine down to min_lr") {
  troupe::core::optimizer_config o;
  o.lr = 1e-3;
  o.min_lr = 1e-4;
  troupe::core::train_config t;
  t.steps = 100;
  t.warmup_steps = 10;
  CHECK(learning_rate(o, t, 0) == doctest::Approx(1e-4).epsilon(1e-12));
  CHECK(learning_rate(o, t, 4) == doctest::Approx(5e-4).epsilon(1e-12));
  CHECK(learning_rate(o, t, 9) == doctest::Approx(1e-3).epsilon(1e-12));
  CHECK(learning_rate(o, t, 10) == doctest::Approx(1e-3).epsilon(1e-12));  // progress 0
  CHECK(learning_rate(o, t, 55) == doctest::Approx(5.5e-4).epsilon(1e-12));  // half way: mean
  const double last = 1e-4 + 0.45e-3 * (1 + std::cos(M_PI * 89.0 / 90.0));
  CHECK(learning_rate(o, t, 99) == doctest::Approx(last).epsilon(1e-12));
  CHECK(learning_rate(o, t, 150) == doctest::Approx(1e-4).epsilon(1e-12));  // past the schedule

  t.warmup_steps = 0;
  CHECK(learning_rate(o, t, 0) == doctest::Approx(1e-3).epsilon(1e-12));
  t.steps = 1;  // a one-step run does not divide by zero
  CHECK(learning_rate(o, t, 0) == doctest::Approx(1e-3).epsilon(1e-12));
}

TEST_CASE("clip scale is grad_clip / (norm + 1e-6) above the threshold and 1 otherwise") {
  CHECK(clip_scale(2.0, 1.0) == static_cast<float>(1.0 / (2.0 + 1e-6)));
  CHECK(clip_scale(0.5, 1.0) == 1.0f);
  CHECK(clip_scale(1.0, 1.0) == 1.0f);
  CHECK(clip_scale(1e6, 0.0) == 1.0f);  // 0 disables clipping
}

TEST_CASE("global norm is the exact sum of the fp64 blocks of every gradient, skipping the tied "
          "copy") {
  auto be = cpu();
  std::vector<param_slot> slots = {make_slot("a", {3, 1000}, true, false, 0.1f, 0.5f),
                                   make_slot("b", {5}, false, false, 0.0f, -2.0f),
                                   make_slot("lm_head", {3, 1000}, true, true, 0.1f, 9.0f)};
  const core::exact_sum got = gradient_sumsq(*be, slots);

  // The blocks one by one: ceil(3000 / 1024) of a, one of b, none of the tied copy.
  core::exact_sum blocks;
  for (int s = 0; s < 2; ++s) {
    tensor out = tensor::zeros({(slots[s].grad.numel() + kernels::norm_block - 1) /
                                kernels::norm_block},
                               core::dtype::f64);
    be->sumsq_blocks(slots[s].grad, out);
    for (std::int64_t i = 0; i < out.numel(); ++i) blocks.add(out.data<double>()[i]);
  }
  CHECK(std::memcmp(got.words, blocks.words, sizeof got.words) == 0);

  double want = 0;
  for (int s = 0; s < 2; ++s)
    for (std::int64_t i = 0; i < slots[s].grad.numel(); ++i) {
      double g = slots[s].grad.data<float>()[i];
      want += g * g;
    }
  CHECK(global_norm(got) == doctest::Approx(std::sqrt(want)).epsilon(1e-12));

  // The tied copy's gradient is left out: changing it changes nothing.
  slots[2].grad.data<float>()[7] = 1e6f;
  const core::exact_sum again = gradient_sumsq(*be, slots);
  CHECK(std::memcmp(got.words, again.words, sizeof got.words) == 0);
}

TEST_CASE("the clip decided on the device gives the bits of the host's decision and AdamW") {
  auto be = cpu();
  core::optimizer_config o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  core::train_config t;
  t.steps = 20;
  t.warmup_steps = 4;
  auto make = [] {
    return std::vector<param_slot>{make_slot("w", {3, 500}, true, false, 0.2f, 0.3f),
                                   make_slot("b", {500}, false, false, 0.0f, -0.2f)};
  };
  for (double clip : {0.0, 1.0, 1e6}) {
    CAPTURE(clip);
    t.grad_clip = clip;
    auto a = make();
    auto b = make();
    device_clip dc = make_device_clip(*be);
    const double lr = learning_rate(o, t, 6);
    set_adamw_schedule(*be, o, lr, 7, dc);
    begin_device_step(*be, dc);
    clip_and_update_on_device(*be, a, o, t, dc);
    const device_clip_result r = read_device_clip(*be, dc);

    const double norm = global_norm(gradient_sumsq(*be, b));
    CHECK(r.grad_norm == norm);
    CHECK(static_cast<float>(r.clip) == clip_scale(norm, clip));
    if (clip == 1.0) CHECK(r.clip < 1.0);  // the case exercises clipping
    adamw_update_t(*be, b, o, lr, clip_scale(norm, clip), 7);
    for (int s = 0; s < 2; ++s) {
      CHECK(std::memcmp(a[s].param.raw(), b[s].param.raw(), a[s].param.bytes()) == 0);
      CHECK(std::memcmp(a[s].exp_avg_sq.raw(), b[s].exp_avg_sq.raw(), a[s].param.bytes()) == 0);
    }
  }
}

TEST_CASE("the clip decided on the device skips AdamW when the norm or a guarded loss is not "
          "finite") {
  auto be = cpu();
  core::optimizer_config o;
  core::train_config t;
  t.grad_clip = 1.0;
  for (bool in_loss : {false, true})
    for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
      CAPTURE(in_loss);
      std::vector<param_slot> a = {make_slot("w", {3, 500}, true, false, 0.2f, 0.3f)};
      tensor losses = filled({2000}, 1.5f, 0.01f);
      (in_loss ? losses.data<float>()[1999] : a[0].grad.data<float>()[321]) = bad;
      const tensor before = a[0].param.clone();
      device_clip dc = make_device_clip(*be);
      set_adamw_schedule(*be, o, 1e-3, 1, dc);
      begin_device_step(*be, dc);
      guard_losses(*be, losses, dc);
      clip_and_update_on_device(*be, a, o, t, dc);
      const device_clip_result r = read_device_clip(*be, dc);
      CHECK(std::isfinite(r.grad_norm) == in_loss);
      CHECK(std::isnan(r.clip));
      CHECK(std::memcmp(before.raw(), a[0].param.raw(), before.bytes()) == 0);
      CHECK(a[0].exp_avg.data<float>()[0] == 0.0f);
      // The next step clears the guard: finite inputs update again.
      (in_loss ? losses.data<float>()[1999] : a[0].grad.data<float>()[321]) = 0.5f;
      begin_device_step(*be, dc);
      guard_losses(*be, losses, dc);
      clip_and_update_on_device(*be, a, o, t, dc);
      CHECK(std::isfinite(read_device_clip(*be, dc).clip));
      CHECK(std::memcmp(before.raw(), a[0].param.raw(), before.bytes()) != 0);
    }
}

TEST_CASE("tie_gradients adds the head gradient to the embedding's and copies the sum back") {
  auto be = cpu();
  tensor wte = filled({4, 3}, 1.0f, 0.5f);
  tensor head = filled({4, 3}, -2.0f, 0.25f);
  tensor want = wte.clone();
  for (int i = 0; i < 12; ++i) want.data<float>()[i] += head.data<float>()[i];
  tensor wte_alone = wte.clone(), head_alone = head.clone(), head_before = head.clone();
  tie_gradients(*be, wte, head);
  CHECK(std::memcmp(wte.raw(), want.raw(), want.bytes()) == 0);
  CHECK(std::memcmp(head.raw(), want.raw(), want.bytes()) == 0);
  // A head that shares the embedding has no copy to give the sum: the sum alone.
  tie_gradients(*be, wte_alone, head_alone, false);
  CHECK(std::memcmp(wte_alone.raw(), want.raw(), want.bytes()) == 0);
  CHECK(std::memcmp(head_alone.raw(), head_before.raw(), want.bytes()) == 0);
}

TEST_CASE("adamw_update follows scalar AdamW for three steps, decaying only flagged tensors") {
  auto be = cpu();
  auto o = opt_config();
  std::vector<param_slot> slots = {make_slot("w", {2, 700}, true, false, -0.3f, 0.2f),
                                   make_slot("bias", {700}, false, false, 0.4f, -0.1f)};
  std::vector<std::vector<scalar_adamw>> ref(2);
  for (int s = 0; s < 2; ++s)
    for (std::int64_t i = 0; i < slots[s].param.numel(); ++i)
      ref[s].push_back({slots[s].param.data<float>()[i]});

  const float scales[] = {1.0f, 0.5f, 0.25f};
  const double lrs[] = {1e-2, 5e-3, 2e-3};
  for (int step = 0; step < 3; ++step) {
    adamw_update(*be, slots, o, lrs[step], scales[step], step);
    for (int s = 0; s < 2; ++s) {
      const double wd = slots[s].info.decay ? o.weight_decay : 0.0;
      for (std::int64_t i = 0; i < slots[s].param.numel(); ++i) {
        double g = static_cast<double>(slots[s].grad.data<float>()[i]) * scales[step];
        ref[s][i].step(g, static_cast<float>(lrs[step]), static_cast<float>(o.beta1),
                       static_cast<float>(o.beta2), static_cast<float>(o.eps), static_cast<float>(wd),
                       step + 1);
      }
    }
  }
  for (int s = 0; s < 2; ++s) {
    INFO("tensor ", slots[s].info.name);
    double worst = 0;
    for (std::int64_t i = 0; i < slots[s].param.numel(); ++i) {
      double got = slots[s].param.data<float>()[i];
      worst = std::max(worst, std::abs(got - ref[s][i].p) / std::max(1e-3, std::abs(ref[s][i].p)));
      double m = slots[s].exp_avg.data<float>()[i], v = slots[s].exp_avg_sq.data<float>()[i];
      REQUIRE(m == doctest::Approx(ref[s][i].m).epsilon(1e-5));
      REQUIRE(v == doctest::Approx(ref[s][i].v).epsilon(1e-5));
    }
    CHECK(worst < 2e-6);
  }
}

TEST_CASE("decoupled weight decay moves a zero-gradient weight only when it decays") {
  auto be = cpu();
  auto o = opt_config();
  param_slot w = make_slot("w", {8, 8}, true, false, 0.5f, 0.0f);
  param_slot b = make_slot("b", {8}, false, false, 0.5f, 0.0f);
  be->zero(w.grad);
  be->zero(b.grad);
  tensor w0 = w.param.clone(), b0 = b.param.clone();
  std::vector<param_slot> slots = {w, b};
  adamw_update(*be, slots, o, 1e-2, 1.0f, 0);
  CHECK(std::memcmp(b.param.raw(), b0.raw(), b0.bytes()) == 0);
  for (int i = 0; i < 64; ++i)
    CHECK(w.param.data<float>()[i] ==
          doctest::Approx(w0.data<float>()[i] * (1 - 1e-2 * 0.1)).epsilon(1e-6));
}

TEST_CASE("optimizer_step equals norm, clip, schedule and AdamW applied one by one") {
  auto be = cpu();
  auto o = opt_config();
  troupe::core::train_config t;
  t.steps = 20;
  t.warmup_steps = 4;
  t.grad_clip = 1.0;
  auto make = [] {
    return std::vector<param_slot>{make_slot("w", {3, 500}, true, false, 0.2f, 0.3f),
                                   make_slot("b", {500}, false, false, 0.0f, -0.2f)};
  };
  auto a = make();
  auto b = make();
  optimizer_step_stats st = optimizer_step(*be, a, o, t, 6);

  const double norm = global_norm(gradient_sumsq(*be, b));
  REQUIRE(norm > t.grad_clip);  // the case exercises clipping
  CHECK(st.grad_norm == norm);
  CHECK(st.clip == clip_scale(norm, t.grad_clip));
  CHECK(st.lr == learning_rate(o, t, 6));
  adamw_update(*be, b, o, st.lr, st.clip, 6);
  for (int s = 0; s < 2; ++s)
    CHECK(std::memcmp(a[s].param.raw(), b[s].param.raw(), a[s].param.bytes()) == 0);
}

TEST_CASE("adamw_update over views of one flat buffer equals one adamw call per slot, low copy "
          "included, padding untouched") {
  auto be = cpu();
  auto o = opt_config();
  // Three tensors at offsets of a padded flat buffer (as a chunk lays them out), plus a slot in a
  // buffer of its own; the first three go to the backend as one adamw_runs call.
  const std::int64_t n = 3 * 1024;
  struct layout {
    std::string name;
    troupe::core::shape_t shape;
    std::int64_t offset;
    bool decay;
  };
  const std::vector<layout> ls = {{"w", {3, 300}, 0, true}, {"b", {700}, 1024, false},
                                  {"w2", {2, 500}, 2048, true}};
  auto make = [&] {
    std::vector<tensor> flat = {filled({n}, 0.3f, 0.01f), filled({n}, -0.2f, 0.004f),
                                filled({n}, 0.01f, 0.0f), filled({n}, 0.02f, 0.0f),
                                tensor::zeros({n}, troupe::core::dtype::bf16)};
    std::vector<param_slot> slots;
    for (const layout& l : ls) {
      param_slot s;
      s.info.name = l.name;
      s.info.shape = l.shape;
      s.info.numel = troupe::core::numel_of(l.shape);
      s.info.offset = l.offset;
      s.info.decay = l.decay;
      s.param = flat[0].slice(l.offset, l.shape);
      s.grad = flat[1].slice(l.offset, l.shape);
      s.exp_avg = flat[2].slice(l.offset, l.shape);
      s.exp_avg_sq = flat[3].slice(l.offset, l.shape);
      s.low = flat[4].slice(l.offset, l.shape);
      slots.push_back(s);
    }
    slots.push_back(make_slot("own", {40}, true, false, 0.1f, 0.05f));
    return std::make_pair(flat, slots);
  };
  auto [fa, sa] = make();
  auto [fb, sb] = make();
  const tensor own_before = sb.back().param.clone();
  adamw_update(*be, sa, o, 3e-3, 0.5f, 4);
  for (param_slot& s : sb) {
    troupe::kernels::adamw_params p;
    p.lr = static_cast<float>(3e-3);
    p.beta1 = static_cast<float>(o.beta1);
    p.beta2 = static_cast<float>(o.beta2);
    p.eps = static_cast<float>(o.eps);
    p.grad_scale = 0.5f;
    p.step = 5;
    p.weight_decay = s.info.decay ? static_cast<float>(o.weight_decay) : 0.0f;
    be->adamw(s.param, s.grad, s.exp_avg, s.exp_avg_sq, p, s.low);
  }
  for (std::size_t i = 0; i < fa.size(); ++i) {
    INFO("flat buffer " << i);
    CHECK(std::memcmp(fa[i].raw(), fb[i].raw(), fa[i].bytes()) == 0);
  }
  CHECK(std::memcmp(sa.back().param.raw(), sb.back().param.raw(), 40 * sizeof(float)) == 0);
  CHECK(std::memcmp(sb.back().param.raw(), own_before.raw(), 40 * sizeof(float)) != 0);
  // padding after "w" (900 elements) and after "b": untouched params, a zero low copy
  const tensor fresh = filled({n}, 0.3f, 0.01f);
  for (std::int64_t gap : {std::int64_t{900}, std::int64_t{1023}, std::int64_t{1024 + 700},
                            std::int64_t{2047}, std::int64_t{2048 + 1000}, n - 1}) {
    INFO("padding element " << gap);
    CHECK(fa[0].data<float>()[gap] == fresh.data<float>()[gap]);
    CHECK(fa[4].data<std::uint16_t>()[gap] == 0);
  }
  CHECK(fa[4].data<std::uint16_t>()[1] != 0);
}
