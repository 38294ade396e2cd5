// `troupe replay --rank R`: worker R alone. Its stage and optimizer shard run as plain engines in
// one loop, without CAF and without the other workers: every tensor another worker sent to R in
// the recorded run (tokens, targets, activations, gradients, tied-embedding gradients, other
// replicas' gradient slices, other shards' parameter slices) comes from rank_<R>.tensors, the
// shard applies the clip scale and learning rate recorded in rank_<R>.log (they depend on every
// shard's gradient norm), and every tensor R sends is compared with rank_<R>.log. A difference
// therefore lies in worker R's own computation, not upstream of it.
#include <chrono>
#include <thread>

#include "core/machine.hpp"
#include "runtime/build.hpp"
#include "replay/replay_parts.hpp"
#include "model/loader.hpp"
#include "kernels/select.hpp"

namespace troupe::actors {

namespace {

bool is_snapshot(std::uint32_t kind) {
  const auto k = static_cast<tensor_kind>(kind);
  return k == tensor_kind::snap_params || k == tensor_kind::snap_exp_avg ||
         k == tensor_kind::snap_exp_avg_sq;
}

}  // namespace

core::result<replay_report> replay_one_rank(const recorded_run& run, const replay_options& opt,
                                            int last_step) {
  const core::config& cfg = run.cfg;  // the engines keep references: `run` outlives them
  auto sched = build_schedule(cfg, layout_of(cfg).microbatches);
  if (!sched) return sched.err();
  const job_layout l = layout_of(cfg, sched.value());
  if (l.tp > 1)
    return core::error::make(
        "replay --rank " + std::to_string(opt.rank) + " of a run at parallel.model_parallel = " +
            std::to_string(l.tp) + ": a tensor-parallel rank needs its group's collectives, which "
            "the message log does not record",
        "replay the whole run (troupe replay RUN_DIR without --rank): it runs every rank, "
        "tensor-parallel groups included, and checks every recorded message");
  const int me = opt.rank, d = me / l.pp, p = me % l.pp;
  const int first = run.segments.front().first_step;
  const std::string mdir = messages_dir(run.dir);

  // What the neighbours sent: checked against the hashes their own logs hold before use.
  auto stored = read_tensors(mdir, me);
  if (!stored) return stored.err();
  std::map<std::int64_t, std::vector<stored_tensor>> inbox;  // step -> tensors
  for (auto& s : stored.value()) {
    if (s.dst != me || s.src == me) continue;
    auto it = run.records.find(message_key{s.src, s.dst, s.tag});
    const std::string what = kind_name(s.tag.kind) + " of chunk " + std::to_string(s.tag.chunk) +
                             ", micro-batch " + std::to_string(s.tag.mb) + ", step " +
                             std::to_string(s.tag.step) + " from rank " + std::to_string(s.src);
    if (it == run.records.end())
      return core::error::at_file(mdir + "/rank_" + std::to_string(me) + ".tensors",
                                  "holds the " + what + ", which rank " + std::to_string(s.src) +
                                      "'s log does not record",
                                  "the files are from different runs; record the run again");
    if (tensor_hash(s.value) != it->second.hash)
      return core::error::at_file(mdir + "/rank_" + std::to_string(me) + ".tensors",
                                  "the stored bytes of the " + what +
                                      " do not match the hash in " + it->second.file + " line " +
                                      std::to_string(it->second.line),
                                  "the file is damaged; record the run again");
    inbox[s.tag.step].push_back(std::move(s));
  }

  std::optional<model::checkpoint::reader> ck;
  if (first > 0) {
    const std::string& from = run.segments.front().resume;
    auto r = model::checkpoint::reader::open(from);
    if (!r)
      return core::error::make("the recorded run started at step " + std::to_string(first) +
                                   " from the checkpoint '" + from + "', which cannot be read: " +
                                   r.err().to_string(),
                               "restore that checkpoint to replay rank " + std::to_string(me));
    ck.emplace(std::move(r.value()));
  }
  // The first stage cuts the inputs; the last scales the loss by the step's trained targets;
  // every stage learns from it whether forwards wait for document starts (packed rows).
  std::shared_ptr<model::loader> data;
  {
    if (auto st = core::check_files(cfg); !st) return st.err();
    auto ld = model::loader::open(cfg.data.train, model::loader_options::from(cfg));
    if (!ld) return ld.err();
    data = std::make_shared<model::loader>(std::move(ld.value()));
  }

  const int cores = core::usable_cores();
  kernels::set_cpu_threads(cfg.runtime.threads > 0 ? cfg.runtime.threads : cores);
  kernels::set_gemm_tune_file(cfg.runtime.gemm_tune_file);
  auto be = kernels::make_backend(cfg.runtime.device);
  auto chunks = build_stage_chunks(cfg, l, p, *be, ck ? &*ck : nullptr);
  if (!chunks) return chunks.err();
  stage_engine stage(cfg, l, d, p, sched->ranks.at(p), *be, std::move(chunks.value()),
                     stage_engine::clock::now());
  stage.set_data(data);
  auto host_be = make_host_backend(cfg);
  auto shard_or = build_shard(cfg, l, p, d, *be, stage.chunks(), ck ? &*ck : nullptr, host_be.get());
  if (!shard_or) return shard_or.err();
  shard_engine& shard = *shard_or.value();

  // In scope: what worker R itself sent, snapshots excepted (they come after the step, from the
  // actors, which this replay does not run).
  message_checker checker(run, first, last_step + 1, !opt.dump_dir.empty(),
                          [me](const message_record& r) { return r.src == me && !is_snapshot(r.tag.kind); });
  replay_report rep;
  rep.first_step = first;
  rep.last_step = last_step;
  const address stage_addr{role::stage, d, p}, shard_addr{role::shard, p, d};

  // Sends of worker R: compared, then handed on when they stay on R; the rest were the
  // neighbours' business and are dropped.
  auto deliver_local = [&](const address& to, const transport::tag& tg, core::tensor t) {
    if (to.who == role::shard) shard.deliver(d, tg, std::move(t));
    else stage.deliver(tg, std::move(t));
  };
  auto send = [&](const address& from, const address& to, const transport::tag& tg,
                  core::tensor t, const sample_key* sample) {
    const int dst = worker_of(l, to);
    core::tensor host = host_view(t, be.get());
    if (!checker.check(record_of(from, me, to, dst, tg, host, sample), host)) return false;
    if (dst == me) deliver_local(to, tg, std::move(t));
    return true;
  };

  try {
    for (int s = first; s <= last_step; ++s) {
      if (opt.log) std::fprintf(opt.log, "replay --rank %d: step %d\n", me, s);
      if (data && p == 0) {
        const auto& o = data->options();
        const int last_chunk = l.chunks() - 1;
        for (int mb = 0; mb < l.microbatches; ++mb) {
          model::batch b = data->cut(static_cast<std::uint64_t>(s), d, mb);
          const sample_key key{o.seed, s, static_cast<std::int64_t>(d * l.microbatches + mb) * o.micro_batch_size,
                               o.micro_batch_size};
          const address loader{role::loader, d, 0};
          if (!send(loader, stage_addr,
                    transport::tag{s, static_cast<std::uint32_t>(tensor_kind::tokens), 0, mb, 0},
                    std::move(b.tokens), &key) ||
              !send(loader, address{role::stage, d, l.rank_of_chunk(last_chunk)},
                    transport::tag{s, static_cast<std::uint32_t>(tensor_kind::targets), last_chunk, mb, 0},
                    std::move(b.targets), &key))
            break;
          bool sent = true;
          if (b.doc_starts.defined())
            for (int q = 0; q < l.pp && sent; ++q)
              sent = send(loader, address{role::stage, d, q},
                          transport::tag{s, static_cast<std::uint32_t>(tensor_kind::documents), q, mb, 0},
                          b.doc_starts, &key);
          if (!sent) break;
        }
      }
      if (checker.mismatch()) break;
      // The step's loss scale (1 unless dynamic loss scaling is on), from the shard's clip record:
      // every shard logs the decision the stages' step began with.
      const auto clip = run.clips.find({me, s});
      stage.begin_step(s, clip == run.clips.end() ? 1.0f : clip->second.loss_scale);
      for (auto& t : inbox[s]) {
        if (is_snapshot(t.tag.kind)) continue;
        // A gradient slice is for the shard, from the stage of replica src / P.
        if (static_cast<tensor_kind>(t.tag.kind) == tensor_kind::grad_slice)
          shard.deliver(t.src / l.pp, t.tag, std::move(t.value));
        else
          stage.deliver(t.tag, std::move(t.value));
      }
      inbox.erase(s);
      bool applied = false;
      for (;;) {
        const bool done = stage.run();
        bool progressed = false;
        for (auto& o : stage.take_outgoing()) {
          if (!send(stage_addr, o.to, o.tag, std::move(o.t), nullptr)) break;
          progressed = true;  // run() yields after every send, so a send is progress
        }
        if (checker.mismatch()) break;
        if (!applied && shard.reduce(s)) {
          auto c = run.clips.find({me, s});
          if (c == run.clips.end())
            return core::error::at_file(mdir + "/rank_" + std::to_string(me) + ".log",
                                        "no clip decision recorded for step " + std::to_string(s),
                                        "the log is incomplete; record the run again");
          shard.take_norm_parts();
          shard.apply(s, c->second.scale, c->second.lr, c->second.adam_step, c->second.skip);
          for (auto& o : shard.take_outgoing())
            if (!send(shard_addr, o.to, o.tag, std::move(o.t), nullptr)) break;
          if (checker.mismatch()) break;
          applied = progressed = true;
        }
        if (done) break;
        if (!progressed)
          return core::error::make(
              "replaying rank " + std::to_string(me) + " alone stalled at step " + std::to_string(s) +
                  ", instruction " + stage.current_instruction() + ", waiting for " +
                  stage.waiting_for() + ", which the recorded tensors do not hold",
              "was the run recorded with runtime.record_tensors = true through step " +
                  std::to_string(last_step) + "?");
      }
      if (checker.mismatch()) break;
    }
  } catch (const std::exception& e) {
    return core::error::make("replaying rank " + std::to_string(me) + " failed at step " +
                                 std::to_string(stage.step()) + ", instruction " +
                                 stage.current_instruction() + ": " + e.what());
  }
  if (!checker.mismatch()) checker.finish();
  rep.messages = checker.matched();
  const std::int64_t dump_step = checker.mismatch() ? checker.mismatch_step() : last_step;
  if (checker.mismatch()) rep.mismatch = *checker.mismatch();
  if (!opt.dump_dir.empty())
    if (auto st = write_dump(opt.dump_dir, dump_step, checker.tensors_of(dump_step), rep.dump_file); !st)
      return st.err();
  rep.matched = !checker.mismatch();
  return rep;
}

}  // namespace troupe::actors
