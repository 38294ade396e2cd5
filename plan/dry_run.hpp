// The memory side of `troupe plan`: a dry run of one training step of a job on meta backends
// (kernels/meta_backend.hpp). Every worker's real stage_engine, with its real model::chunk objects,
// and every real shard_engine execute the lowered schedule; tensors move between them as handles,
// as the in-process transport moves them; the meta backends count what each allocates and when it
// is released. So the planned bytes are the runtime's own allocations by construction: nothing is
// a formula that could drift from the code (tests/plan/memory_test.cpp compares them with a real
// CPU run, bench/plan_check.sh with a GPU run).
//
// Tensor parallel (parallel.model_parallel > 1): every (dp, pp, tp) worker gets its own stage with
// its shard of the weights (model::chunk_tp) and its own optimizer shards, as runtime/host.cpp
// builds them; their collectives are plan::meta_comm's (meta_comm.hpp), which allocate what
// actors::tp_group allocates and need no peer to return, so one thread steps every rank.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"

namespace troupe::plan {

/// Which backend's allocation pattern the dry run reproduces.
enum class device_model { cpu, cuda };

/// Peak bytes of one backend (a stage's or a shard's), split by what held them at that peak.
struct backend_peak {
  std::uint64_t peak = 0;
  std::map<std::string, std::uint64_t> split;  // label -> bytes at the peak
};

/// (dp, pp, tp) of a stage, (pp, part, tp) of an optimizer shard.
using rank_key = std::tuple<int, int, int>;

/// What a dry run measured for each worker (dp, pp, tp).
struct dry_run_result {
  std::map<rank_key, backend_peak> stages;  // (dp, pp, tp)
  /// (pp, part, tp); shard (pp, k, t) is on worker (k, pp, t)
  std::map<rank_key, backend_peak> shards;
  /// optimizer.offload: peak host bytes of each shard's offloaded state (pp, part, tp); empty
  /// without.
  std::map<rank_key, std::uint64_t> shard_host;
  /// Static bytes of a stage (per pipeline rank; tensor-parallel ranks hold equal shards, these
  /// are rank 0's): fp32 parameters, fp32 gradients, the low-precision working copy (0 in fp32),
  /// as the chunks allocate them.
  std::vector<std::uint64_t> params, grads, low;
  /// Per pipeline rank: bytes of the frozen base weights ([lora]) and their low-precision copy.
  std::vector<std::uint64_t> frozen;
  /// Saved activations of one micro-batch per pipeline rank (all its chunks), after the forward.
  std::vector<std::uint64_t> saved_per_microbatch;
  /// The peak of the coordinator's evaluation copy of the model (data.val set; 0 without): its
  /// weights, without gradients, and one evaluation micro-batch's forward, layer by layer. It
  /// lives on worker 0's device.
  std::uint64_t evaluation = 0;
};

/// Runs `steps` training steps of `cfg` (its layout, schedule, recompute, precision, ZeRO) on meta
/// backends. Errors: a schedule that does not build, or a job that cannot progress.
core::result<dry_run_result> dry_run(const core::config& cfg, device_model dev, int steps = 2);

}  // namespace troupe::plan
