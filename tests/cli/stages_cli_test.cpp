// Uneven pipeline stages and per-layer recompute through the built binary: `troupe train` (the
// actor runtime) with an uneven split and per-layer recompute, and `troupe train --single-rank`
// with per-layer recompute, end with the same per-step losses and the same bytes of every
// checkpoint tensor (by name) as `troupe train --single-rank` of the even split without
// recompute, for GPT-2 and LLaMA; a bad split is refused before training starts.
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

TEST_CASE("troupe train with uneven stages and per-layer recompute equals the even split, bit for bit") {
  for (const std::string arch : {"gpt2", "llama"}) {
    CAPTURE(arch);
    scratch_dir tmp("stages_cli_" + arch);
    const std::string config = write_small_config(tmp, arch, 3);
    const train_outcome ref = train_run(tmp, config, "even", "--single-rank");
    REQUIRE(ref.losses.size() == 3);
    REQUIRE(!ref.hashes.empty());
    const std::vector<std::pair<std::string, std::string>> runs = {
        {"uneven", "--set parallel.pipeline_stage=2 --set parallel.stage_layers=[1,2]"},
        {"offset_recompute", "--set parallel.pipeline_stage=2 --set parallel.last_stage_layers=1 "
                             "--set recompute.mode=full --set recompute.layers=1"},
        {"single_list", "--single-rank --set recompute.mode=full --set recompute.layer_list=[0,2]"},
        {"single_selective", "--single-rank --set recompute.mode=selective --set recompute.layers=2"},
    };
    for (const auto& [name, args] : runs) {
      CAPTURE(name);
      const train_outcome r = train_run(tmp, config, name, args);
      CHECK(r.losses == ref.losses);
      CHECK(r.hashes == ref.hashes);
      // The start line names the split and the layers that recompute.
      if (name == "uneven") CHECK_MESSAGE(contains(r.log, "(virtual 1, layers [1, 2])"), r.log);
      if (name == "offset_recompute")
        CHECK_MESSAGE(contains(r.log, "recompute full of layers 0, 2"), r.log);
    }
    // A split that does not add up is refused before any step, naming the key.
    const run_result bad = run_troupe(tmp.path,
                                      "train '" + config + "' --set parallel.pipeline_stage=2 "
                                      "--set parallel.stage_layers=[1,1]");
    CHECK(bad.code == 1);
    CHECK(contains(bad.err, "parallel.stage_layers: stage_layers [1, 1] sum to 2, but "
                            "model.num_layers is 3"));
    CHECK(contains(bad.err, "hint: the entries must sum to num_layers 3, e.g. [1, 2] or [2, 1] (even)"));
  }
}
