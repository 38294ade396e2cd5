#include "actors/shard_engine.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "kernels/message_hash.hpp"
#include "model/tensor_parallel.hpp"

namespace troupe::actors {
namespace {

/// Index of the first non-finite value of a host f32 tensor, or -1.
std::int64_t first_nonfinite(const core::tensor& host) {
  const float* x = host.data<float>();
  for (std::int64_t i = 0; i < host.numel(); ++i)
    if (!std::isfinite(x[i])) return i;
  return -1;
}

}  // namespace

shard_engine::shard_engine(const core::config& cfg, job_layout layout, int pp, int part,
                           kernels::backend& be, std::vector<shard_chunk> chunks,
                           kernels::backend* host)
    : cfg_(cfg), layout_(layout), pp_(pp), part_(part), be_(be),
      host_(cfg.optimizer.offload ? host : nullptr), chunks_(std::move(chunks)) {
  TROUPE_CHECK(!cfg.optimizer.offload || host_,
               "shard(pp=" + std::to_string(pp_) + ", part=" + std::to_string(part_) +
                   "): optimizer.offload needs a host backend for the optimizer state");
  // Under offload the optimizer state is host memory the device backend can copy asynchronously.
  auto state = [&](std::int64_t n) {
    if (!host_) {
      core::tensor t = be_.empty({n}, core::dtype::f32);
      be_.zero(t);
      return t;
    }
    core::tensor t = kernels::pinned_host(be_, *host_, {n}, core::dtype::f32);
    host_->zero(t);
    return t;
  };
  for (auto& ch : chunks_) {
    auto [lo, hi] = layout_.shard_range(ch.initial.numel(), part_);
    ranges_.emplace_back(lo, hi);
    be_.wait_ready(ch.initial);  // the stage's backend wrote it (stage_engine records it ready)
    if (adopts_params()) {
      // The stage's own buffers (one replica: lo = 0, hi = every element).
      master_.push_back(ch.initial);
      low_.push_back(ch.low);
    } else {
      core::tensor m = state(hi - lo);
      if (hi > lo) be_.copy(ch.initial.slice(lo, {hi - lo}), m);
      master_.push_back(m);
      low_.emplace_back();
      if (uploads_params()) {
        stage_params_.push_back(ch.initial);
        stage_low_.push_back(ch.low);
      }
    }
    const core::tensor& m = master_.back();
    if (adopts_gradients()) {
      // reduce() adopts the stage's gradient slice before anything reads this one, so the shard
      // keeps no buffer of its own (the master slice, on the device the stage's parameter buffer,
      // stands in until then and is never read or written through it).
      reduced_.push_back(m);
    } else {
      core::tensor g = be_.empty({hi - lo}, core::dtype::f32);
      be_.zero(g);
      reduced_.push_back(g);
    }
    if (host_)
      for (std::int64_t a = lo; a < hi; a += offload_piece)
        pieces_.push_back(piece{ranges_.size() - 1, a, std::min(hi, a + offload_piece)});
    moments_.push_back(model::optimizer_state{state(hi - lo), state(hi - lo)});
    ch.initial = {};  // only needed to seed the master slice (or held as master_ above)
    ch.low = {};
  }
  if (host_) {
    std::int64_t largest = 0;
    for (const piece& p : pieces_) largest = std::max(largest, p.end - p.begin);
    const std::size_t n = std::min<std::size_t>(offload_ring, pieces_.size());
    for (std::size_t k = 0; k < n; ++k) staging_.push_back(state(largest));
  }
  rebuild_slots();
  make_norm_handoffs();
}

void shard_engine::set_tp(int t) {
  tp_ = t;
  make_norm_handoffs();
}

void shard_engine::make_norm_handoffs() {
  norm_handoffs_.clear();
  if (!adopts_gradients() || !layout_.norm_contributor(part_)) return;
  norm_handoffs_.resize(chunks_.size());
  for (std::size_t i = 0; i < chunks_.size(); ++i)
    if (auto counts = norm_counts(i)) {
      norm_handoffs_[i] = std::make_shared<norm_handoff>();
      norm_handoffs_[i]->counts = std::move(*counts);
    }
}

std::vector<model::param_slot> shard_engine::norm_slots(std::size_t i) const {
  std::vector<model::param_slot> mine;
  for (std::size_t s = 0; s < slots_.size(); ++s)
    if (slot_chunk_[s] == i &&
        (layout_.tp == 1 ||
         model::counts_in_norm(cfg_.model, slots_[s].info.name, layout_.tp, tp_)))
      mine.push_back(slots_[s]);
  return mine;
}

std::optional<std::vector<std::int32_t>> shard_engine::norm_counts(std::size_t i) const {
  const auto [lo, hi] = ranges_[i];
  std::vector<std::int32_t> counts(kernels::message_hash_blocks_of(
      static_cast<std::uint64_t>(hi - lo) * sizeof(float)));
  for (const model::param_slot& s : norm_slots(i)) {
    if (s.info.tied) continue;  // as model::gradient_sumsq
    const std::int64_t first = s.info.offset - lo;
    if (first % kernels::norm_block != 0) return std::nullopt;
    for (std::int64_t e = first; e < first + s.info.numel; e += kernels::norm_block)
      counts[static_cast<std::size_t>(e / kernels::norm_block)] =
          static_cast<std::int32_t>(std::min(kernels::norm_block, first + s.info.numel - e));
  }
  return counts;
}

void shard_engine::rebuild_slots() {
  slots_.clear();
  slot_chunk_.clear();
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    auto [lo, hi] = ranges_[i];
    for (const auto& p : chunks_[i].params) {
      std::int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
      if (a >= b) continue;
      model::param_info info = p;
      info.shape = {b - a};
      info.numel = b - a;
      info.offset = a;
      slots_.push_back(model::param_slot{
          info, master_[i].slice(a - lo, {b - a}), reduced_[i].slice(a - lo, {b - a}),
          moments_[i].exp_avg.slice(a - lo, {b - a}), moments_[i].exp_avg_sq.slice(a - lo, {b - a}),
          low_[i].defined() ? low_[i].slice(a - lo, {b - a}) : core::tensor{}});
      slot_chunk_.push_back(i);
    }
  }
}

