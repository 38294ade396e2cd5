// Building the pieces of a job from its config: the layout, the lowered schedule, a pipeline
// rank's model chunks and an optimizer shard, fresh or restored from a checkpoint. Shared by the
// in-process runtime (runtime/runtime.cpp), which builds every worker's, and by code that builds
// one worker's only (`replay --rank`, a process per worker). No CAF here.
#pragma once

#include <memory>
#include <vector>

#include "actors/layout.hpp"
#include "actors/shard_engine.hpp"
#include "actors/stage_engine.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "model/checkpoint.hpp"
#include "schedules/schedule.hpp"

namespace troupe::actors {

/// The data_parallel × pipeline_stage layout `cfg` describes, chunks placed as the default
/// (interleaved) placement has them; enough to size the schedule (microbatches).
job_layout layout_of(const core::config& cfg);
/// The layout with chunks where schedule `s` (cfg's, from build_schedule) places them.
job_layout layout_of(const core::config& cfg, const schedules::schedule& s);

/// cfg's schedule for `microbatches` per replica, lowered and validated; errors name the
/// schedule.name / schedule.file key.
core::result<schedules::schedule> build_schedule(const core::config& cfg, int microbatches);

/// The chunks of pipeline rank `pp` (tensor-parallel rank `tp`: its slices, model::chunk_tp) in forward order (global ids pp, pp + P, ...) on `be`:
/// initialised from train.seed, identically on every replica, or restored from `ck` when given,
/// or else loaded from model.init when the config names weights to start from.
core::result<std::vector<model::chunk>> build_stage_chunks(const core::config& cfg,
                                                           const job_layout& l, int pp,
                                                           kernels::backend& be,
                                                           const model::checkpoint::reader* ck,
                                                           const model::chunk_tp& tp = {});

/// Optimizer shard (pp, part) of tensor-parallel rank `tp` on `be`. Its master slices start from `owner`, the chunks of the
/// stage on the shard's own worker; its AdamW moments are restored from `ck` when given.
/// Under optimizer.offload the master slices and moments are host memory updated by `host` (see
/// make_host_backend). REQUIRES: cfg (and `host`) outlive the shard (the engine keeps references).
core::result<std::unique_ptr<shard_engine>> build_shard(const core::config& cfg,
                                                        const job_layout& l, int pp, int part,
                                                        kernels::backend& be,
                                                        std::vector<model::chunk>& owner,
                                                        const model::checkpoint::reader* ck,
                                                        kernels::backend* host = nullptr,
                                                        int tp = 0);

/// The CPU backend an offloading shard updates its host state with; null without offload.
std::unique_ptr<kernels::backend> make_host_backend(const core::config& cfg);

}  // namespace troupe::actors
