// Who is where in a data_parallel × pipeline_stage × model_parallel job, and which slice of a
// chunk's flat buffers each optimizer shard owns. Pure arithmetic shared by every actor (and by
// tests).
//
// Worker w = (dp·P + pp)·T + tp: tensor parallel innermost, so a tensor-parallel group is T
// consecutive ranks (docs/model.md). Each tensor-parallel rank holds its own slices of the chunks,
// and its optimizer shards are those below among the replicas of the same tensor-parallel rank.
// Optimizer shards: for each pipeline rank (and tensor-parallel rank), `data_parallel` shards.
//  - ZeRO-0: shard (pp, k) is replica k's own optimizer: it owns the whole buffer, receives every
//    replica's gradient (an all-reduce), and updates only replica k.
//  - ZeRO-1: shard (pp, k) owns slice k; gradients are all-reduced (every replica gets the summed
//    slices back), the shard updates its slice and all-gathers the parameters.
//  - ZeRO-2: as ZeRO-1 but gradients are only reduce-scattered to their owners.
// Slices are cut on kernels::norm_block boundaries so gradient-norm blocks never straddle shards.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "actors/wire.hpp"
#include "kernels/backend.hpp"
#include "schedules/schedule.hpp"

namespace troupe::actors {

struct job_layout {
  int dp = 1;           // data_parallel
  int pp = 1;           // pipeline_stage
  int tp = 1;           // model_parallel
  int v = 1;            // virtual_pipeline
  int zero_stage = 0;
  int microbatches = 1; // per replica per step: micro_batch_num × gradient_accumulation_steps
  schedules::placement place = schedules::placement::interleaved;  // the schedule's: where chunks live

  int chunks() const { return pp * v; }
  int workers() const { return dp * pp * tp; }
  int worker(int d, int p, int t = 0) const { return (d * pp + p) * tp + t; }
  /// The (dp, pp, tp) of worker w.
  int dp_of(int w) const { return w / tp / pp; }
  int pp_of(int w) const { return w / tp % pp; }
  int tp_of(int w) const { return w % tp; }
  int rank_of_chunk(int c) const { return schedules::chunk_rank(place, pp, c); }
  /// Where chunk c sits among its pipeline rank's chunks (forward order); both placements keep
  /// round c / pp as the rank's (c / pp)-th chunk.
  int local_index(int c) const { return c / pp; }
  /// The global id of pipeline rank p's i-th chunk (forward order).
  int chunk_of(int p, int i) const { return schedules::chunk_at(place, pp, p, i); }
  /// The elements [first, second) of a chunk buffer of `numel` elements that shard part k owns.
  std::pair<std::int64_t, std::int64_t> shard_range(std::int64_t numel, int k) const {
    if (zero_stage == 0) return {0, numel};
    std::int64_t blocks = (numel + kernels::norm_block - 1) / kernels::norm_block;
    std::int64_t per = (blocks + dp - 1) / dp;
    std::int64_t lo = std::min(numel, k * per * kernels::norm_block);
    std::int64_t hi = std::min(numel, (k + 1) * per * kernels::norm_block);
    return {lo, hi};
  }
  /// The number shard (part k, tensor-parallel rank t) goes by in norm and shard reports.
  int part_id(int k, int t) const { return t * dp + k; }
  /// Does shard part k send updated parameters to replica d?
  bool shard_updates(int k, int d) const { return zero_stage != 0 || k == d; }
  /// Does shard part k contribute its blocks to the global gradient norm?
  bool norm_contributor(int k) const { return zero_stage != 0 || k == 0; }
  /// Do shards send the summed gradient slices back to every replica (all-reduce)?
  bool returns_reduced_grads() const { return zero_stage == 1; }
};

/// The worker rank an address lives on (coordinator and checkpoint writer: worker 0).
inline int worker_of(const job_layout& l, const address& a) {
  switch (a.who) {
    case role::stage: return l.worker(a.a, a.b, a.c);
    case role::shard: return l.worker(a.b, a.a, a.c);
    case role::loader: return l.worker(a.a, 0);
    default: return 0;
  }
}

}  // namespace troupe::actors
