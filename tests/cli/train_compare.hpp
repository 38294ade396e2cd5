// What the CLI tests that compare two `troupe train` runs bit for bit share: a run's per-step
// losses from its metrics.jsonl and the xxh64 of every tensor of its last checkpoint, by name.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model/checkpoint.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace troupe::cli_test {

struct train_outcome {
  std::vector<std::string> losses;              // "step:loss" of metrics.jsonl
  std::map<std::string, std::uint64_t> hashes;  // tensor name -> xxh64 of the last checkpoint
  std::string log;                              // stdout and stderr
};

/// `troupe train CONFIG ARGS` in tmp/run (its run directory); the test fails unless it exits 0.
inline train_outcome train_run(const model::testing::scratch_dir& tmp, const std::string& config,
                               const std::string& run, const std::string& args) {
  const std::string dir = tmp / run;
  const run_result r =
      run_troupe(tmp.path, "train '" + config + "' --set runtime.run_dir='" + dir + "' " + args);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  train_outcome out;
  out.log = r.out + r.err;
  std::istringstream in(slurp(std::filesystem::path(dir) / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    out.losses.push_back(std::to_string(j.at("step").get<int>()) + ":" + j.at("loss").dump());
  }
  std::vector<std::string> skipped;
  auto rd = model::checkpoint::open_for_resume(dir, &skipped);
  REQUIRE_MESSAGE(rd.ok(), (rd.ok() ? "" : rd.err().to_string()));
  for (const auto& [name, rec] : rd->info().tensors) out.hashes[name] = rec.xxh64;
  return out;
}

}  // namespace troupe::cli_test
