// The determinism promises with LoRA on (docs/finetune.md): the actor runtime trains only the
// adapters (and the base modules lora.trainable names), and pipeline splits, schedules, recompute
// and ZeRO stages keep giving the single-rank loop's bits; data parallel agrees within 1e-5; a
// resumed run continues bit for bit. Checkpoints hold the trainable tensors only.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "model/checkpoint.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using namespace troupe::runtime_test;

core::config lora_config(const scratch_dir& tmp, int pp, int dp = 1,
                         core::arch_kind arch = core::arch_kind::gpt2) {
  auto cfg = pipeline_config(tmp, pp, dp);
  if (arch == core::arch_kind::llama) {
    auto l = model::testing::tiny_run(tmp, arch);
    cfg.model = l.model;
    cfg.model.num_layers = 4;
  }
  cfg.model.lora.rank = 4;
  cfg.model.lora.alpha = 8;
  cfg.model.lora.targets = arch == core::arch_kind::gpt2
                               ? std::vector<std::string>{"c_attn", "c_fc"}
                               : std::vector<std::string>{"q_proj", "v_proj", "down_proj"};
  cfg.model.lora.trainable = {arch == core::arch_kind::gpt2 ? "ln_f" : "norm"};
  cfg.optimizer.lr = 3e-2;
  return cfg;
}

void check_identical(const outcome& a, const outcome& b) {
  check_same_losses_and_tensors(a, b);
  REQUIRE(a.val.has_value() == b.val.has_value());
  if (a.val) CHECK(std::memcmp(&*a.val, &*b.val, sizeof(double)) == 0);
}

}  // namespace

TEST_CASE("lora: pipeline splits, schedules and recompute are bit-identical to the single-rank loop") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    scratch_dir tmp("rt_lora_split");
    auto oracle = oracle_run(lora_config(tmp, 1, 1, arch));
    // Only adapters and the trainable norm are saved, and they moved.
    for (const auto& entry : oracle.hashes) {  // no structured binding: clang 14 cannot capture one
      const auto& name = entry.first;
      INFO("tensor ", name);
      const bool adapter = name.find(".lora_") != std::string::npos;
      const bool norm = name.rfind(arch == core::arch_kind::gpt2 ? "ln_f." : "model.norm.", 0) == 0;
      CHECK((adapter || norm));
    }
    CHECK(oracle.losses.back() < oracle.losses.front());
    for (int pp : {2, 4}) {
      INFO("pipeline_stage ", pp);
      check_identical(actors_run(lora_config(tmp, pp, 1, arch)), oracle);
    }
    for (std::string name : {"gpipe", "zb_h1", "interleaved_1f1b"}) {
      INFO("schedule ", name);
      auto cfg = lora_config(tmp, 2, 1, arch);
      cfg.schedule.name = name;
      if (name == "interleaved_1f1b") cfg.parallel.virtual_pipeline = 2;
      check_identical(actors_run(cfg), oracle);
    }
    for (auto mode : {core::recompute_mode::full, core::recompute_mode::selective}) {
      auto cfg = lora_config(tmp, 2, 1, arch);
      cfg.recompute.mode = mode;
      check_identical(actors_run(cfg), oracle);
    }
    // An uneven split with per-layer recompute (core::chunk_layers, core::recompute_layers).
    {
      INFO("stage_layers [3, 1], recompute.layers 1");
      auto cfg = lora_config(tmp, 2, 1, arch);
      cfg.parallel.stage_layers = {3, 1};
      cfg.recompute.mode = core::recompute_mode::full;
      cfg.recompute.layers = 1;
      check_identical(actors_run(cfg), oracle);
    }
  }
}

TEST_CASE("lora: zero_stage 0, 1 and 2 are bit-identical and resume continues bit for bit") {
  scratch_dir tmp("rt_lora_zero");
  auto base = lora_config(tmp, 2, 2);
  // The tied embedding trains too: its two gradients are summed across the pipeline.
  base.model.lora.trainable = {"wte", "ln_f"};
  auto ref = actors_run(base);
  for (int z : {1, 2}) {
    INFO("zero_stage ", z);
    auto cfg = base;
    cfg.optimizer.zero_stage = z;
    check_identical(actors_run(cfg), ref);
  }
  auto cfg2 = base;
  cfg2.optimizer.zero_stage = 1;
  check_identical(resumed_run(cfg2, tmp / "run2", 2), ref);
}

TEST_CASE("lora: data_parallel 1 and 2 at the same global batch agree within 1e-5") {
  scratch_dir tmp("rt_lora_dp");
  auto ref = actors_run(lora_config(tmp, 2, 1));
  auto cfg = lora_config(tmp, 2, 2);
  cfg.parallel.micro_batch_num = 2;
  auto o = actors_run(cfg);
  REQUIRE(o.losses.size() == ref.losses.size());
  for (std::size_t i = 0; i < o.losses.size(); ++i) {
    INFO("step ", i);
    CHECK(std::fabs(o.losses[i] - ref.losses[i]) <= 1e-5 * std::fabs(ref.losses[i]));
  }
}

TEST_CASE("lora: a stage with nothing to train (lora.trainable = [\"ln_f\"]) runs and matches the loop") {
  scratch_dir tmp("rt_lora_empty");
  auto cfg = pipeline_config(tmp, 1);
  cfg.model.lora.trainable = {"ln_f"};
  auto oracle = oracle_run(cfg);
  CHECK(oracle.hashes.size() == 2 * 3);  // ln_f weight and bias, with their two moments each
  auto two = cfg;
  two.parallel.pipeline_stage = 2;
  two.parallel.data_parallel = 2;
  two.parallel.micro_batch_num = 2;
  two.optimizer.zero_stage = 2;
  auto o = actors_run(two);
  REQUIRE(o.losses.size() == oracle.losses.size());
  for (std::size_t i = 0; i < o.losses.size(); ++i)
    CHECK(std::fabs(o.losses[i] - oracle.losses[i]) <= 1e-5 * std::fabs(oracle.losses[i]));
  check_identical(actors_run(two), o);
}
