// Dropout under the determinism contract (docs/design.md): masks are keyed by (seed, step, layer,
// site, global sequence, element), so with dropout on every pipeline split (uneven ones too),
// schedule and recompute mode (per layer too) is bit-identical to the single-rank loop, ZeRO stages to each other, and a run
// to itself; the masks are really drawn (a run with dropout differs from one without).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "tests/model/trainer_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using namespace troupe::runtime_test;

core::config with_dropout(core::config c) {
  c.model.attention_dropout = 0.2f;
  c.model.hidden_dropout = 0.15f;
  c.train.eval_interval = 2;  // evaluation runs with dropout off on both sides
  return c;
}

void check_identical(const outcome& a, const outcome& b) {
  check_same_losses_and_tensors(a, b);
  REQUIRE(a.val.has_value());
  REQUIRE(b.val.has_value());
  CHECK(std::memcmp(&*a.val, &*b.val, sizeof(double)) == 0);
}

void check_layouts(core::arch_kind arch) {
  scratch_dir tmp(arch == core::arch_kind::gpt2 ? "rt_dropout_gpt2" : "rt_dropout_llama");
  const auto config = [&](int pp, int dp = 1) {
    auto c = pipeline_config(tmp, pp, dp);
    c.model.arch = arch;
    if (arch == core::arch_kind::llama) {
      c.model.num_kv_heads = 2;
      c.model.ffn_hidden_size = 48;
      c.model.tie_embeddings = false;
    }
    return with_dropout(c);
  };
  const auto oracle = oracle_run(config(1));

  // Dropout is drawn: the same run without it ends elsewhere.
  auto plain = config(1);
  plain.model.attention_dropout = 0;
  plain.model.hidden_dropout = 0;
  const auto without = oracle_run(plain);
  REQUIRE(without.losses.size() == oracle.losses.size());
  CHECK(std::memcmp(&without.losses[1], &oracle.losses[1], sizeof(double)) != 0);
  CHECK(without.hashes != oracle.hashes);

  for (int pp : {1, 2, 4}) {
    INFO("pipeline_stage ", pp);
    check_identical(actors_run(config(pp)), oracle);
  }
  for (std::string name : {"gpipe", "interleaved_1f1b", "zb_h1"}) {
    INFO("schedule ", name);
    auto c = config(2);
    c.schedule.name = name;
    if (name == "interleaved_1f1b") c.parallel.virtual_pipeline = 2;
    check_identical(actors_run(c), oracle);
  }
  for (auto mode : {core::recompute_mode::full, core::recompute_mode::selective}) {
    INFO("recompute ", static_cast<int>(mode));
    auto c = config(2);
    c.recompute.mode = mode;
    check_identical(actors_run(c), oracle);
  }

  // Uneven stages with per-layer recompute (the layers recomputed redraw their masks).
  for (const std::vector<std::string>& sets :
       {std::vector<std::string>{"parallel.stage_layers=[1,3]", "recompute.mode=full",
                                 "recompute.layer_list=[0,2]"},
        std::vector<std::string>{"parallel.first_stage_layers=3", "recompute.mode=selective",
                                 "recompute.layers=1"}}) {
    CAPTURE(sets.front());
    auto c = core::parse_config(core::to_toml(config(2)), "dropout_test", sets);
    REQUIRE_MESSAGE(c.ok(), (c.ok() ? "" : c.err().to_string()));
    check_identical(actors_run(c.value()), oracle);
  }

  // Two replicas: ZeRO 0, 1, 2 and a second run of the same config are bit-identical.
  auto dp = config(2, 2);
  dp.parallel.micro_batch_num = 2;
  const auto z0 = actors_run(dp);
  check_identical(actors_run(dp), z0);
  for (int z : {1, 2}) {
    INFO("zero_stage ", z);
    auto c = dp;
    c.optimizer.zero_stage = z;
    check_identical(actors_run(c), z0);
  }
  // The single-rank loop runs the same global batch of two replicas with the same masks; only
  // the order of the replicas' gradient sum differs.
  auto one = dp;
  one.parallel.data_parallel = 2;
  const auto single = oracle_run(one);
  REQUIRE(single.losses.size() == z0.losses.size());
  for (std::size_t i = 0; i < z0.losses.size(); ++i) {
    INFO("step ", i);
    CHECK(std::fabs(z0.losses[i] - single.losses[i]) <= 1e-5 * std::fabs(single.losses[i]));
  }
}

}  // namespace

TEST_CASE("gpt2 with dropout: splits, schedules, recompute and ZeRO stages are bit-identical") {
  check_layouts(core::arch_kind::gpt2);
}

TEST_CASE("llama with dropout: splits, schedules, recompute and ZeRO stages are bit-identical") {
  check_layouts(core::arch_kind::llama);
}
