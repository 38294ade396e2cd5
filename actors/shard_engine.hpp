// The behaviour of an optimizer shard as a plain class: it owns, for one pipeline rank, slice
// `part` of every local chunk's flat buffers (fp32 master weights and AdamW moments; see
// layout.hpp for which slice under which ZeRO stage), sums the replicas' gradient slices in
// replica order, reports per-block squared norms, and applies the coordinator's clip scale and
// learning rate with the same optimizer code as the single-rank trainer (model/optimizer.hpp).
//
// Offload (optimizer.offload): the master slices and the moments live in page-locked host memory
// (kernels/offload.hpp) and AdamW runs on the host backend (the CPU backend's vectorised,
// multi-threaded adamw, whose bits equal the CUDA kernel's). Replicas' slices are still summed and
// the norm blocks still computed on the device, by the same code as without offload, so the clip
// and the skip-on-overflow decision see the same bits; right after, the summed slice is copied to
// the host in pieces of `offload_piece` elements on the device stream, while the coordinator
// decides, through a ring of `offload_ring` page-locked staging buffers of one piece each (so the
// host holds 12 bytes per owned element, not 16). apply() updates each piece as soon as its copy
// has landed and queues the copy of a later piece into the freed buffer, so the CPU update of one
// piece overlaps the copies of the next ones. With one replica (uploads_params) each updated piece
// goes straight back into the stage's parameter buffer and low-precision copy on the device stream
// while the host updates the next pieces, and the stage receives its own buffer; with several, the
// stages copy the updated host slices back into their parameters. On the CPU backend the copies
// are host-to-host and the code path is the same.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "actors/layout.hpp"
#include "actors/stage_engine.hpp"
#include "kernels/offload.hpp"
#include "model/optimizer.hpp"

namespace troupe::actors {

/// Elements per device-to-host copy of an offloaded gradient slice (16 MiB of fp32; a multiple of
/// kernels::norm_block).
inline constexpr std::int64_t offload_piece = std::int64_t{1} << 22;
/// Staging buffers of offload_piece elements each: copies in flight while the host updates.
inline constexpr int offload_ring = 4;

/// What a shard needs to know about one chunk it holds a slice of.
struct shard_chunk {
  int chunk = 0;                          // global chunk id
  std::vector<model::param_info> params;  // the chunk's parameters (offsets into its flat buffer)
  core::tensor initial;                   // the chunk's initial flat params (host or device;
                                          // REQUIRES: record_ready by the backend that wrote it)
  core::tensor low{};                     // the stage's low-precision copy of them (bf16/fp16),
                                          // or undefined (fp32)
};

class shard_engine {
 public:
  /// REQUIRES: `host` (the backend that updates host memory: the CPU backend, or a meta backend
  /// in a dry run) when cfg.optimizer.offload, outliving the engine; ignored otherwise.
  shard_engine(const core::config& cfg, job_layout layout, int pp, int part, kernels::backend& be,
               std::vector<shard_chunk> chunks, kernels::backend* host = nullptr);

  /// Stashes replica `replica`'s gradient slice (tag kind grad_slice); this shard's backend will
  /// wait for it.
  void deliver(int replica, const transport::tag& tg, core::tensor t);
  /// True once every replica's slice of every chunk of `step` arrived; then reduces them, in
  /// replica order, and computes the norm blocks (only once per step).
  bool reduce(std::int64_t step);
  /// Norm blocks of each chunk's slice after reduce(), as (chunk, blocks); empty when this shard
  /// does not contribute to the norm.
  std::vector<std::pair<int, std::vector<std::int64_t>>> take_norm_parts();
  /// After reduce(), when this shard's part of the gradient norm is not finite: where the first
  /// non-finite value came from — "NaN in the gradient of h.1.attn.c_attn.weight (element 5 of
  /// it, chunk 1) from stage(dp=1, pp=1) (rank 3)"; "" when the part is finite.
  const std::string& nonfinite() const { return nonfinite_; }
  /// After reduce(), with runtime.forensics on: the message hash of global chunk `chunk`'s summed
  /// slice (its bits, for step forensics' comparison of two executions); 0 otherwise.
  std::uint64_t grad_hash(int chunk) const;
  /// Step forensics executes `step` again: forgets its reduction (waiting for host copies in
  /// flight under offload), so that the replicas' new gradient slices are reduced afresh. Nothing
  /// was applied: the optimizer state is that before the step. REQUIRES: reduce(step) was true.
  void forget(std::int64_t step);
  /// AdamW on the owned slices with the coordinator's decision — gradient factor `scale` (clip and
  /// loss-scale undo), learning rate, AdamW's 1-based t — or, when `skip` (dynamic loss scaling
  /// saw an overflow), no update at all. Either way queues the parameter slices (and, under
  /// ZeRO-1, the reduced gradients) for the replicas, which wait for them to finish the step.
  void apply(std::int64_t step, float scale, double lr, std::int64_t adam_step, bool skip);
  /// With `on`, apply() hashes the parameter slices it updates as AdamW writes them
  /// (model::adamw_update_hashed) and attaches each slice's message hash to its outgoing
  /// parameter messages, so recording does not read them again; off by default.
  void hash_updates(bool on) { hash_updates_ = on; }
  /// The norm blocks of chunk `i` (index into the constructor's list) that the stage sending its
  /// gradient computes as it hashes it, when this shard adopts that gradient and counts in the
  /// norm; null otherwise (stage_engine::share_norm_blocks).
  std::shared_ptr<norm_handoff> norm_blocks(std::size_t i) const {
    return i < norm_handoffs_.size() ? norm_handoffs_[i] : nullptr;
  }
  /// apply without loss scaling: t = step + 1, never skipped.
  void apply(std::int64_t step, float scale, double lr) { apply(step, scale, lr, step + 1, false); }
  /// Peak device memory of this shard's backend (0 on the CPU).
  std::uint64_t peak_device_bytes() const { return be_.peak_memory_bytes(); }
  std::vector<outgoing> take_outgoing() { return std::exchange(out_, {}); }

