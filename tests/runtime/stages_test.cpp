// Uneven pipeline stages (parallel.stage_layers, first_stage_layers, last_stage_layers) and
// per-layer recompute (recompute.layers, recompute.layer_list) change where layers run and which
// activations are kept, never the arithmetic: each run here is compared bit for bit (losses and
// every checkpoint tensor) with the even split without recompute, in the actor runtime and in the
// single-rank loop, for GPT-2 and LLaMA; and a run saved at one split resumes at another.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "model/chunk.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using namespace troupe::runtime_test;

/// A 5-layer model (odd, so only an uneven split spreads it over 2 or 4 chunks), 3 steps.
core::config five_layers(const scratch_dir& tmp, core::arch_kind arch) {
  auto cfg = model::testing::tiny_run(tmp, arch);
  cfg.model.num_layers = 5;
  cfg.parallel.micro_batch_num = 4;
  cfg.train.steps = 3;
  cfg.train.eval_interval = 0;
  return cfg;
}

/// `cfg` with `sets` applied through the parser, as `troupe train --set` would: validated.
core::config with(const core::config& cfg, const std::vector<std::string>& sets) {
  auto r = core::parse_config(core::to_toml(cfg), "stages_test", sets);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  return r.value();
}

std::vector<int> first_layers(const core::config& c) {
  std::vector<int> out;
  for (const auto& s : model::partition(c)) out.push_back(s.first_layer);
  return out;
}

}  // namespace

TEST_CASE("the uneven split keys give the chunks they name") {
  scratch_dir tmp("stages_split");
  const auto base = five_layers(tmp, core::arch_kind::gpt2);
  CHECK(core::chunk_layers(with(base, {"parallel.pipeline_stage=2", "parallel.stage_layers=[1,4]"})) ==
        std::vector<int>{1, 4});
  CHECK(first_layers(with(base, {"parallel.pipeline_stage=2", "parallel.stage_layers=[1,4]"})) ==
        std::vector<int>{0, 1});
  // The offsets: the rest spread evenly over the chunks between (and an end left at 0).
  const auto c = with(base, {"model.num_layers=8", "parallel.pipeline_stage=4",
                             "parallel.first_stage_layers=1", "parallel.last_stage_layers=1"});
  CHECK(core::chunk_layers(c) == std::vector<int>{1, 3, 3, 1});
  CHECK(first_layers(c) == std::vector<int>{0, 1, 4, 7});
  CHECK(core::derive(c).stage_layers == std::vector<int>{1, 3, 3, 1});
  CHECK(core::derive(c).layers_per_stage == 3);
  CHECK(core::chunk_layers(with(base, {"parallel.pipeline_stage=2", "parallel.last_stage_layers=1"})) ==
        std::vector<int>{4, 1});
  CHECK(core::chunk_layers(with(base, {"model.num_layers=7", "parallel.pipeline_stage=3",
                                       "parallel.first_stage_layers=1"})) ==
        std::vector<int>{1, 3, 3});
  // Interleaved: chunk c on pipeline rank c % pipeline_stage.
  const auto v = with(base, {"parallel.pipeline_stage=2", "parallel.virtual_pipeline=2",
                             "parallel.stage_layers=[2,1,1,1]"});
  CHECK(core::derive(v).stage_layers == std::vector<int>{3, 2});
  // Per-layer recompute masks.
  const auto r = with(c, {"recompute.mode=full", "recompute.layers=2"});
  CHECK(core::recompute_layers(r) ==
        std::vector<bool>{true, true, true, false, true, true, false, true});
  CHECK(core::recompute_layers(with(c, {"recompute.mode=selective", "recompute.layer_list=[6,0]"})) ==
        std::vector<bool>{true, false, false, false, false, false, true, false});
  CHECK(core::recompute_layers(with(c, {"recompute.mode=full"})) == std::vector<bool>(8, true));
  CHECK(core::recompute_layers(c) == std::vector<bool>(8, false));
}

TEST_CASE("uneven stages and per-layer recompute are bit-identical to the even split, GPT-2 and LLaMA") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    CAPTURE(arch == core::arch_kind::gpt2 ? "gpt2" : "llama");
    scratch_dir tmp(arch == core::arch_kind::gpt2 ? "stages_gpt2" : "stages_llama");
    const auto base = five_layers(tmp, arch);
    // The reference: the whole model in the single-rank loop, nothing recomputed.
    const auto ref = oracle_run(base);
    const std::vector<std::vector<std::string>> variants = {
        {"parallel.pipeline_stage=2", "parallel.stage_layers=[1,4]"},
        {"parallel.pipeline_stage=2", "parallel.first_stage_layers=4"},
        {"parallel.pipeline_stage=2", "parallel.virtual_pipeline=2", "parallel.stage_layers=[1,2,1,1]",
         "schedule.name=interleaved_1f1b"},
        {"parallel.pipeline_stage=2", "parallel.stage_layers=[3,2]", "schedule.name=zb_h1",
         "recompute.mode=full", "recompute.layers=1"},
        {"parallel.pipeline_stage=2", "parallel.last_stage_layers=1", "recompute.mode=full",
         "recompute.layer_list=[0,2,4]"},
        {"parallel.pipeline_stage=2", "parallel.stage_layers=[2,3]", "recompute.mode=selective",
         "recompute.layers=1"},
    };
    for (const auto& sets : variants) {
      std::string name;
      for (const auto& s : sets) name += s + " ";
      CAPTURE(name);
      auto cfg = with(base, sets);
      check_same_losses_and_tensors(actors_run(cfg), ref);
    }
    // The single-rank loop with per-layer recompute (one chunk: the recompute choice of the
    // config's chunks still applies layer by layer).
    for (const std::vector<std::string>& sets :
         {std::vector<std::string>{"recompute.mode=full", "recompute.layer_list=[1,3]"},
          std::vector<std::string>{"recompute.mode=selective", "recompute.layers=2"}}) {
      CAPTURE(sets.back());
      check_same_losses_and_tensors(oracle_run(with(base, sets)), ref);
    }
  }
}

TEST_CASE("a run saved at one uneven split resumes at another, bit for bit") {
  scratch_dir tmp("stages_resume");
  auto base = five_layers(tmp, core::arch_kind::llama);
  base.train.steps = 4;
  base.optimizer.zero_stage = 1;
  base.parallel.data_parallel = 2;
  base = with(base, {});
  const auto whole = actors_run(with(base, {"parallel.pipeline_stage=2", "parallel.stage_layers=[2,3]"}));

  auto first = with(base, {"parallel.pipeline_stage=2", "parallel.stage_layers=[4,1]"});
  first.runtime.run_dir = tmp / "split";
  first.checkpoint.dir = tmp / "split/checkpoints";
  actors::run_options half;
  half.max_steps = 2;
  auto a = actors_run(first, half);
  REQUIRE(a.losses.size() == 2);
  // Resume at three stages of 1, 3 and 1 layers: every tensor lands in a different chunk.
  auto second = with(first, {"parallel.pipeline_stage=3", "parallel.stage_layers=[1,3,1]",
                             "parallel.micro_batch_num=4"});
  actors::run_options rest_opt;
  rest_opt.resume = first.runtime.run_dir;
  auto rest = actors_run(second, rest_opt);
  a.losses.insert(a.losses.end(), rest.losses.begin(), rest.losses.end());
  rest.losses = a.losses;
  check_same_losses_and_tensors(rest, whole);
}
