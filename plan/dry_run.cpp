#include "plan/dry_run.hpp"

#include <deque>
#include <memory>

#include "actors/layout.hpp"
#include "actors/shard_engine.hpp"
#include "actors/stage_engine.hpp"
#include "kernels/meta_backend.hpp"
#include "model/chunk.hpp"
#include "model/tensor_parallel.hpp"
#include "plan/meta_comm.hpp"
#include "runtime/build.hpp"

namespace troupe::plan {

namespace {

using actors::address;
using actors::role;
using actors::tensor_kind;

/// Labels for what a stage or shard allocates while the step runs: the logits (and dlogits, which
/// the cross-entropy writes over them) are recognised by their vocabulary-wide rows (this
/// tensor-parallel rank's vocabulary rows under model_parallel); fp32 buffers shaped like gradient
/// or parameter slices (1-D and longer than any per-row statistic) and the copies of a tied
/// embedding's gradient are what travels to the optimizer shards and back.
kernels::meta_backend::classifier classify(const core::model_config& m, std::int64_t rows, int tp) {
  const std::int64_t vocab = model::vocab_range_of(m.vocab_size, tp, 0).rows;
  return [vocab, hidden = m.hidden_size, rows](const core::shape_t& s, core::dtype t) -> std::string {
    if (s.size() == 2 && (s[1] == vocab || s[1] == kernels::cuda_logits_width(vocab)))
      return "logits";
    if (t == core::dtype::f32 && s.size() == 1 && s[0] > rows && s[0] > hidden)
      return "communication";
    if (t == core::dtype::f32 && s.size() == 2 && s[0] == vocab && s[1] == hidden)
      return "communication";
    return "";
  };
}

backend_peak peak_of(const kernels::meta_backend& be) { return {be.peak_bytes(), be.peak_by_label()}; }

struct worker_parts {
  std::unique_ptr<kernels::meta_backend> stage_be, shard_be;
  std::unique_ptr<meta_comm> comm;  // model_parallel > 1: this rank's collectives
  std::unique_ptr<kernels::meta_backend> host_be;  // optimizer.offload: the shard's host state
  std::unique_ptr<actors::stage_engine> stage;
  std::unique_ptr<actors::shard_engine> shard;
};

}  // namespace

core::result<dry_run_result> dry_run(const core::config& cfg, device_model dev, int steps) {
  auto sched = actors::build_schedule(cfg, actors::layout_of(cfg).microbatches);
  if (!sched.ok()) return sched.err();
  const actors::job_layout l = actors::layout_of(cfg, sched.value());
  const std::int64_t rows =
      static_cast<std::int64_t>(cfg.parallel.micro_batch_size) * cfg.model.seq_length;
  kernels::meta_backend::options mo;
  mo.cuda_rounding = mo.cuda_fusions = dev == device_model::cuda;
  const core::device claimed =
      dev == device_model::cuda ? core::device{core::device_kind::cuda, 0} : core::device{};

  dry_run_result out;
  out.params.assign(l.pp, 0);
  out.grads.assign(l.pp, 0);
  out.low.assign(l.pp, 0);
  out.frozen.assign(l.pp, 0);
  out.saved_per_microbatch.assign(l.pp, 0);
  const auto specs = model::partition(cfg);
  const auto epoch = std::chrono::steady_clock::now();

  // Build every worker's stage (chunks as build_stage_chunks makes them, without the host-side
  // initialisation: the values do not matter here) and its shard. Tensor-parallel ranks hold their
  // slices (model::chunk_tp) and run their collectives through a meta_comm.
  const bool device = dev == device_model::cuda;
  const int kv = model::kv_replicas(cfg.model, l.tp);
  kernels::meta_backend host_results;  // the CPU collectives' results: host tensors, not counted
  // Rank t's chunk_tp on `be`, its collectives kept in `comm` (model_parallel 1: none).
  auto tp_of = [&](std::unique_ptr<meta_comm>& comm, kernels::meta_backend& be, int t) {
    if (l.tp == 1) return model::chunk_tp{};
    comm = std::make_unique<meta_comm>(l.tp, t, cfg.parallel.sequence_parallel, kv, be,
                                       host_results, device);
    return model::chunk_tp{l.tp, t, comm.get()};
  };
  std::map<rank_key, worker_parts> w;
  for (int d = 0; d < l.dp; ++d)
    for (int p = 0; p < l.pp; ++p)
      for (int t = 0; t < l.tp; ++t) {
        worker_parts& wp = w[{d, p, t}];
        wp.stage_be = std::make_unique<kernels::meta_backend>(mo);
        wp.stage_be->set_device(claimed);
        const model::chunk_tp tp = tp_of(wp.comm, *wp.stage_be, t);
        std::vector<model::chunk> chunks;
        {
          kernels::meta_backend::scope s(*wp.stage_be, "parameters and gradients");
          for (int i = 0; i < l.v; ++i) {
            model::chunk c(cfg.model, specs[l.chunk_of(p, i)], *wp.stage_be, cfg.precision.compute, tp);
            c.set_recompute(cfg.recompute.mode, core::recompute_layers(cfg),
                            core::keep_gelu_layers(cfg));
            // The gradients are made on first use: here, so that they count as what they are.
            const std::uint64_t grads = wp.stage_be->rounded(c.flat_grads().bytes());
            if (d == 0 && t == 0) {
              out.params[p] += wp.stage_be->rounded(c.flat_params().bytes());
              out.grads[p] += grads;
              if (c.flat_low().defined()) out.low[p] += wp.stage_be->rounded(c.flat_low().bytes());
              for (const core::tensor* f : {&c.flat_frozen(), &c.flat_frozen_low()})
                if (f->defined()) out.frozen[p] += wp.stage_be->rounded(f->bytes());
            }
            chunks.push_back(std::move(c));
          }
        }
        wp.stage_be->set_classifier(classify(cfg.model, rows, l.tp));
        wp.stage = std::make_unique<actors::stage_engine>(cfg, l, d, p, sched.value().ranks.at(p),
                                                          *wp.stage_be, std::move(chunks), epoch);
        wp.stage->set_tp(t, nullptr);
      }
  for (auto& [key, wp] : w) {
    const auto [k, p, t] = key;
    wp.shard_be = std::make_unique<kernels::meta_backend>(mo);
    wp.shard_be->set_device(claimed);
    std::vector<actors::shard_chunk> sc;
    auto& chunks = wp.stage->chunks();
    for (int i = 0; i < l.v; ++i)
      sc.push_back(actors::shard_chunk{l.chunk_of(p, i), chunks[i].params(),
                                         chunks[i].flat_params(), chunks[i].flat_low()});
    kernels::meta_backend::scope s(*wp.shard_be, "optimizer state");
    if (cfg.optimizer.offload) wp.host_be = std::make_unique<kernels::meta_backend>(mo);
    wp.shard = std::make_unique<actors::shard_engine>(cfg, l, p, k, *wp.shard_be, std::move(sc),
                                                      wp.host_be.get());
    wp.shard->set_tp(t);
  }
  for (auto& [k, wp] : w) wp.shard_be->set_classifier(classify(cfg.model, rows, l.tp));

  // One micro-batch's saved activations, per pipeline rank: a forward on a chunk of its own (of
  // tensor-parallel rank 0, whose shard is every rank's size).
  for (int p = 0; p < l.pp; ++p) {
    kernels::meta_backend probe(mo);
    probe.set_device(claimed);
    std::unique_ptr<meta_comm> comm;
    const model::chunk_tp tp = tp_of(comm, probe, 0);
    for (int i = 0; i < l.v; ++i) {
      const model::chunk_spec& spec = specs[l.chunk_of(p, i)];
      model::chunk c(cfg.model, spec, probe, cfg.precision.compute, tp);
      c.set_recompute(cfg.recompute.mode, core::recompute_layers(cfg),
                      core::keep_gelu_layers(cfg));
      // Under sequence parallel a rank's residual stream holds its rows of the micro-batch.
      const std::int64_t own = cfg.parallel.sequence_parallel ? rows / l.tp : rows;
      core::tensor in = spec.has_embedding
                            ? probe.empty({rows}, core::dtype::i32)
                            : probe.empty({own, cfg.model.hidden_size},
                                          c.flat_low().defined() ? c.flat_low().type() : core::dtype::f32);
      core::tensor tgt = spec.has_head ? probe.empty({rows}, core::dtype::i32) : core::tensor{};
      c.forward(0, in, tgt, 1.0f);
      out.saved_per_microbatch[p] += c.saved_activation_bytes();
    }
  }

  // The coordinator's copy of the whole model for the validation loss (actors/coordinator_engine:
  // built when data.val is set, full recompute, no gradients) and one evaluation micro-batch
  // through it, as model::validation_loss runs it.
  if (!cfg.data.val.empty()) {
    kernels::meta_backend probe(mo);
    probe.set_device(claimed);
    model::chunk c(cfg.model, model::partition(cfg.model, 1)[0], probe, cfg.precision.compute);
    c.set_recompute(core::recompute_mode::full);
    c.forward(0, probe.empty({rows}, core::dtype::i32), probe.empty({rows}, core::dtype::i32),
              0.0f);
    c.release(0);
    out.evaluation = probe.peak_bytes();
  }

  const int last = l.chunks() - 1;
  for (int step = 0; step < steps; ++step) {
    for (auto& [k, wp] : w) wp.stage->begin_step(step);
    // The loaders' host tensors: tokens to the first stage, targets to the last.
    // Every tensor-parallel rank of the first and last stage reads all of them.
    for (int d = 0; d < l.dp; ++d)
      for (int t = 0; t < l.tp; ++t)
        for (int mb = 0; mb < l.microbatches; ++mb) {
          w[{d, 0, t}].stage->deliver(
              transport::tag{step, static_cast<std::uint32_t>(tensor_kind::tokens), 0, mb, 0},
              core::tensor::zeros({rows}, core::dtype::i32));
          w[{d, l.rank_of_chunk(last), t}].stage->deliver(
              transport::tag{step, static_cast<std::uint32_t>(tensor_kind::targets), last, mb, 0},
              core::tensor::zeros({rows}, core::dtype::i32));
        }
    std::map<rank_key, bool> done, applied;
    std::deque<std::pair<address, actors::outgoing>> queue;  // (from, message)
    auto route = [&](const address& from, std::vector<actors::outgoing> msgs) {
      for (auto& m : msgs) queue.emplace_back(from, std::move(m));
    };
    auto deliver_all = [&] {
      bool moved = !queue.empty();
      while (!queue.empty()) {
        auto [from, m] = std::move(queue.front());
        queue.pop_front();
        if (m.to.who == role::stage) {
          w.at({m.to.a, m.to.b, m.to.c}).stage->deliver(m.tag, std::move(m.t));
        } else if (m.to.who == role::shard) {
          // shard (pp, part, tp) lives on worker (part, pp, tp)
          auto& wp = w.at({m.to.b, m.to.a, m.to.c});
          wp.shard->deliver(from.a, m.tag, std::move(m.t));
          const rank_key sk{m.to.a, m.to.b, m.to.c};
          if (!applied[sk] && wp.shard->reduce(step)) {
            wp.shard->take_norm_parts();
            wp.shard->apply(step, 1.0f, cfg.optimizer.lr);
            applied[sk] = true;
            route(address{role::shard, m.to.a, m.to.b, m.to.c}, wp.shard->take_outgoing());
          }
        }
      }
      return moved;
    };
    for (;;) {
      bool progress = false, all = true;
      for (auto& [k, wp] : w) {
        if (done[k]) continue;
        const std::string before = wp.stage->current_instruction();
        done[k] = wp.stage->run();
        route(address{role::stage, std::get<0>(k), std::get<1>(k), std::get<2>(k)},
              wp.stage->take_outgoing());
        progress |= done[k] || before != wp.stage->current_instruction();
        all &= done[k];
      }
      progress |= deliver_all();
      if (all) break;
      if (!progress) {
        std::string who;
        for (auto& [k, wp] : w)
          if (!done[k])
            who += " stage(dp=" + std::to_string(std::get<0>(k)) + ", pp=" +
                   std::to_string(std::get<1>(k)) + ", tp=" + std::to_string(std::get<2>(k)) +
                   ") at " + wp.stage->current_instruction() + " waiting for " +
                   wp.stage->waiting_for() + ";";
        return core::error::make("the plan's dry run of the schedule cannot progress:" + who,
                                 "check the schedule with `troupe schedule check`");
      }
    }
  }
  for (auto& [k, wp] : w) {
    const auto [d, p, t] = k;
    out.stages[k] = peak_of(*wp.stage_be);
    out.shards[{p, d, t}] = peak_of(*wp.shard_be);
    if (wp.host_be) out.shard_host[{p, d, t}] = wp.host_be->peak_bytes();
  }
  return out;
}

}  // namespace troupe::plan