  /// Bytes of optimizer state held: master slice + two moments (in host memory under offload).
  std::uint64_t state_bytes() const;
  /// True when the master slices and moments live in host memory (optimizer.offload).
  bool offloaded() const { return host_ != nullptr; }
  int part() const { return part_; }
  int pp() const { return pp_; }
  /// The tensor-parallel rank whose slices this shard updates (0 without tensor parallel): it
  /// serves the stages of that rank, and counts in the gradient norm only what that rank holds
  /// first (model::counts_in_norm).
  void set_tp(int t);
  int tp() const { return tp_; }
  /// Slots (master, reduced grad, moments) of every owned parameter slice, for checkpoints; under
  /// offload master and moments are host tensors and the gradient is the device's reduced slice.
  std::vector<model::param_slot>& slots() { return slots_; }
  /// The owned element range of chunk `i` (index into the constructor's list).
  std::pair<std::int64_t, std::int64_t> range(std::size_t i) const { return ranges_.at(i); }
  const std::vector<shard_chunk>& chunks() const { return chunks_; }
  std::vector<model::optimizer_state>& moments() { return moments_; }
  /// Rebuilds the slot views (after master/moments tensors were replaced, e.g. on resume).
  void rebuild_slots();

 private:
  /// One replica without returned sums: reduce() takes the stage's gradient slice as the sum.
  bool adopts_gradients() const { return layout_.dp == 1 && !layout_.returns_reduced_grads(); }
  /// One replica, state on the device: the shard owns every element, and the one stage it updates
  /// lives on its worker with `initial` its live parameter buffer. The master weights are that
  /// buffer and AdamW writes the stage's low-precision copy in the same pass (as the single-rank
  /// trainer's does), so the stage neither copies the update in nor converts it.
  bool adopts_params() const { return layout_.dp == 1 && !host_; }
  /// One replica, state on the host (offload): the shard owns every element and `initial` is the
  /// stage's live parameter buffer, so each updated piece is copied back into it (and converted
  /// into the stage's low-precision copy) as soon as the host has updated it.
  bool uploads_params() const { return layout_.dp == 1 && host_; }
  /// Offload: one piece of one chunk's owned range [begin, end) (elements of the chunk buffer).
  struct piece {
    std::size_t chunk;
    std::int64_t begin, end;
  };
  /// The slots of piece `p` with their gradients in `staged` (the piece's host copy).
  std::vector<model::param_slot> piece_slots(const piece& p, const core::tensor& staged) const;
  /// Queues the host copy of pieces_[next_piece_] into staging buffer `buffer` (offload).
  void copy_next_piece(int buffer);
  std::string locate_nonfinite(std::size_t i, const std::vector<core::tensor>& slices);
  /// The slots of chunk `i` whose gradients count in this shard's part of the norm (tied copies
  /// are skipped by model::gradient_sumsq).
  std::vector<model::param_slot> norm_slots(std::size_t i) const;
  /// norm_handoff::counts of chunk `i`'s slice for norm_slots(i), or nothing when a slot does
  /// not start at a block.
  std::optional<std::vector<std::int32_t>> norm_counts(std::size_t i) const;
  /// (Re)makes norm_handoffs_ for the current tensor-parallel rank.
  void make_norm_handoffs();

  const core::config& cfg_;
  job_layout layout_;
  int pp_, part_;
  int tp_ = 0;
  kernels::backend& be_;
  kernels::backend* host_ = nullptr;              // non-null under offload
  std::vector<shard_chunk> chunks_;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges_;
  std::vector<core::tensor> master_;              // per chunk: owned slice of the params
  std::vector<core::tensor> low_;                 // per chunk: the stage's low copy AdamW writes
                                                  // (adopts_params), else undefined
  std::vector<core::tensor> stage_params_;        // per chunk (uploads_params): the stage's
  std::vector<core::tensor> stage_low_;           // parameters and low copy, else empty
  std::vector<core::tensor> reduced_;             // per chunk: owned slice of the summed grads
  std::vector<model::optimizer_state> moments_;   // per chunk
  std::vector<model::param_slot> slots_;          // every owned parameter piece, in global order
  // offload: the pieces in update order, the staging ring, and the copies in flight (in order)
  std::vector<piece> pieces_;
  std::vector<core::tensor> staging_;
  struct pending_copy {
    std::size_t piece;
    int buffer;
    std::unique_ptr<kernels::host_fence> landed;
  };
  std::deque<pending_copy> copies_;
  std::size_t next_piece_ = 0;
  std::vector<std::size_t> slot_chunk_;           // chunk index of each slot
  std::map<std::pair<transport::tag, int>, core::tensor> stash_;
  std::int64_t reduced_step_ = -1;
  std::vector<std::pair<int, std::vector<std::int64_t>>> norm_parts_;
  std::string nonfinite_;
  std::map<int, std::uint64_t> grad_hashes_;  // global chunk -> hash (runtime.forensics)
  bool hash_updates_ = false;
  std::vector<core::tensor> hash_blocks_;  // per chunk (hash_updates): the first hash level
  std::vector<std::shared_ptr<norm_handoff>> norm_handoffs_;  // per chunk, or null
  std::vector<outgoing> out_;
};

}  // namespace troupe::actors
