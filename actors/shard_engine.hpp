// The behaviour of an optimizer shard as a plain class: it owns, for one pipeline rank, slice
// `part` of every local chunk's flat buffers (fp32 master weights and AdamW moments; see
// layout.hpp for which slice under which ZeRO stage), sums the replicas' gradient slices in
// replica order, reports per-block squared norms, and applies the coordinator's clip scale and
// learning rate with the same optimizer code as the single-rank trainer (model/optimizer.hpp).
#pragma once

#include <map>
#include <utility>
#include <vector>

#include "actors/layout.hpp"
#include "actors/stage_engine.hpp"
#include "model/optimizer.hpp"

namespace troupe::actors {

/// What a shard needs to know about one chunk it holds a slice of.
struct shard_chunk {
  int chunk = 0;                          // global chunk id
  std::vector<model::param_info> params;  // the chunk's parameters (offsets into its flat buffer)
  core::tensor initial;                   // the chunk's initial flat params (host or device;
                                          // REQUIRES: record_ready by the backend that wrote it)
};

class shard_engine {
 public:
  shard_engine(const core::config& cfg, job_layout layout, int pp, int part, kernels::backend& be,
               std::vector<shard_chunk> chunks);

  /// Stashes replica `replica`'s gradient slice (tag kind grad_slice); this shard's backend will
  /// wait for it.
  void deliver(int replica, const transport::tag& tg, core::tensor t);
  /// True once every replica's slice of every chunk of `step` arrived; then reduces them, in
  /// replica order, and computes the norm blocks (only once per step).
  bool reduce(std::int64_t step);
  /// Norm blocks of each chunk's slice after reduce(), as (chunk, blocks); empty when this shard
  /// does not contribute to the norm.
  std::vector<std::pair<int, std::vector<std::int64_t>>> take_norm_parts();
  /// AdamW on the owned slices with the coordinator's decision — gradient factor `scale` (clip and
  /// loss-scale undo), learning rate, AdamW's 1-based t — or, when `skip` (dynamic loss scaling
  /// saw an overflow), no update at all. Either way queues the parameter slices (and, under
  /// ZeRO-1, the reduced gradients) for the replicas, which wait for them to finish the step.
  void apply(std::int64_t step, float scale, double lr, std::int64_t adam_step, bool skip);
  /// apply without loss scaling: t = step + 1, never skipped.
  void apply(std::int64_t step, float scale, double lr) { apply(step, scale, lr, step + 1, false); }
  /// Peak device memory of this shard's backend (0 on the CPU).
  std::uint64_t peak_device_bytes() const { return be_.peak_memory_bytes(); }
  std::vector<outgoing> take_outgoing() { return std::exchange(out_, {}); }

  /// Bytes of optimizer state held: master slice + two moments.
  std::uint64_t state_bytes() const;
  int part() const { return part_; }
  int pp() const { return pp_; }
  /// Slots (master, reduced grad, moments) of every owned parameter slice, for checkpoints.
  std::vector<model::param_slot>& slots() { return slots_; }
  /// The owned element range of chunk `i` (index into the constructor's list).
  std::pair<std::int64_t, std::int64_t> range(std::size_t i) const { return ranges_.at(i); }
  const std::vector<shard_chunk>& chunks() const { return chunks_; }
  std::vector<model::optimizer_state>& moments() { return moments_; }
  /// Rebuilds the slot views (after master/moments tensors were replaced, e.g. on resume).
  void rebuild_slots();

 private:
  const core::config& cfg_;
  job_layout layout_;
  int pp_, part_;
  kernels::backend& be_;
  std::vector<shard_chunk> chunks_;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges_;
  std::vector<core::tensor> master_;              // per chunk: owned slice of the params
  std::vector<core::tensor> reduced_;             // per chunk: owned slice of the summed grads
  std::vector<model::optimizer_state> moments_;   // per chunk
  std::vector<model::param_slot> slots_;          // every owned parameter piece, in global order
  std::vector<std::size_t> slot_chunk_;           // chunk index of each slot
  std::map<std::pair<transport::tag, int>, core::tensor> stash_;
  std::int64_t reduced_step_ = -1;
  std::vector<std::pair<int, std::vector<std::int64_t>>> norm_parts_;
  std::vector<outgoing> out_;
};

}  // namespace troupe::actors
