// What the runtime and replay tests share: their 4-layer pipeline job, the two ways of training a
// config (the actor runtime, the single-rank loop), and what they compare between runs: the
// per-step losses, the final validation loss, the xxh64 of every tensor of the final checkpoint
// (parameters and AdamW moments, by name) and the metrics lines.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "model/checkpoint.hpp"
#include "model/metrics.hpp"
#include "model/trainer.hpp"
#include "runtime/runtime.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace troupe::runtime_test {

/// tiny_run's model with 4 layers over pp stages × dp replicas, 4 micro-batches, 4 steps, no
/// evaluation.
inline core::config pipeline_config(const model::testing::scratch_dir& tmp, int pp, int dp = 1) {
  auto cfg = model::testing::tiny_run(tmp);
  cfg.model.num_layers = 4;
  cfg.parallel.pipeline_stage = pp;
  cfg.parallel.data_parallel = dp;
  cfg.parallel.micro_batch_num = 4;
  cfg.train.steps = 4;
  cfg.train.eval_interval = 0;
  return cfg;
}

struct outcome {
  std::vector<double> losses;
  std::map<std::string, std::uint64_t> hashes;  // tensor name -> xxh64 of the final checkpoint
  std::optional<double> val;
  std::string checkpoint;
  std::vector<model::step_metrics> metrics;  // <run_dir>/metrics.jsonl, one per line
};

inline outcome collect(const core::result<model::train_summary>& r, const core::config& cfg) {
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  outcome o;
  o.losses = r.value().losses;
  o.val = r.value().final_val_loss;
  o.checkpoint = r.value().checkpoint;
  auto rd = model::checkpoint::reader::open(r.value().checkpoint);
  REQUIRE_MESSAGE(rd.ok(), (rd.ok() ? "" : rd.err().to_string()));
  for (const auto& [name, rec] : rd->info().tensors) o.hashes[name] = rec.xxh64;
  std::ifstream in(cfg.runtime.run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto m = model::parse_json_line(line);
    REQUIRE(m.ok());
    o.metrics.push_back(m.value());
  }
  return o;
}

/// `cfg` trained by the actor runtime.
inline outcome actors_run(const core::config& cfg, actors::run_options opt = {}) {
  opt.log = nullptr;
  return collect(actors::run_actor_job(cfg, opt), cfg);
}

/// `cfg` trained by the actor runtime in `run_dir` for `first_steps` steps, then resumed there to
/// the end: the second part's outcome with the losses of both parts.
inline outcome resumed_run(core::config cfg, const std::string& run_dir, int first_steps) {
  cfg.runtime.run_dir = run_dir;
  cfg.checkpoint.dir = run_dir + "/checkpoints";
  actors::run_options first;
  first.max_steps = first_steps;
  auto half = actors_run(cfg, first);
  REQUIRE(half.losses.size() == static_cast<std::size_t>(first_steps));
  actors::run_options second;
  second.resume = cfg.runtime.run_dir;
  auto rest = actors_run(cfg, second);
  half.losses.insert(half.losses.end(), rest.losses.begin(), rest.losses.end());
  rest.losses = std::move(half.losses);
  return rest;
}

/// `cfg` trained by the single-rank loop (the oracle).
inline outcome oracle_run(const core::config& cfg) {
  model::train_options opt;
  opt.log = nullptr;
  return collect(model::train_single_rank(cfg, opt), cfg);
}

/// The same losses, bit for bit, and the same bytes of every checkpoint tensor.
inline void check_same_losses_and_tensors(const outcome& a, const outcome& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) {
    INFO("step ", i, ": ", a.losses[i], " vs ", b.losses[i]);
    CHECK(std::memcmp(&a.losses[i], &b.losses[i], sizeof(double)) == 0);
  }
  REQUIRE(a.hashes.size() == b.hashes.size());
  for (const auto& entry : a.hashes) {  // no structured binding: clang 14's INFO cannot name one
    const std::string& name = entry.first;
    INFO("tensor ", name);
    REQUIRE(b.hashes.count(name));
    CHECK(entry.second == b.hashes.at(name));
  }
}

}  // namespace troupe::runtime_test