void shard_engine::deliver(int replica, const transport::tag& tg, core::tensor t) {
  be_.wait_ready(t);
  auto [it, fresh] = stash_.emplace(std::make_pair(tg, replica), std::move(t));
  TROUPE_CHECK(fresh, "shard(pp=" + std::to_string(pp_) + ", part=" + std::to_string(part_) +
                          ") received " + tg.to_string() + " from replica " +
                          std::to_string(replica) + " twice");
}

bool shard_engine::reduce(std::int64_t step) {
  if (reduced_step_ == step) return true;
  auto key = [&](std::size_t i, int d) {
    return std::make_pair(transport::tag{step, static_cast<std::uint32_t>(tensor_kind::grad_slice),
                                         chunks_[i].chunk, -1, part_},
                          d);
  };
  for (std::size_t i = 0; i < chunks_.size(); ++i)
    for (int d = 0; d < layout_.dp; ++d)
      if (!stash_.count(key(i, d))) return false;
  norm_parts_.clear();
  nonfinite_.clear();
  bool adopted = false;
  // Every replica's slices, kept until the norm is known: when it is not finite, they tell whose
  // gradient went wrong (held views, no copies).
  std::vector<std::vector<core::tensor>> slices(chunks_.size());
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    // replica 0 + replica 1 + ... : the fixed order that makes the sum reproducible
    for (int d = 0; d < layout_.dp; ++d) {
      core::tensor g = stash_.extract(key(i, d)).mapped();
      slices[i].push_back(g);
      TROUPE_CHECK(g.numel() == reduced_[i].numel(),
                   "gradient slice of chunk " + std::to_string(chunks_[i].chunk) + " from replica " +
                       std::to_string(d) + " has " + std::to_string(g.numel()) +
                       " elements, expected " + std::to_string(reduced_[i].numel()));
      if (g.numel() == 0) continue;
      if (adopts_gradients()) {
        adopted = true;  // one replica: its slice is the sum; read it where it is
        reduced_[i] = std::move(g);
      } else if (d == 0) {
        // On the CPU replica 0 is added to replica 1 in one pass below (fl(g0 + g1), the bits
        // of copying g0 and accumulating g1), not copied first.
        if (!(be_.dev().is_cpu() && layout_.dp > 1)) be_.copy(g, reduced_[i]);
      } else if (d == 1 && be_.dev().is_cpu()) {
        be_.add(slices[i][0], g, reduced_[i]);
      } else {
        be_.accumulate(g, reduced_[i]);
      }
    }
  }
  if (adopted) rebuild_slots();
  if (layout_.norm_contributor(part_)) {
    // Under offload too the norm is taken of the device's reduced slices, by the same kernels.
    for (std::size_t i = 0; i < chunks_.size(); ++i) {
      // The stage's sums of the blocks it sent, when it computed them with the message hash.
      const norm_handoff* h =
          adopted && i < norm_handoffs_.size() ? norm_handoffs_[i].get() : nullptr;
      const core::exact_sum s = h && h->holds(step, reduced_[i].raw())
                                    ? model::exact_sum_of(be_, h->sums)
                                    : model::gradient_sumsq(be_, norm_slots(i));
      norm_parts_.emplace_back(chunks_[i].chunk,
                               std::vector<std::int64_t>(s.words, s.words + core::exact_sum_words));
      if (nonfinite_.empty() && !std::isfinite(s.value())) nonfinite_ = locate_nonfinite(i, slices[i]);
    }
  }
  grad_hashes_.clear();
  if (cfg_.runtime.forensics != "off" && layout_.norm_contributor(part_))
    for (std::size_t i = 0; i < chunks_.size(); ++i)
      grad_hashes_[chunks_[i].chunk] = be_.message_hash_async(reduced_[i])->get();
  if (host_) {
    // The first pieces start down to the host now, while the coordinator decides the step.
    TROUPE_CHECK(copies_.empty(), "shard(pp=" + std::to_string(pp_) + ", part=" +
                                      std::to_string(part_) +
                                      "): host copies of the last step's gradients still pending");
    next_piece_ = 0;
    for (int k = 0; k < static_cast<int>(staging_.size()); ++k) copy_next_piece(k);
  }
  reduced_step_ = step;
  return true;
}

