// optimizer.offload in the actor runtime on the CPU backend: the shards keep master slices and
// AdamW moments in host buffers, copy each summed gradient slice there piece by piece and update it
// with the host backend's AdamW (actors/shard_engine.hpp). On the CPU the copies are host-to-host,
// but the code path is the GPU's, so these tests exercise it: losses, parameters and moments equal
// the run without offload bit for bit, under every ZeRO stage, with clipping and with skipped steps,
// and a checkpoint written with offload resumes without it (and the other way round) bit for bit.
#include <doctest/doctest.h>

#include <cstring>

#include "model/trainer.hpp"
#include "runtime/runtime.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using namespace troupe::runtime_test;

core::config with_offload(core::config cfg, bool on) {
  cfg.optimizer.offload = on;
  return cfg;
}

/// Trains `cfg` for 2 steps with offload `first`, then resumes for the rest with offload `second`;
/// the losses of both halves in order.
outcome split_run(core::config cfg, bool first, bool second) {
  actors::run_options a;
  a.max_steps = 2;
  auto half = actors_run(with_offload(cfg, first), a);
  REQUIRE(half.losses.size() == 2);
  actors::run_options b;
  b.resume = cfg.runtime.run_dir;
  auto rest = actors_run(with_offload(cfg, second), b);
  half.losses.insert(half.losses.end(), rest.losses.begin(), rest.losses.end());
  rest.losses = half.losses;
  return rest;
}

}  // namespace

TEST_CASE("offload on and off are bit-identical under ZeRO 0, 1 and 2 with data_parallel 2") {
  scratch_dir tmp("off_zero");
  for (int z : {0, 1, 2}) {
    INFO("zero_stage ", z);
    auto cfg = pipeline_config(tmp, 2, 2);
    cfg.optimizer.zero_stage = z;
    auto off = actors_run(with_offload(cfg, false));
    auto on = actors_run(with_offload(cfg, true));
    check_same_losses_and_tensors(on, off);
    REQUIRE(on.losses.size() == 4);
    CHECK(on.losses.back() != on.losses.front());  // the weights moved
  }
}

TEST_CASE("offload on one replica (the shard reads the stage's gradient buffer) is bit-identical") {
  scratch_dir tmp("off_one");
  auto cfg = pipeline_config(tmp, 1, 1);
  check_same_losses_and_tensors(actors_run(with_offload(cfg, true)),
                                actors_run(with_offload(cfg, false)));
}

TEST_CASE("offload keeps clipping and skip-on-overflow of dynamic loss scaling bit-identical") {
  scratch_dir tmp("off_scale");
  auto cfg = pipeline_config(tmp, 2, 2);
  cfg.optimizer.zero_stage = 1;
  cfg.model.init_std = 1.0f;  // large gradients: the clip is active
  cfg.parallel.micro_batch_size = 1;
  cfg.train.steps = 8;
  cfg.train.grad_clip = 0.5;
  cfg.precision.dynamic_loss_scale = true;
  cfg.precision.loss_scale = 3.4e38;  // overflows: the first steps are skipped
  cfg.precision.loss_scale_window = 2;
  auto off = actors_run(with_offload(cfg, false));
  auto on = actors_run(with_offload(cfg, true));
  check_same_losses_and_tensors(on, off);
  REQUIRE(on.metrics.size() == off.metrics.size());
  int skipped = 0, clipped = 0;
  for (std::size_t i = 0; i < on.metrics.size(); ++i) {
    INFO("step ", i);
    CHECK(on.metrics[i].skipped == off.metrics[i].skipped);
    CHECK(std::memcmp(&on.metrics[i].grad_norm, &off.metrics[i].grad_norm, sizeof(float)) == 0);
    skipped += on.metrics[i].skipped ? 1 : 0;
    clipped += !on.metrics[i].skipped && on.metrics[i].grad_norm > cfg.train.grad_clip ? 1 : 0;
  }
  CHECK(skipped >= 1);
  CHECK(clipped >= 1);
}

TEST_CASE("a checkpoint written with offload resumes without it, and the other way, bit-identically") {
  scratch_dir tmp("off_resume");
  auto cfg = pipeline_config(tmp, 2, 2);
  cfg.optimizer.zero_stage = 2;
  auto whole = actors_run(with_offload(cfg, false));
  for (auto order : {std::pair{true, false}, std::pair{false, true}}) {
    const bool first = order.first, second = order.second;  // clang 14: INFO cannot name a binding
    INFO("offload ", first, " then ", second);
    auto c = cfg;
    c.runtime.run_dir = tmp / (first ? "on_off" : "off_on");
    c.checkpoint.dir = c.runtime.run_dir + "/checkpoints";
    check_same_losses_and_tensors(split_run(c, first, second), whole);
  }
}

TEST_CASE("the single-rank loop refuses offload naming the key and the way out") {
  scratch_dir tmp("off_single");
  auto cfg = with_offload(pipeline_config(tmp, 1, 1), true);
  model::train_options opt;
  opt.log = nullptr;
  auto r = model::train_single_rank(cfg, opt);
  REQUIRE_FALSE(r.ok());
  CHECK(r.err().where.key == "optimizer.offload");
  CHECK(r.err().hint.find("--single-rank") != std::string::npos);
}
