// Dynamic loss scaling in the actor runtime (fp32 on the CPU, precision.dynamic_loss_scale = true):
// skipped steps, the scale's halving and growth and the resumed state are the single-rank loop's,
// bit for bit, for any pipeline split and ZeRO stage.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>

#include "runtime/runtime.hpp"
#include "model/checkpoint.hpp"
#include "model/metrics.hpp"
#include "model/optimizer.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using namespace troupe::runtime_test;

void check_identical(const outcome& a, const outcome& b) {
  check_same_losses_and_tensors(a, b);
  REQUIRE(a.metrics.size() == b.metrics.size());
  for (std::size_t i = 0; i < a.metrics.size(); ++i) {
    INFO("metrics line ", i);
    REQUIRE(a.metrics[i].loss_scale.has_value());
    REQUIRE(b.metrics[i].loss_scale.has_value());
    CHECK(*a.metrics[i].loss_scale == *b.metrics[i].loss_scale);
    CHECK(a.metrics[i].skipped == b.metrics[i].skipped);
  }
}

// Starts near FLT_MAX, which overflows fp32 gradients of this model (unit-variance weights, one
// sequence per micro-batch: some gradients exceed 1), so the first steps are skipped; grows again
// after 2 good steps, so a short run sees skips, halvings and doublings.
core::config scaled_config(const scratch_dir& tmp, int pp, int dp = 1) {
  auto cfg = pipeline_config(tmp, pp, dp);
  cfg.model.init_std = 1.0f;
  cfg.parallel.micro_batch_size = 1;
  cfg.train.steps = 14;
  cfg.precision.dynamic_loss_scale = true;
  cfg.precision.loss_scale = 3.4e38;
  cfg.precision.loss_scale_window = 2;
  return cfg;
}

int skipped_steps(const outcome& o) {
  int n = 0;
  for (const auto& m : o.metrics) n += m.skipped ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("with dynamic loss scaling the actor runtime is bit-identical to the single-rank loop") {
  scratch_dir tmp("ls_oracle");
  auto oracle = oracle_run(scaled_config(tmp, 1));
  REQUIRE(skipped_steps(oracle) >= 1);
  REQUIRE(skipped_steps(oracle) < static_cast<int>(oracle.metrics.size()));
  CHECK(oracle.hashes.count(model::loss_scaler_tensor_name) == 1);
  for (int pp : {1, 2, 4}) {
    INFO("pipeline_stage ", pp);
    auto cfg = scaled_config(tmp, pp);
    cfg.runtime.run_dir = tmp / ("run_pp" + std::to_string(pp));
    check_identical(actors_run(cfg), oracle);
  }
}

TEST_CASE("a skipped step leaves every shard untouched under ZeRO 0, 1 and 2") {
  scratch_dir tmp("ls_zero");
  auto base = scaled_config(tmp, 2, 2);
  base.parallel.micro_batch_num = 2;
  auto ref = actors_run(base);
  REQUIRE(skipped_steps(ref) >= 1);
  for (int z : {1, 2}) {
    INFO("zero_stage ", z);
    auto cfg = base;
    cfg.optimizer.zero_stage = z;
    cfg.runtime.run_dir = tmp / ("run_z" + std::to_string(z));
    check_identical(actors_run(cfg), ref);
  }
}

TEST_CASE("resuming with dynamic loss scaling continues bit-identically, in both loops") {
  scratch_dir tmp("ls_resume");
  auto cfg = scaled_config(tmp, 2);
  auto whole = actors_run(cfg);
  REQUIRE(skipped_steps(whole) >= 1);
  // Stop where the scale has changed since the start, so a resume from the config would differ.
  const int k = 9;
  REQUIRE(*whole.metrics[k].loss_scale != 3.4e38f);

  check_identical(resumed_run(cfg, tmp / "run2", k), whole);

  auto cfg3 = cfg;
  cfg3.parallel.pipeline_stage = 1;
  cfg3.runtime.run_dir = tmp / "run3";
  cfg3.checkpoint.dir = tmp / "run3/checkpoints";
  model::train_options one;
  one.log = nullptr;
  one.max_steps = k;
  auto a = model::train_single_rank(cfg3, one);
  REQUIRE(a.ok());
  model::train_options two;
  two.log = nullptr;
  two.resume = cfg3.runtime.run_dir;
  auto b = collect(model::train_single_rank(cfg3, two), cfg3);
  auto single = a.value().losses;
  single.insert(single.end(), b.losses.begin(), b.losses.end());
  b.losses = single;
  check_identical(b, whole);
}