void shard_engine::copy_next_piece(int buffer) {
  if (next_piece_ >= pieces_.size()) return;
  const piece& p = pieces_[next_piece_];
  const std::int64_t lo = ranges_[p.chunk].first, n = p.end - p.begin;
  core::tensor dst = staging_[buffer].slice(0, {n});
  kernels::copy_to_host_async(be_, reduced_[p.chunk].slice(p.begin - lo, {n}), dst);
  copies_.push_back(pending_copy{next_piece_, buffer, kernels::make_fence(be_)});
  ++next_piece_;
}

std::vector<model::param_slot> shard_engine::piece_slots(const piece& pc,
                                                         const core::tensor& staged) const {
  std::vector<model::param_slot> out;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (slot_chunk_[s] != pc.chunk) continue;
    const model::param_slot& sl = slots_[s];
    const std::int64_t x = std::max(pc.begin, sl.info.offset);
    const std::int64_t y = std::min(pc.end, sl.info.offset + sl.info.numel);
    if (x >= y) continue;
    const std::int64_t d = x - sl.info.offset;
    model::param_slot p = sl;
    p.info.offset = x;
    p.info.numel = y - x;
    p.info.shape = {y - x};
    p.param = sl.param.slice(d, {y - x});
    p.grad = staged.slice(x - pc.begin, {y - x});
    p.exp_avg = sl.exp_avg.slice(d, {y - x});
    p.exp_avg_sq = sl.exp_avg_sq.slice(d, {y - x});
    out.push_back(std::move(p));
  }
  return out;
}

std::string shard_engine::locate_nonfinite(std::size_t i, const std::vector<core::tensor>& slices) {
  const std::int64_t lo = ranges_[i].first;
  for (int d = 0; d < static_cast<int>(slices.size()); ++d) {
    if (slices[d].numel() == 0) continue;
    const core::tensor host = be_.to_host(slices[d]);  // gradients are fp32
    const std::int64_t at = first_nonfinite(host);
    if (at < 0) continue;
    std::string name = "?";
    std::int64_t within = lo + at;
    for (const auto& p : chunks_[i].params)
      if (lo + at >= p.offset && lo + at < p.offset + p.numel) {
        name = p.name;
        within = lo + at - p.offset;
      }
    return std::string(std::isnan(host.data<float>()[at]) ? "NaN" : "an infinity") +
           " in the gradient of " + name + " (element " + std::to_string(within) + " of it; chunk " +
           std::to_string(chunks_[i].chunk) + ") from " + actor_name(address{role::stage, d, pp_, tp_}) +
           " (rank " + std::to_string(layout_.worker(d, pp_, tp_)) + ")";
  }
  // Every replica's own slice is finite and their sum is not: it overflowed while they were added.
  return "the sum of the replicas' gradients of chunk " + std::to_string(chunks_[i].chunk) +
         " overflowed (each replica's own gradient is finite)";
}

std::uint64_t shard_engine::grad_hash(int chunk) const {
  auto it = grad_hashes_.find(chunk);
  return it == grad_hashes_.end() ? 0 : it->second;
}

void shard_engine::forget(std::int64_t step) {
  TROUPE_CHECK(reduced_step_ == step, "shard(pp=" + std::to_string(pp_) + ", part=" +
                                          std::to_string(part_) + ") asked to forget step " +
                                          std::to_string(step) + ", which it has not reduced");
  // The host copies of the summed slice that reduce() started (offload) must land before the
  // re-execution writes the gradients again.
  while (!copies_.empty()) {
    copies_.front().landed->wait();
    copies_.pop_front();
  }
  next_piece_ = 0;
  norm_parts_.clear();
  grad_hashes_.clear();
  nonfinite_.clear();
  reduced_step_ = -1;
}

