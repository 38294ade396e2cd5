// The behaviour of a stage actor as a plain class (docs/design.md, Actors): it owns the model
// chunks of one (replica, pipeline rank), executes that rank's instruction list for a step, and
// keeps every tensor that arrives early in a stash keyed by its tag until an instruction takes it.
// It never blocks: `run` executes instructions until one needs a tensor that is not there yet and
// returns; the host (the CAF actor, or a test driver) delivers tensors and calls `run` again.
//
// Outgoing tensors are queued as `outgoing` records; the host moves them over the transport and
// tells the receiver. Nothing here knows CAF.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "actors/layout.hpp"
#include "actors/wire.hpp"
#include "core/config.hpp"
#include "core/fault.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"
#include "model/loader.hpp"
#include "schedules/schedule.hpp"
#include "transport/transport.hpp"

namespace troupe::actors {

class tp_group;

/// A tensor for another actor.
struct outgoing {
  address to;
  transport::tag tag;
  core::tensor t;
  /// t's message hash when the sender queued it already (shard_engine's hashed AdamW), else null.
  std::shared_ptr<kernels::pending_value> hash = nullptr;
};

/// A chunk's gradient-norm blocks, handed from the stage that sends the chunk's gradient to the
/// one optimizer shard that adopts it (one replica, docs/runtime.md step 5). When the message sink
/// takes pending hashes (recording's default), the stage reads the gradient once for both its
/// message hash and these sums (backend::message_hash_sumsq_blocks), and the shard takes them in
/// place of reading the gradient again for the norm; otherwise the shard sums the blocks itself,
/// with the same bits.
struct norm_handoff {
  /// Per message-hash block of the shard's gradient slice: the elements of it the shard's norm
  /// counts (the block's part of a tensor in the norm, 0 elsewhere). Set by the shard.
  std::vector<std::int32_t> counts;
  // Tensors of the stage's backend, made at its first use.
  core::tensor device_counts;  // `counts`, i32
  core::tensor sums;           // f64, one per block
  /// The stage queued `sums` of step `step`'s gradient at `data`, before that gradient left.
  void mark(std::int64_t step, const void* data) {
    std::lock_guard<std::mutex> lock(mu_);
    step_ = step;
    data_ = data;
  }
  /// Whether `sums` are those of step `step`'s gradient at `data` (a gradient replaced on its way,
  /// as TROUPE_PERTURB_SEND does, is summed by the shard).
  bool holds(std::int64_t step, const void* data) const {
    std::lock_guard<std::mutex> lock(mu_);
    return step_ == step && data_ == data;
  }

 private:
  mutable std::mutex mu_;
  std::int64_t step_ = -1;
  const void* data_ = nullptr;
};

/// `t` made ready to leave backend `be` for another backend (another stream on a GPU): when
/// `reused` (a view of a buffer the sender writes again, e.g. gradient or master buffers), a device
/// copy of it, so the receiver's reads never race the sender's next writes; then record_ready. On
/// the CPU the view itself (ops finish before they return).
core::tensor hand_over(kernels::backend& be, core::tensor t, bool reused);

/// Timings of one step of one stage.
struct stage_timing {
  double busy_s = 0;
  double comm_s = 0;
  double wait_s = 0;
  std::vector<trace_event> events;
  /// On a device backend, the compute instructions as its stream ran them (time marks around
  /// each); empty on the CPU, where the host's events are the device's.
  std::vector<trace_event> device_events;
  double device_busy_s = 0;
};

class stage_engine {
 public:
  using clock = std::chrono::steady_clock;

  /// REQUIRES: program is this rank's lowered instruction list; chunks are the chunks of pipeline
  /// rank `pp` in forward order (global ids pp, pp + P, ...), initialised identically on every
  /// replica.
  stage_engine(const core::config& cfg, job_layout layout, int dp, int pp,
               std::vector<schedules::instruction> program, kernels::backend& be,
               std::vector<model::chunk> chunks, clock::time_point epoch);

  /// The job's training data: the last stage scales the loss gradient by 1 / the step's trained
  /// targets over the global batch (model::loader::trained_targets, a pure function of the step
  /// that every rank computes alike), which is fewer than the tokens with masked instruction data.
  /// Without it every token of the global batch is a target.
  void set_data(std::shared_ptr<const model::loader> data) { data_ = std::move(data); }
  /// Packed instruction rows: each forward waits for its micro-batch's document starts
  /// (tensor_kind::documents, from the loader).
  bool packed() const { return data_ && data_->masked() && data_->rows_layout().packing; }
  /// Tensor parallel: this stage is rank `t` of its group, whose collectives `group` carries (the
  /// chunks were built with it; it outlives the engine). Stages exchange tensors with the same
  /// rank of their neighbours, and shards of the same rank. Null group: no tensor parallel.
  void set_tp(int t, tp_group* group) { tp_ = t, group_ = group; }
  int tp() const { return tp_; }
  int tp_group_size() const { return layout_.tp; }
  /// Arms a test-only fault of this stage's worker (TROUPE_FAULT nan, slow, kill or poison,
  /// core/fault.hpp).
  void inject(const core::fault_spec& f) { fault_ = f; }
  /// Starts step `step`: resets the program counter and timings. `loss_scale` multiplies the loss
  /// gradient (dynamic loss scaling; 1 without). `again`: step forensics executes the step once
  /// more from the state before it (the parameters are not updated until the coordinator has
  /// decided, so that state is still here); the last stage then also reports per-sequence losses.
  void begin_step(std::int64_t step, float loss_scale = 1.0f, bool again = false);
  /// Stashes a tensor that arrived for this stage; the instruction that takes it queues its
  /// backend's stream wait for it.
  void deliver(const transport::tag& tg, core::tensor t);
  /// Executes instructions until one must wait, one queued a tensor to send (so the host can send
  /// it at once), or the step is done. Returns true when done.
  /// Throws core::failure (with the instruction) when an instruction fails.
  bool run();
  /// Moves the queued outgoing tensors out.
  std::vector<outgoing> take_outgoing();

