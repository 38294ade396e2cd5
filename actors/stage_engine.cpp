#include "actors/stage_engine.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <thread>

#include "actors/tp_group.hpp"
#include "core/error.hpp"
#include "kernels/message_hash.hpp"
#include "model/forensics.hpp"
#include "model/optimizer.hpp"
#include "model/params.hpp"

namespace troupe::actors {

using schedules::op_kind;

namespace {

double seconds(stage_engine::clock::duration d) { return std::chrono::duration<double>(d).count(); }

/// A copy of t made by `be` (so the backend counts it, and `troupe plan`'s dry run on the meta
/// backend sees it).
core::tensor copy_on(kernels::backend& be, const core::tensor& t) {
  core::tensor out = be.empty(t.shape(), t.type());
  be.copy(t, out);
  return out;
}

}  // namespace

stage_engine::stage_engine(const core::config& cfg, job_layout layout, int dp, int pp,
                           std::vector<schedules::instruction> program, kernels::backend& be,
                           std::vector<model::chunk> chunks, clock::time_point epoch)
    : cfg_(cfg),
      layout_(layout),
      dp_(dp),
      pp_(pp),
      program_(std::move(program)),
      be_(be),
      chunks_(std::move(chunks)),
      epoch_(epoch) {
  TROUPE_CHECK(static_cast<int>(chunks_.size()) == layout_.v,
               "stage holds " + std::to_string(chunks_.size()) + " chunks, expected " +
                   std::to_string(layout_.v));
  tokens_ = static_cast<std::int64_t>(layout_.dp) * layout_.microbatches *
            cfg_.parallel.micro_batch_size * cfg_.model.seq_length;
  // The optimizer shards seed their master weights from these buffers on their own streams.
  for (auto& c : chunks_) be_.record_ready(c.flat_params());
}

core::tensor hand_over(kernels::backend& be, core::tensor t, bool reused) {
  if (!t.defined() || t.dev().is_cpu()) return t;
  if (reused) {
    core::tensor copy = be.empty(t.shape(), t.type());
    be.copy(t, copy);
    t = std::move(copy);
  }
  be.record_ready(t);
  return t;
}

void stage_engine::begin_step(std::int64_t step, float loss_scale, bool again) {
  step_ = step;
  if (group_) group_->set_step(step);
  const bool has_head = pp_ == layout_.rank_of_chunk(layout_.chunks() - 1);
  const std::int64_t trained =
      data_ && has_head
          ? data_->trained_targets(static_cast<std::uint64_t>(step),
                                   static_cast<std::uint64_t>(layout_.dp) *
                                       static_cast<std::uint64_t>(layout_.microbatches) *
                                       static_cast<std::uint64_t>(cfg_.parallel.micro_batch_size))
          : tokens_;
  grad_scale_ = model::loss_grad_scale(loss_scale, trained);
  pc_ = 0;
  losses_.assign(has_head ? layout_.microbatches : 0, NAN);
  again_ = again;
  seq_losses_.clear();
  losses_ready_ = false;
  losses_sent_ = false;
  blocked_since_.reset();
  waiting_for_.clear();
  timing_ = {};
  device_spans_.clear();
  reduce_state_.clear();
  finishing_ = false;
  for (auto& c : chunks_) c.zero_grads();
}

void stage_engine::deliver(const transport::tag& tg, core::tensor t) {
  const bool device = !t.dev().is_cpu();
  stash(tg, std::move(t));
  if (device) unwaited_.insert(tg);
}

void stage_engine::stash(const transport::tag& tg, core::tensor t) {
  auto [it, fresh] = stash_.emplace(tg, std::move(t));
  TROUPE_CHECK(fresh, "stage(dp=" + std::to_string(dp_) + ", pp=" + std::to_string(pp_) +
                          ") received " + tg.to_string() + " twice");
}

core::tensor stage_engine::take(const transport::tag& tg) {
  auto node = stash_.extract(tg);
  TROUPE_CHECK(!node.empty(), "stage(dp=" + std::to_string(dp_) + ", pp=" + std::to_string(pp_) +
                                  ") has no tensor " + tg.to_string() +
                                  " (the schedule sends something it never produced)");
  if (unwaited_.erase(tg)) {
    be_.wait_ready(node.mapped());
    if (span_start_) span_start_ = be_.mark_time();
  }
  return std::move(node.mapped());
}

core::tensor stage_engine::on_device(core::tensor t) {
  if (t.dev() == be_.dev()) return t;
  return be_.from_host(t);
}

transport::tag stage_engine::tag_of(tensor_kind k, int chunk, int mb, int part) const {
  return transport::tag{step_, static_cast<std::uint32_t>(k), chunk, mb, part};
}

void stage_engine::emit(address to, transport::tag tg, core::tensor t,
                        std::shared_ptr<kernels::pending_value> hash) {
  // Activations, input gradients and the tied-gradient copy are fresh tensors nobody writes again:
  // they leave as they are. Gradient slices are views of the gradient buffer, which the next step
  // zeroes: with several replicas a copy leaves, since a shard that does not update this replica
  // sends nothing back that would order that zeroing after its reads. With one replica the one
  // shard reads the view and sends the parameters back, and this stage's stream waits for them
  // (deliver) before its next step writes the buffer: the view leaves, no copy.
  const bool reused =
      tg.kind == static_cast<std::uint32_t>(tensor_kind::grad_slice) && layout_.dp > 1;
  out_.push_back(outgoing{to, tg, hand_over(be_, std::move(t), reused), std::move(hash)});
}

std::vector<outgoing> stage_engine::take_outgoing() { return std::exchange(out_, {}); }

model::chunk& stage_engine::chunk_for(int global_chunk) {
  TROUPE_CHECK(layout_.rank_of_chunk(global_chunk) == pp_,
               "chunk " + std::to_string(global_chunk) + " does not live on pipeline rank " +
                   std::to_string(pp_));
  return chunks_.at(layout_.local_index(global_chunk));
}

void stage_engine::record(const std::string& name, event_cat cat, clock::time_point start,
                          clock::time_point end) {
  double dur = seconds(end - start);
  (cat == event_cat::compute ? timing_.busy_s
   : cat == event_cat::comm  ? timing_.comm_s
                             : timing_.wait_s) += dur;
  timing_.events.push_back(trace_event{name, cat, seconds(start - epoch_) * 1e6, dur * 1e6});
}

std::string stage_engine::current_instruction() const {
  if (step_ < 0 || pc_ >= program_.size()) return "";
  return schedules::to_string(program_[pc_]);
}

std::string stage_engine::waiting_for() const { return waiting_for_; }

std::uint64_t stage_engine::peak_activation_bytes() const {
  std::uint64_t total = 0;
  for (const auto& c : chunks_) total += c.peak_saved_activation_bytes();
  return total;
}

void stage_engine::maybe_inject_fault(const schedules::instruction& op) const {
  const std::string& spec = cfg_.runtime.fault_inject;
  if (spec.empty()) return;
  std::string want = std::to_string(layout_.worker(dp_, pp_, tp_)) + ":" + std::to_string(step_) + ":" +
                     schedules::to_string(op);
  if (spec == want) throw core::failure("injected fault (runtime.fault_inject = \"" + spec + "\")");
}

/// TROUPE_FAULT=kill (test only): this worker process dies by SIGKILL, as one killed from outside
/// (the out-of-memory killer, an operator) does: no handler runs, nothing is flushed or closed.
void stage_engine::kill_self(const schedules::instruction& op) const {
  std::fprintf(stderr,
               "troupe worker rank %d: %s: sending SIGKILL to this worker (pid %d) at step %lld, "
               "before %s (attempt %d; test only)\n",
               layout_.worker(dp_, pp_, tp_), fault_->label().c_str(), static_cast<int>(::getpid()),
               static_cast<long long>(step_), schedules::to_string(op).c_str(), fault_->attempt);
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
  for (;;) ::pause();  // SIGKILL is never blocked: this is not reached
}

bool stage_engine::run() {
  TROUPE_CHECK(step_ >= 0, "run() before begin_step()");
  while (pc_ < program_.size()) {
    const auto& op = program_[pc_];
    auto t0 = clock::now();
    maybe_inject_fault(op);
    if (fault_ && fault_->kind == core::fault_kind::kill && step_ == fault_->step &&
        schedules::is_compute(op.kind))
      kill_self(op);
    // On a device, the instruction's time on its stream: from when the stream reached the work
    // queued before it (its inputs waited for) to when it ran what the instruction queued.
    if (!be_.dev().is_cpu() && schedules::is_compute(op.kind)) span_start_ = be_.mark_time();
    const bool ran = execute(op);
    auto m0 = std::move(span_start_);
    if (!ran) {
      if (!blocked_since_) blocked_since_ = t0;
      return false;
    }
    if (m0) device_spans_.push_back({schedules::to_string(op), std::move(m0), be_.mark_time()});
    auto t1 = clock::now();
    if (fault_ && fault_->kind == core::fault_kind::slow && schedules::is_compute(op.kind)) {
      // TROUPE_FAULT=slow (test only): a straggler, as a slower device or a throttled host is.
      std::this_thread::sleep_for((t1 - t0) * (fault_->factor - 1));
      t1 = clock::now();
    }
    if (blocked_since_) {
      record("wait " + schedules::to_string(op), event_cat::wait, *blocked_since_, t0);
      blocked_since_.reset();
    }
    waiting_for_.clear();
    record(schedules::to_string(op),
           schedules::is_compute(op.kind) ? event_cat::compute : event_cat::comm, t0, t1);
    ++pc_;
    if (!out_.empty()) return false;  // let the host send it now (see stage.cpp's pump)
  }
  return finish_step();
}

bool stage_engine::execute(const schedules::instruction& op) {
  const int last = layout_.chunks() - 1;
  auto need = [&](const transport::tag& tg) {
    if (has(tg)) return true;
    waiting_for_ = tg.to_string();
    return false;
  };
  switch (op.kind) {
    case op_kind::F: {
      auto& ch = chunk_for(op.chunk);
      auto in_tag = op.chunk == 0 ? tag_of(tensor_kind::tokens, 0, op.mb)
                                  : tag_of(tensor_kind::activation, op.chunk, op.mb);
      auto tgt_tag = tag_of(tensor_kind::targets, last, op.mb);
      if (!need(in_tag)) return false;
      if (op.chunk == last && !need(tgt_tag)) return false;
      // Packed rows: the micro-batch's document starts (host int32), one copy per stage, kept
      // until the stage's last chunk has run its forward.
      core::tensor docs;
      if (packed()) {
        auto doc_tag = tag_of(tensor_kind::documents, pp_, op.mb);
        if (!need(doc_tag)) return false;
        const int last_here = layout_.chunk_of(pp_, layout_.v - 1);
        docs = op.chunk == last_here ? take(doc_tag) : stash_.at(doc_tag);
      }
      core::tensor input = on_device(take(in_tag));
      core::tensor targets = op.chunk == last ? on_device(take(tgt_tag)) : core::tensor{};
      // The micro-batch's first sequence in the global batch (the loader's numbering): the
      // dropout masks are those the single-rank trainer draws for it.
      const std::int64_t first_sample = static_cast<std::int64_t>(dp_ * layout_.microbatches + op.mb) *
                                        cfg_.parallel.micro_batch_size;
      core::tensor out =
          ch.forward(op.mb, input, targets, grad_scale_,
                     model::training_dropout(cfg_.model, cfg_.train.seed, step_, first_sample),
                     docs);
      if (op.chunk == last) maybe_poison(op.mb);
      if (op.chunk != last)
        stash(tag_of(tensor_kind::activation, op.chunk + 1, op.mb), std::move(out));
      return true;
    }
    case op_kind::B:
    case op_kind::I: {
      auto& ch = chunk_for(op.chunk);
      core::tensor grad_out;
      if (op.chunk != last) {
        auto g_tag = tag_of(tensor_kind::gradient, op.chunk, op.mb);
        if (!need(g_tag)) return false;
        grad_out = on_device(take(g_tag));
      }
      core::tensor dinput = op.kind == op_kind::B ? ch.backward(op.mb, grad_out)
                                                  : ch.backward_input(op.mb, grad_out);
      if (op.chunk != 0)
        stash(tag_of(tensor_kind::gradient, op.chunk - 1, op.mb), std::move(dinput));
      if (op.chunk == last && op.mb == layout_.microbatches - 1 && !losses_sent_) {
        // Every micro-batch's forward is done; read the losses now, not after each forward, so
        // the host is not held to the device's pace inside the step.
        for (int m = 0; m < layout_.microbatches; ++m) losses_.at(m) = ch.loss_sum(m);
        if (again_)
          for (int m = 0; m < layout_.microbatches; ++m) {
            auto seq = model::sequence_loss_sums(be_, ch.loss_rows(m), cfg_.parallel.micro_batch_size);
            seq_losses_.insert(seq_losses_.end(), seq.begin(), seq.end());
          }
        losses_ready_ = true;
      }
      return true;
    }
    case op_kind::W:
      chunk_for(op.chunk).backward_weight(op.mb);
      return true;
    case op_kind::SEND_F: {
      auto tg = tag_of(tensor_kind::activation, op.chunk + 1, op.mb);
      emit(address{role::stage, dp_, op.peer, tp_}, tg, take(tg));
      return true;
    }
    case op_kind::RECV_F:
      return need(tag_of(tensor_kind::activation, op.chunk, op.mb));
    case op_kind::SEND_B: {
      auto tg = tag_of(tensor_kind::gradient, op.chunk - 1, op.mb);
      emit(address{role::stage, dp_, op.peer, tp_}, tg, take(tg));
      return true;
    }
    case op_kind::RECV_B:
      return need(tag_of(tensor_kind::gradient, op.chunk, op.mb));
    case op_kind::REDUCE_GRAD:
      return reduce_grad(op.chunk);
    case op_kind::STEP:
      return true;  // the step's end is finish_step(), run after the last instruction
  }
  return true;
}

/// TROUPE_FAULT=nan (test only): a NaN in one element of this stage's first chunk's gradient
/// in the fault's step, just before the gradient leaves for the optimizer shards — as a bad kernel,
/// a flipped bit in memory or an overflow would leave it.
void stage_engine::maybe_inject_nan(int c) {
  if (!fault_ || fault_->kind != core::fault_kind::nan || nan_injected_ || step_ != fault_->step ||
      c != pp_)
    return;
  nan_injected_ = true;
  // The middle element of the middle parameter (not padding between parameters, which no norm
  // and no update reads).
  const auto& params = chunk_for(c).params();
  const model::param_info& p = params.at(params.size() / 2);
  const std::int64_t at = p.offset + p.numel / 2;
  core::tensor g = chunk_for(c).flat_grads();
  core::tensor nan = core::tensor::zeros({1}, core::dtype::f32);
  nan.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  core::tensor dst = g.slice(at, {1});
  if (g.type() == core::dtype::f32) {
    be_.copy(nan, dst);
  } else {
    core::tensor one = be_.empty({1}, g.type());
    be_.convert(on_device(nan), one);
    be_.copy(one, dst);
  }
  std::fprintf(stderr,
               "troupe: %s: stage(dp=%d, pp=%d) put a NaN into element %lld of the gradient of %s "
               "(chunk %d) at step %lld\n",
               fault_->label().c_str(), dp_, pp_, static_cast<long long>(p.numel / 2), p.name.c_str(),
               c, static_cast<long long>(step_));
  std::fflush(stderr);
}

/// TROUPE_FAULT=poison (test only): the loss of the fault's global sequence is bad (NaN, or the
/// fault's value) each time its step is computed — its first target's loss, written after the last
/// chunk's forward of the micro-batch that holds it, as a sequence that overflows would leave it.
void stage_engine::maybe_poison(int mb) {
  if (!fault_ || fault_->kind != core::fault_kind::poison || step_ != fault_->step) return;
  const std::int64_t B = cfg_.parallel.micro_batch_size;
  const std::int64_t g = fault_->sequence / B;  // the global micro-batch
  if (g / layout_.microbatches != dp_ || g % layout_.microbatches != mb) return;
  core::tensor rows = chunk_for(layout_.chunks() - 1).loss_rows(mb);
  const std::int64_t at = (fault_->sequence % B) * cfg_.model.seq_length;
  core::tensor bad = core::tensor::zeros({1}, core::dtype::f32);
  bad.data<float>()[0] = static_cast<float>(fault_->loss);
  core::tensor dst = rows.slice(at, {1});
  be_.copy(on_device(bad), dst);
  std::fprintf(stderr,
               "troupe: %s: stage(dp=%d, pp=%d) made the loss of the first target of global "
               "sequence %lld (micro-batch %d) %g at step %lld\n",
               fault_->label().c_str(), dp_, pp_, static_cast<long long>(fault_->sequence), mb,
               fault_->loss, static_cast<long long>(step_));
  std::fflush(stderr);
}

void stage_engine::share_norm_blocks(std::size_t i, std::shared_ptr<norm_handoff> h) {
  if (norm_handoffs_.size() <= i) norm_handoffs_.resize(i + 1);
  norm_handoffs_[i] = std::move(h);
}

std::shared_ptr<kernels::pending_value> stage_engine::hash_with_norm_blocks(std::size_t i,
                                                                           const core::tensor& g) {
  if (!hash_gradients_ || i >= norm_handoffs_.size() || !norm_handoffs_[i]) return nullptr;
  norm_handoff& h = *norm_handoffs_[i];
  const auto nb = static_cast<std::int64_t>(h.counts.size());
  if (static_cast<std::uint64_t>(nb) != kernels::message_hash_blocks_of(g.bytes())) return nullptr;
  if (!h.sums.defined()) {
    core::tensor host = core::tensor::zeros({nb}, core::dtype::i32);
    std::copy(h.counts.begin(), h.counts.end(), host.data<std::int32_t>());
    h.device_counts = on_device(host);
    h.sums = be_.empty({nb}, core::dtype::f64);
  }
  if (grad_hash_blocks_.size() <= i) grad_hash_blocks_.resize(i + 1);
  if (!grad_hash_blocks_[i].defined()) grad_hash_blocks_[i] = be_.empty({nb}, core::dtype::i64);
  be_.message_hash_sumsq_blocks(g, h.device_counts, grad_hash_blocks_[i], h.sums);
  h.mark(step_, g.raw());
  return be_.message_hash_of_blocks_async(grad_hash_blocks_[i], g.bytes());
}

void stage_engine::send_slices(int c) {
  maybe_inject_nan(c);
  core::tensor g = chunk_for(c).flat_grads();
  // One shard (the one replica's) that adopts this gradient: one read of it gives the message
  // hash and the norm blocks, queued before emit marks the gradient ready for the shard.
  std::shared_ptr<kernels::pending_value> hash =
      layout_.dp == 1 ? hash_with_norm_blocks(static_cast<std::size_t>(layout_.local_index(c)), g)
                      : nullptr;
  for (int k = 0; k < layout_.dp; ++k) {
    auto [lo, hi] = layout_.shard_range(g.numel(), k);
    emit(address{role::shard, pp_, k, tp_}, tag_of(tensor_kind::grad_slice, c, -1, k),
         g.slice(lo, {hi - lo}), hash);
  }
  reduce_state_[c] = reduce_progress::slices_sent;
}

bool stage_engine::reduce_grad(int c) {
  reduce_progress& state = reduce_state_[c];
  if (state == reduce_progress::slices_sent) return true;
  const int last = layout_.chunks() - 1;
  const bool tied = model::tied_gradients(cfg_.model) && (c == 0 || c == last);
  if (!tied) {
    send_slices(c);
    return true;
  }
  const std::string emb = model::embedding_name(cfg_.model);
  if (last == 0) {  // one chunk holds both uses; its head has no copy of its own to update
    core::tensor g_wte = chunk_for(0).grad(emb), g_head = chunk_for(0).grad("lm_head.weight");
    model::tie_gradients(be_, g_wte, g_head, !chunk_for(0).shares_head());
    send_slices(c);
    return true;
  }
  const int partner = c == 0 ? last : 0;
  if (layout_.rank_of_chunk(partner) == pp_) {
    // Both uses live on this rank: sum once both gradients are complete, i.e. when the second of
    // the two is reduced (or at the end of the step).
    if (reduce_state_[partner] == reduce_progress::none && !finishing_) {
      state = reduce_progress::tied_sent;
      return true;
    }
    core::tensor g_wte = chunk_for(0).grad(emb), g_head = chunk_for(last).grad("lm_head.weight");
    model::tie_gradients(be_, g_wte, g_head);
    send_slices(c);
    if (reduce_state_[partner] != reduce_progress::slices_sent) send_slices(partner);
    return true;
  }
  // The partner is on another rank: send a copy now, add the partner's copy when it has come
  // (a + b == b + a, so both ranks get the same bits). Never wait inside the instruction list:
  // the partner may need this rank's later instructions before it reaches its own REDUCE_GRAD.
  core::tensor mine = chunk_for(c).grad(c == 0 ? emb : "lm_head.weight");
  if (state == reduce_progress::none) {
    // A copy: this rank adds the partner's gradient into `mine` while the partner reads this one.
    // On a GPU the copy stays on the device (a host round trip of the embedding's gradient costs
    // tens of milliseconds per step).
    emit(address{role::stage, dp_, layout_.rank_of_chunk(partner), tp_},
         tag_of(tensor_kind::tied_grad, c, -1),
         be_.dev().is_cpu() ? copy_on(be_, mine) : hand_over(be_, mine, true));
    state = reduce_progress::tied_sent;
  }
  if (!finishing_) return true;
  auto tg = tag_of(tensor_kind::tied_grad, partner, -1);
  if (!has(tg)) {
    waiting_for_ = "the tied embedding gradient of chunk " + std::to_string(partner);
    return false;
  }
  be_.accumulate(on_device(take(tg)), mine);
  send_slices(c);
  return true;
}

bool stage_engine::finish_step() {
  finishing_ = true;
  auto t0 = clock::now();
  for (int i = 0; i < layout_.v; ++i) {
    int c = layout_.chunk_of(pp_, i);
    if (reduce_state_[c] != reduce_progress::slices_sent && !reduce_grad(c)) {
      if (!blocked_since_) blocked_since_ = t0;
      return false;
    }
  }
  for (int i = 0; i < layout_.v; ++i) {
    int c = layout_.chunk_of(pp_, i);
    for (int k = 0; k < layout_.dp; ++k) {
      if (!layout_.shard_updates(k, dp_)) continue;
      if (!has(tag_of(tensor_kind::param_slice, c, -1, k))) {
        if (!blocked_since_) blocked_since_ = t0;
        waiting_for_ = "updated parameters of chunk " + std::to_string(c) + " from shard " +
                       std::to_string(k);
        return false;
      }
      if (layout_.returns_reduced_grads() && !has(tag_of(tensor_kind::reduced_grad, c, -1, k))) {
        if (!blocked_since_) blocked_since_ = t0;
        waiting_for_ = "reduced gradients of chunk " + std::to_string(c) + " from shard " +
                       std::to_string(k);
        return false;
      }
    }
  }
  if (blocked_since_) {
    record("wait optimizer", event_cat::wait, *blocked_since_, t0);
    blocked_since_.reset();
  }
  waiting_for_.clear();
  for (int i = 0; i < layout_.v; ++i) {
    int c = layout_.chunk_of(pp_, i);
    auto& ch = chunk_for(c);
    // A shard that adopted this stage's parameter buffer (shard_engine::adopts_params: one
    // replica, on this worker) updated it in place and wrote the low-precision copy: what arrives
    // is the buffer itself (its stream already waited for, by deliver), so nothing is copied or
    // converted.
    bool in_place = true;
    for (int k = 0; k < layout_.dp; ++k) {
      if (!layout_.shard_updates(k, dp_)) continue;
      auto [lo, hi] = layout_.shard_range(ch.flat_params().numel(), k);
      core::tensor dst = ch.flat_params().slice(lo, {hi - lo});
      core::tensor src = take(tag_of(tensor_kind::param_slice, c, -1, k));
      const bool same = src.store() == dst.store() && src.byte_offset() == dst.byte_offset() &&
                        src.numel() == dst.numel();
      if (!same) in_place = false;
      if (hi > lo && !same) be_.copy(src, dst);
      if (layout_.returns_reduced_grads()) {
        core::tensor gdst = ch.flat_grads().slice(lo, {hi - lo});
        core::tensor src = take(tag_of(tensor_kind::reduced_grad, c, -1, k));
        if (hi > lo) be_.copy(src, gdst);
      }
    }
    if (!in_place) ch.trainable_updated();
  }
  record("STEP", event_cat::comm, t0, clock::now());
  resolve_device_spans();
  return true;
}

void stage_engine::resolve_device_spans() {
  if (device_spans_.empty()) return;
  // Read once the parameters are back: the shards' norms of this step's gradients reached the host
  // before that, so the marks have normally been reached and the host does not wait here.
  std::vector<std::shared_ptr<kernels::time_mark>> marks;
  for (const auto& d : device_spans_) {
    marks.push_back(d.start);
    marks.push_back(d.end);
  }
  const auto at = be_.mark_times(marks);
  for (std::size_t i = 0; i < device_spans_.size(); ++i) {
    const double dur = seconds(at[2 * i + 1] - at[2 * i]);
    timing_.device_busy_s += dur;
    timing_.device_events.push_back(trace_event{device_spans_[i].name, event_cat::compute,
                                                seconds(at[2 * i] - epoch_) * 1e6, dur * 1e6});
  }
  device_spans_.clear();
}

}  // namespace troupe::actors
