// What the CLI tests that compare two runs bit for bit share: a run's per-step losses from its
// metrics.jsonl, the xxh64 of every tensor of its last checkpoint by name, and the bytes of its
// last checkpoint's files.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model/checkpoint.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace troupe::cli_test {

/// "step:loss" of every line of a run's metrics.jsonl, in order.
inline std::vector<std::string> step_losses(const fs::path& run) {
  std::vector<std::string> out;
  std::istringstream in(slurp(run / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    out.push_back(std::to_string(j.at("step").get<int>()) + ":" + j.at("loss").dump());
  }
  return out;
}

/// The latest step_* folder of a run's checkpoints (empty when there is none).
inline fs::path last_checkpoint(const fs::path& run) {
  fs::path best;
  for (auto& e : fs::directory_iterator(run / "checkpoints")) {
    const fs::path name = e.path().filename();
    if (name.string().rfind("step_", 0) == 0 && name > best.filename()) best = e.path();
  }
  return best;
}

/// Every safetensors file of the last checkpoints of two runs is byte-identical (parameters and
/// AdamW moments), and so are their per-step losses.
inline void require_same_result(const fs::path& a, const fs::path& b) {
  const fs::path ca = last_checkpoint(a), cb = last_checkpoint(b);
  REQUIRE(!ca.empty());
  REQUIRE(ca.filename() == cb.filename());
  int files = 0;
  for (auto& e : fs::directory_iterator(ca)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    CHECK_MESSAGE(slurp(e.path()) == slurp(cb / e.path().filename()),
                  e.path().filename().string());
  }
  CHECK(files > 0);
  const std::vector<std::string> la = step_losses(a);
  CHECK(la == step_losses(b));
  CHECK(!la.empty());
}

/// A small model of `arch` (`layers` layers, hidden 32, 4 heads, T 16, vocabulary 64) on a
/// pattern shard, 3 steps of 4 micro-batches of 2, no evaluation, one thread; `parallel` adds keys
/// to its [parallel] table (e.g. "pipeline_stage = 2\n"). Returns the config's path, tmp/ARCH.toml.
inline std::string write_small_config(const model::testing::scratch_dir& tmp,
                                      const std::string& arch, int layers,
                                      const std::string& parallel = "") {
  model::testing::write_pattern_shard(tmp / "train.bin", 20000, 64, 1);
  const std::string path = tmp / (arch + ".toml");
  std::ofstream(path) << "[model]\narch = \"" << arch << "\"\nnum_layers = " << layers
                      << "\nhidden_size = 32\nnum_heads = 4\nseq_length = 16\nvocab_size = 64\n"
                         "[parallel]\n"
                      << parallel
                      << "micro_batch_num = 4\nmicro_batch_size = 2\n[train]\nsteps = 3\n"
                         "warmup_steps = 1\n[data]\ntrain = \""
                      << (tmp / "train.bin") << "\"\n[runtime]\nthreads = 1\n";
  return path;
}

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
  out.losses = step_losses(dir);
  std::vector<std::string> skipped;
  auto rd = model::checkpoint::open_for_resume(dir, &skipped);
  REQUIRE_MESSAGE(rd.ok(), (rd.ok() ? "" : rd.err().to_string()));
  for (const auto& [name, rec] : rd->info().tensors) out.hashes[name] = rec.xxh64;
  return out;
}

}  // namespace troupe::cli_test
