// The zero-bubble V schedule through the built binary: `troupe train` (the actor runtime) with
// schedule.name = "zb_v" ends with the same per-step losses and the same bytes of every checkpoint
// tensor (by name) as 1f1b at the same pipeline_stage, for GPT-2 and LLaMA; a zb_v config without
// virtual_pipeline = 2 is refused naming the key; `troupe schedule` shows, simulates and draws it.
#include <doctest/doctest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/checkpoint.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/cli/train_compare.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using troupe::model::testing::scratch_dir;
using namespace troupe::cli_test;

TEST_CASE("troupe train with zb_v equals 1f1b bit for bit, gpt2 and llama") {
  for (const std::string arch : {"gpt2", "llama"}) {
    CAPTURE(arch);
    scratch_dir tmp("zbv_cli_" + arch);
    const std::string config = write_small_config(tmp, arch, 4, "pipeline_stage = 2\n");
    const train_outcome ref = train_run(tmp, config, "1f1b", "");
    REQUIRE(ref.losses.size() == 3);
    REQUIRE(!ref.hashes.empty());
    const train_outcome zbv = train_run(tmp, config, "zb_v", "--set schedule.name=zb_v --set parallel.virtual_pipeline=2");
    CHECK(zbv.losses == ref.losses);
    CHECK(zbv.hashes == ref.hashes);
  }
}

TEST_CASE("troupe train refuses zb_v without virtual_pipeline = 2, naming the key") {
  scratch_dir tmp("zbv_cli_refuse");
  const std::string config = write_small_config(tmp, "gpt2", 4, "pipeline_stage = 2\n");
  const run_result r = run_troupe(tmp.path, "train '" + config + "' --set schedule.name=zb_v");
  CHECK(r.code == 1);
  CHECK_MESSAGE(contains(r.err, "schedule.name"), r.err);
  CHECK_MESSAGE(contains(r.err, "zb_v runs exactly two chunks per rank (a V), but virtual stages v = 1"), r.err);
  CHECK_MESSAGE(contains(r.err, "hint: set parallel.virtual_pipeline = 2"), r.err);
}

TEST_CASE("troupe schedule shows, simulates and draws zb_v") {
  scratch_dir tmp("zbv_cli_schedule");
  const run_result sim = run_troupe(tmp.path, "schedule simulate -s zb_v -p 4 -m 8 -v 2 --costs 1,2,1,0 --json");
  REQUIRE_MESSAGE(sim.code == 0, sim.err);
  const auto j = nlohmann::json::parse(sim.out);
  CHECK(j.at("placement") == "v");
  CHECK(j.at("makespan").get<double>() == doctest::Approx(6 * 8 + 3));
  for (const auto& rank : j.at("ranks")) CHECK(rank.at("peak_activations").get<int>() <= 8);
  const std::string svg = tmp / "zb_v.svg";
  const run_result show = run_troupe(tmp.path, "schedule show -s zb_v -p 4 -m 8 -v 2 --svg '" + svg + "'");
  REQUIRE_MESSAGE(show.code == 0, show.err);
  CHECK(contains(show.out, "zb_v  p=4 m=8 v=2 placement v"));
  CHECK(contains(slurp(svg), "<svg"));
  const run_result list = run_troupe(tmp.path, "schedule check -s no_such_schedule -p 2 -m 2");
  CHECK(list.code == 1);
  CHECK(contains(list.err, "zb_v"));
}
