// Spawn functions of the runtime's actors (one actor per file). Each actor is a small behaviour
// that delegates to a plain engine class (stage_engine, shard_engine, ...).
#pragma once

#include <future>
#include <memory>
#include <optional>

#include "actors/coordinator_engine.hpp"
#include "actors/job.hpp"
#include "actors/shard_engine.hpp"
#include "actors/stage_engine.hpp"
#include "actors/tp_group.hpp"
#include "model/loader.hpp"
#include "model/trainer.hpp"

namespace troupe::actors {

/// A stage's engine and the backend its chunks live on.
struct stage_bundle {
  std::unique_ptr<kernels::backend> be;
  std::unique_ptr<tp_group> group;  // tensor parallel: the collectives the chunks call; else null
  std::unique_ptr<stage_engine> engine;
};

struct shard_bundle {
  std::unique_ptr<kernels::backend> be;
  std::unique_ptr<kernels::backend> host;  // the CPU backend that updates offloaded state, or null
  std::unique_ptr<shard_engine> engine;
};

/// What the coordinator needs beyond the job: its plan, and the promise it settles with the
/// job's outcome.
struct coordinator_setup : coordinator_plan {
  std::shared_ptr<std::promise<core::result<model::train_summary>>> done;
};

caf::actor spawn_stage(caf::actor_system& sys, std::shared_ptr<job> j, int dp, int pp,
                       std::shared_ptr<stage_bundle> b);
caf::actor spawn_shard(caf::actor_system& sys, std::shared_ptr<job> j, int pp, int part,
                       std::shared_ptr<shard_bundle> b);
caf::actor spawn_loader(caf::actor_system& sys, std::shared_ptr<job> j, int dp,
                        std::shared_ptr<model::loader> data, int end_step);
caf::actor spawn_writer(caf::actor_system& sys, std::shared_ptr<job> j, std::string root);
caf::actor spawn_coordinator(caf::actor_system& sys, std::shared_ptr<job> j, coordinator_setup s);

}  // namespace troupe::actors