std::vector<std::pair<int, std::vector<std::int64_t>>> shard_engine::take_norm_parts() {
  return std::exchange(norm_parts_, {});
}

void shard_engine::apply(std::int64_t step, float scale, double lr, std::int64_t adam_step,
                         bool skip) {
  TROUPE_CHECK(reduced_step_ == step, "shard(pp=" + std::to_string(pp_) + ", part=" +
                                          std::to_string(part_) + ") asked to update step " +
                                          std::to_string(step) + " before its gradients arrived");
  std::vector<std::shared_ptr<kernels::pending_value>> param_hashes(chunks_.size());
  if (host_) {
    // Piece by piece as each copy lands, the freed buffer taking the next piece's copy; AdamW is
    // element-wise, so the pieces give the bits of one update of the whole slice. A skipped step
    // copies nothing more, but waits for the copies in flight: under one replica without ZeRO the
    // device slice is the stage's gradient buffer, which it clears next step.
    if (skip) next_piece_ = pieces_.size();
    while (!copies_.empty()) {
      pending_copy c = std::move(copies_.front());
      copies_.pop_front();
      c.landed->wait();
      if (skip) continue;
      const piece& pc = pieces_[c.piece];
      std::vector<model::param_slot> slots = piece_slots(pc, staging_[c.buffer]);
      model::adamw_update_t(*host_, slots, cfg_.optimizer, lr, scale, adam_step);
      if (uploads_params()) {
        // The piece back into the stage's buffer while the host updates the next ones; the host
        // rewrites it only after a later copy of this stream has landed.
        const std::int64_t lo = ranges_[pc.chunk].first, n = pc.end - pc.begin;
        core::tensor dst = stage_params_[pc.chunk].slice(pc.begin, {n});
        kernels::copy_to_device_async(be_, master_[pc.chunk].slice(pc.begin - lo, {n}), dst);
        if (stage_low_[pc.chunk].defined()) {
          core::tensor low = stage_low_[pc.chunk].slice(pc.begin, {n});
          be_.convert(dst, low);  // element-wise: the bits of the stage's whole-buffer convert
        }
      }
      copy_next_piece(c.buffer);
    }
  } else if (!skip && hash_updates_) {
    hash_blocks_.resize(chunks_.size());
    for (std::size_t i = 0; i < chunks_.size(); ++i) {
      if (master_[i].numel() == 0) continue;
      std::vector<model::param_slot> mine;
      for (std::size_t s = 0; s < slots_.size(); ++s)
        if (slot_chunk_[s] == i) mine.push_back(slots_[s]);
      model::param_slot whole{{}, master_[i], reduced_[i], moments_[i].exp_avg,
                              moments_[i].exp_avg_sq, low_[i]};
      if (!hash_blocks_[i].defined())
        hash_blocks_[i] = be_.empty(
            {static_cast<std::int64_t>(kernels::message_hash_blocks_of(master_[i].bytes()))},
            core::dtype::i64);
      model::adamw_update_hashed(be_, mine, cfg_.optimizer, lr, scale, adam_step, whole,
                                 hash_blocks_[i]);
      param_hashes[i] = be_.message_hash_of_blocks_async(hash_blocks_[i], master_[i].bytes());
    }
  } else if (!skip) {
    model::adamw_update_t(be_, slots_, cfg_.optimizer, lr, scale, adam_step);
  }
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    for (int d = 0; d < layout_.dp; ++d) {
      if (!layout_.shard_updates(part_, d)) continue;
      address to{role::stage, d, pp_, tp_};
      // The master slice itself, not a copy: it is written again by the next update, which
      // needs this replica's next gradient slice, which that stage sends after it copied these
      // parameters (its stream ordered after this hand-over by wait_ready).
      // With uploads_params, the stage's own buffer, updated piece by piece above.
      const core::tensor& params = uploads_params() ? stage_params_[i] : master_[i];
      out_.push_back(outgoing{to,
                              transport::tag{step, static_cast<std::uint32_t>(tensor_kind::param_slice),
                                             chunks_[i].chunk, -1, part_},
                              hand_over(be_, params, false), param_hashes[i]});
      if (layout_.returns_reduced_grads())
        out_.push_back(outgoing{to,
                                transport::tag{step, static_cast<std::uint32_t>(tensor_kind::reduced_grad),
                                               chunks_[i].chunk, -1, part_},
                                hand_over(be_, reduced_[i], true)});
    }
  }
}

std::uint64_t shard_engine::state_bytes() const {
  std::uint64_t n = 0;
  for (const auto& m : master_) n += m.bytes() * 3;
  return n;
}

}  // namespace troupe::actors
