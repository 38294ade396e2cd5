// Dynamic loss scaling on the CPU (fp32 with precision.dynamic_loss_scale = true): the scaler's
// rules, the config default, and the single-rank trainer skipping overflowing steps.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "model/metrics.hpp"
#include "model/optimizer.hpp"
#include "model/trainer.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "kernels/select.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using model::testing::tiny_run;

core::precision_config scaling(double initial, int window) {
  core::precision_config p;
  p.dynamic_loss_scale = true;
  p.loss_scale = initial;
  p.loss_scale_window = window;
  return p;
}

std::vector<float> host_floats(kernels::backend& be, const core::tensor& t) {
  core::tensor h = be.to_host(t);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("the loss scaler halves on overflow and doubles after window good steps in a row") {
  auto s = model::loss_scaler::from(scaling(1024, 3));
  REQUIRE(s.enabled);
  CHECK(s.scale == 1024.0f);
  s.record(false);
  CHECK(s.scale == 512.0f);
  CHECK(s.updates == 0);
  s.record(true);
  s.record(true);
  CHECK(s.scale == 512.0f);
  s.record(false);  // an overflow resets the run of good steps
  CHECK(s.scale == 256.0f);
  s.record(true);
  s.record(true);
  CHECK(s.scale == 256.0f);
  s.record(true);
  CHECK(s.scale == 512.0f);
  CHECK(s.good_steps == 0);
  CHECK(s.updates == 5);
}

TEST_CASE("the loss scale never grows to infinity nor shrinks to zero") {
  auto s = model::loss_scaler::from(scaling(std::numeric_limits<float>::max(), 1));
  s.record(true);
  CHECK(s.scale == std::numeric_limits<float>::max());
  s = model::loss_scaler::from(scaling(1e-37, 1));
  for (int i = 0; i < 10; ++i) s.record(false);
  CHECK(s.scale == std::numeric_limits<float>::min());
}

TEST_CASE("AdamW's t counts applied updates under dynamic loss scaling and steps without it") {
  auto on = model::loss_scaler::from(scaling(4, 100));
  on.record(false);
  on.record(true);
  CHECK(on.adam_step(7) == 2);
  auto off = model::loss_scaler::from(core::precision_config{});
  CHECK_FALSE(off.enabled);
  CHECK(off.scale == 1.0f);
  CHECK(off.adam_step(7) == 8);
}

TEST_CASE("the loss scaler's state reads back from its vector and refuses a damaged one") {
  auto s = model::loss_scaler::from(scaling(2048, 5));
  s.record(false);
  s.record(true);
  auto back = model::loss_scaler::from_vector(scaling(2048, 5), s.to_vector(), "x");
  REQUIRE(back.ok());
  CHECK(back->scale == s.scale);
  CHECK(back->good_steps == 1);
  CHECK(back->updates == 1);
  CHECK_FALSE(model::loss_scaler::from_vector(scaling(2048, 5), {0.0, 0.0, 0.0}, "x").ok());
  CHECK_FALSE(model::loss_scaler::from_vector(scaling(2048, 5), {1.0}, "x").ok());
}

TEST_CASE("decide_step unscales the norm, folds 1/scale into AdamW's factor and skips on inf") {
  core::optimizer_config opt;
  core::train_config train;
  train.grad_clip = 1.0;
  auto s = model::loss_scaler::from(scaling(8, 100));
  // Σ blocks = 64·9 → scaled norm 24, true norm 3: clip 1/(3 + 1e-6), AdamW factor clip/8.
  auto sum_of = [](std::initializer_list<double> xs) {
    core::exact_sum e;
    for (double x : xs) e.add(x);
    return e;
  };
  auto d = model::decide_step(sum_of({64.0 * 4, 64.0 * 5}), s, opt, train, 0);
  CHECK_FALSE(d.skip);
  CHECK(d.grad_norm == doctest::Approx(3.0));
  CHECK(d.clip == model::clip_scale(3.0, 1.0));
  CHECK(d.grad_scale == d.clip / 8.0f);
  CHECK(d.loss_scale == 8.0f);
  CHECK(d.adam_step == 1);
  auto o = model::decide_step(sum_of({1.0, std::numeric_limits<double>::infinity()}), s, opt,
                              train, 1);
  CHECK(o.skip);
  CHECK(o.loss_scale == 8.0f);
  CHECK(o.next_loss_scale == 4.0f);
  CHECK(s.scale == 4.0f);
  CHECK(s.updates == 1);
}

TEST_CASE("precision.dynamic_loss_scale defaults to on for fp16 only and may be set for fp32") {
  auto fp32 = core::parse_config("", "t.toml");
  REQUIRE(fp32.ok());
  CHECK_FALSE(fp32->precision.dynamic_loss_scale);
  auto fp16 = core::parse_config("[precision]\ncompute = \"fp16\"\n[runtime]\ndevice = \"cuda\"\n",
                                 "t.toml");
  REQUIRE_MESSAGE(fp16.ok(), (fp16.ok() ? "" : fp16.err().to_string()));
  CHECK(fp16->precision.dynamic_loss_scale);
  auto forced = core::parse_config("[precision]\ndynamic_loss_scale = true\n", "t.toml");
  REQUIRE(forced.ok());
  CHECK(forced->precision.dynamic_loss_scale);
  auto off16 = core::parse_config(
      "[precision]\ncompute = \"fp16\"\ndynamic_loss_scale = false\n[runtime]\ndevice = \"cuda\"\n",
      "t.toml");
  REQUIRE(off16.ok());
  CHECK_FALSE(off16->precision.dynamic_loss_scale);
}

// fp32 gradients overflow only where a gradient of the unscaled loss exceeds FLT_MAX / scale: with
// unit-variance weights and one sequence per micro-batch some exceed 1, and a scale near FLT_MAX
// overflows for the first few steps.
core::config overflowing_run(const scratch_dir& tmp) {
  auto cfg = tiny_run(tmp);
  cfg.model.init_std = 1.0f;
  cfg.parallel.micro_batch_size = 1;
  cfg.precision.dynamic_loss_scale = true;
  cfg.precision.loss_scale = 3.4e38;
  return cfg;
}

TEST_CASE("an initial loss scale of 3.4e38 overflows: steps are skipped, parameters kept, the scale "
          "halved until the gradients are finite") {
  scratch_dir tmp("scaler_overflow");
  auto cfg = overflowing_run(tmp);
  auto be = kernels::make_backend("cpu");
  auto made = model::trainer::create(cfg, *be);
  REQUIRE(made.ok());
  model::trainer& tr = *made.value();
  auto params = [&] { return host_floats(*be, tr.chunks()[0].flat_params()); };

  float scale = 3.4e38f;
  int skipped = 0;
  int step = 0;
  for (; step < 40; ++step) {
    const auto before = params();
    auto r = tr.train_step(step);
    REQUIRE(r.ok());
    CHECK(r->loss_scale == scale);
    if (!r->skipped) break;
    ++skipped;
    INFO("step ", step);
    CHECK_FALSE(std::isfinite(r->grad_norm));
    CHECK(same_bits(params(), before));
    CHECK(r->next_loss_scale == scale * 0.5f);
    CHECK(tr.scaler().updates == 0);
    scale *= 0.5f;
  }
  REQUIRE(step < 40);
  CHECK(skipped >= 1);
  CHECK(std::isfinite(tr.scaler().scale));
  CHECK(tr.scaler().updates == 1);
  // The first applied update moved the parameters, with AdamW's t = 1 whatever the step index.
  const auto after_first = params();
  auto again = tr.train_step(step + 1);
  REQUIRE(again.ok());
  CHECK_FALSE(again->skipped);
  CHECK_FALSE(same_bits(params(), after_first));
}

TEST_CASE("with a power-of-two loss scale and no overflow fp32 training gives the unscaled bits") {
  scratch_dir tmp("scaler_exact");
  auto cfg = tiny_run(tmp);
  cfg.train.grad_clip = 0;  // clip 1: AdamW's factor is exactly 1/scale
  cfg.train.steps = 4;
  auto scaled = cfg;
  scaled.precision.dynamic_loss_scale = true;
  scaled.precision.loss_scale = 1024;
  auto run = [](const core::config& c) {
    model::train_options o;
    o.log = nullptr;
    auto r = model::train_single_rank(c, o);
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
    return r.value();
  };
  auto a = run(cfg);
  scaled.runtime.run_dir = tmp / "run_scaled";
  auto b = run(scaled);
  REQUIRE(a.losses.size() == b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) {
    INFO("step ", i);
    CHECK(std::memcmp(&a.losses[i], &b.losses[i], sizeof(double)) == 0);
  }
}

TEST_CASE("metrics.jsonl records loss_scale and skipped, and the progress line says so") {
  scratch_dir tmp("scaler_metrics");
  auto cfg = overflowing_run(tmp);
  cfg.train.steps = 3;
  cfg.train.eval_interval = 0;
  std::string log_path = tmp / "log.txt";
  std::FILE* log = std::fopen(log_path.c_str(), "w");
  REQUIRE(log);
  model::train_options o;
  o.log = log;
  auto r = model::train_single_rank(cfg, o);
  std::fclose(log);
  REQUIRE(r.ok());
  std::ifstream in(cfg.runtime.run_dir + "/metrics.jsonl");
  std::string line;
  REQUIRE(std::getline(in, line));
  auto m = model::parse_json_line(line);
  REQUIRE(m.ok());
  REQUIRE(m->loss_scale.has_value());
  CHECK(*m->loss_scale == 3.4e38f);
  CHECK(m->skipped);
  std::string text = model::testing::file_bytes(log_path);
  CHECK(text.find("skipped (overflow), loss scale → 1.7e+38") != std::string::npos);
}