  /// Per-micro-batch loss sums of the last chunk this step (empty on other ranks).
  const std::vector<double>& losses() const { return losses_; }
  /// Per-sequence loss sums (micro-batch-major) in a step begun `again`; empty otherwise.
  const std::vector<double>& sequence_losses() const { return seq_losses_; }
  /// True once the last compute/transfer instruction ran and losses are final (before STEP).
  bool losses_ready() const { return losses_ready_; }
  /// Clears the losses-ready flag once the host reported them.
  void losses_reported() { losses_ready_ = false; losses_sent_ = true; }
  const stage_timing& timing() const { return timing_; }
  std::int64_t step() const { return step_; }
  /// Text of the instruction being executed or waited on ("" when none).
  std::string current_instruction() const;
  /// What the stage waits for, for hang reports ("" when not waiting).
  std::string waiting_for() const;
  std::uint64_t peak_activation_bytes() const;
  /// Peak device memory of this stage's backend (0 on the CPU).
  std::uint64_t peak_device_bytes() const { return be_.peak_memory_bytes(); }
  std::vector<model::chunk>& chunks() { return chunks_; }
  /// With `on`, the gradient a chunk sends to a shard that handed it a norm_handoff
  /// (share_norm_blocks) is hashed together with its norm blocks, and the hash goes with the
  /// outgoing message (outgoing::hash) so that recording does not read it again; off by default.
  void hash_gradients(bool on) { hash_gradients_ = on; }
  /// The norm blocks of local chunk `i`, shared with the shard that adopts its gradient (null:
  /// none).
  void share_norm_blocks(std::size_t i, std::shared_ptr<norm_handoff> h);
  int dp() const { return dp_; }
  int pp() const { return pp_; }

 private:
  bool execute(const schedules::instruction& op);
  bool reduce_grad(int chunk);
  void send_slices(int chunk);
  /// With hash_gradients and a norm_handoff for local chunk `i`: queues the message hash and the
  /// norm blocks of its gradient `g` in one pass, marks the handoff, and returns the hash; else
  /// null.
  std::shared_ptr<kernels::pending_value> hash_with_norm_blocks(std::size_t i,
                                                                const core::tensor& g);
  bool finish_step();
  model::chunk& chunk_for(int global_chunk);
  bool has(const transport::tag& tg) const { return stash_.count(tg) > 0; }
  void stash(const transport::tag& tg, core::tensor t);
  core::tensor take(const transport::tag& tg);
  core::tensor on_device(core::tensor t);
  transport::tag tag_of(tensor_kind k, int chunk, int mb, int part = 0) const;
  void emit(address to, transport::tag tg, core::tensor t,
            std::shared_ptr<kernels::pending_value> hash = nullptr);
  void record(const std::string& name, event_cat cat, clock::time_point start, clock::time_point end);
  void maybe_inject_fault(const schedules::instruction& op) const;
  [[noreturn]] void kill_self(const schedules::instruction& op) const;
  void maybe_inject_nan(int chunk);
  void maybe_poison(int mb);

  const core::config& cfg_;
  job_layout layout_;
  int dp_, pp_;
  int tp_ = 0;
  tp_group* group_ = nullptr;
  std::vector<schedules::instruction> program_;
  kernels::backend& be_;
  std::vector<model::chunk> chunks_;
  clock::time_point epoch_;
  std::int64_t tokens_ = 0;  // tokens per step (global)
  std::shared_ptr<const model::loader> data_;  // null: every token is a target
  float grad_scale_ = 0;     // d loss / d token loss = loss scale / trained targets of the step

  std::int64_t step_ = -1;
  std::size_t pc_ = 0;
  std::map<transport::tag, core::tensor> stash_;
  /// Delivered tensors whose stream wait is not queued yet: `take` queues it, so the stream waits
  /// for another worker's work only where an instruction uses its result, not wherever the
  /// message happened to arrive in this stage's queue.
  std::set<transport::tag> unwaited_;
  /// The start mark of the compute instruction being run (device only); a wait queued by `take`
  /// moves it after the wait, so the wait counts as idle, as the simulator counts it.
  std::shared_ptr<kernels::time_mark> span_start_;
  std::vector<outgoing> out_;
  bool hash_gradients_ = false;
  std::vector<std::shared_ptr<norm_handoff>> norm_handoffs_;  // per local chunk, or null
  std::vector<core::tensor> grad_hash_blocks_;  // per local chunk (hash_gradients): first level
  std::vector<double> losses_;
  std::vector<double> seq_losses_;
  bool again_ = false;
  bool losses_ready_ = false;
  bool losses_sent_ = false;
  std::optional<clock::time_point> blocked_since_;
  std::string waiting_for_;
  stage_timing timing_;
  struct device_span {
    std::string name;
    std::shared_ptr<kernels::time_mark> start, end;
  };
  std::vector<device_span> device_spans_;  // this step's, resolved by finish_step
  void resolve_device_spans();
  /// REDUCE_GRAD progress of a chunk.
  enum class reduce_progress {
    none,         // not started
    tied_sent,    // the tied embedding's gradient handled (sent to its partner, or deferred)
    slices_sent,  // the gradient slices went to the shards: done
  };
  std::map<int, reduce_progress> reduce_state_;
  bool finishing_ = false;  // past the last instruction: deferred reductions run now
  std::optional<core::fault_spec> fault_;  // test only (inject)
  bool nan_injected_ = false;
};

}  // namespace troupe::actors
