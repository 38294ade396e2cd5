// `troupe replay --rank R`: worker R alone. Its stage and optimizer shard run as plain engines in
// one loop, without CAF and without the other workers: every tensor another worker sent to R in
// the recorded run (tokens, targets, activations, gradients, tied-embedding gradients, other
// replicas' gradient slices, other shards' parameter slices, the tensor-parallel peers' slices in
// the group's collectives) comes from rank_<R>.tensors, the shard applies the clip scale and
// learning rate recorded in rank_<R>.log (they depend on every shard's gradient norm), and every
// tensor R sends (collective slices included) is compared with rank_<R>.log. A difference
// therefore lies in worker R's own computation, not upstream of it.
#include <chrono>
#include <thread>

#include "actors/tp_group.hpp"
#include "core/machine.hpp"
#include "runtime/build.hpp"
#include "replay/replay_parts.hpp"
#include "model/loader.hpp"
#include "kernels/select.hpp"
#include "model/tensor_parallel.hpp"

namespace troupe::actors {

namespace {

bool is_snapshot(std::uint32_t kind) {
  const auto k = static_cast<tensor_kind>(kind);
  return k == tensor_kind::snap_params || k == tensor_kind::snap_exp_avg ||
         k == tensor_kind::snap_exp_avg_sq;
}

/// The transport of a tensor-parallel rank replayed alone: what the peers sent it in the group's
/// collectives are the bytes recorded in rank_<R>.tensors (checked against the senders' hashes
/// before), and every slice it sends goes to `check` (compared with rank_<R>.log) and is then
/// dropped. A difference throws, which stops the stage inside the collective.
class recorded_group_endpoint final : public ::troupe::transport::transport {
 public:
  using checker_fn = std::function<bool(int dst, const ::troupe::transport::tag&, const core::tensor&)>;
  recorded_group_endpoint(int me, std::map<message_key, core::tensor> inbox, kernels::backend& be,
                          std::string file, checker_fn check)
      : me_(me), inbox_(std::move(inbox)), be_(be), file_(std::move(file)), check_(std::move(check)) {}

  std::string name() const override { return "recorded"; }
  int rank() const override { return me_; }
  void send(int dst, core::tensor t, const ::troupe::transport::tag& tg) override {
    if (!check_(dst, tg, t))
      throw core::failure("a tensor-parallel collective's slice differs from the recording");
  }
  core::tensor recv(int src, const ::troupe::transport::tag& tg, std::chrono::milliseconds) override {
    auto it = inbox_.find(message_key{src, me_, tg});
    if (it == inbox_.end())
      throw core::failure(file_ + " holds no " + kind_name(tg.kind) + " (part " +
                          std::to_string(tg.part) + ") of step " + std::to_string(tg.step) +
                          ", layer " + std::to_string(tg.chunk) + ", micro-batch " +
                          std::to_string(tg.mb) + " from rank " + std::to_string(src) +
                          ", which the replayed rank needs in a tensor-parallel collective; was "
                          "the run recorded with runtime.record_tensors = true?");
    core::tensor v = std::move(it->second);
    inbox_.erase(it);
    if (be_.dev().is_cpu()) return v;
    core::tensor on = be_.from_host(v);
    be_.record_ready(on);
    return on;
  }
  bool ready(int src, const ::troupe::transport::tag& tg) override {
    return inbox_.count(message_key{src, me_, tg}) > 0;
  }

 private:
  int me_;
  std::map<message_key, core::tensor> inbox_;
  kernels::backend& be_;
  std::string file_;
  checker_fn check_;
};

}  // namespace

core::result<replay_report> replay_one_rank(const recorded_run& run, const replay_options& opt,
                                            int last_step) {
  const core::config& cfg = run.cfg;  // the engines keep references: `run` outlives them
  auto sched = build_schedule(cfg, layout_of(cfg).microbatches);
  if (!sched) return sched.err();
  const job_layout l = layout_of(cfg, sched.value());
  const int me = opt.rank, d = l.dp_of(me), p = l.pp_of(me), t = l.tp_of(me);
  const int first = run.segments.front().first_step;
  const std::string mdir = messages_dir(run.dir);

  // What the neighbours sent: checked against the hashes their own logs hold before use.
  auto stored = read_tensors(mdir, me);
  if (!stored) return stored.err();
  std::map<std::int64_t, std::vector<stored_tensor>> inbox;  // step -> tensors
  std::map<message_key, core::tensor> collective_inbox;      // the group's, by (src, dst, tag)
  for (auto& s : stored.value()) {
    if (s.dst != me || s.src == me) continue;
    auto it = run.records.find(message_key{s.src, s.dst, s.tag});
    // A collective's tag holds the layer in `chunk` (actors/tp_group.hpp).
    const std::string what = kind_name(s.tag.kind) +
                             (is_tp_kind(s.tag.kind) ? " collective slice (part " +
                                                           std::to_string(s.tag.part) + ") of layer "
                                                     : std::string(" of chunk ")) +
                             std::to_string(s.tag.chunk) +
                             ", micro-batch " + std::to_string(s.tag.mb) + ", step " +
                             std::to_string(s.tag.step) + " from rank " + std::to_string(s.src);
    if (it == run.records.end())
      return core::error::at_file(mdir + "/rank_" + std::to_string(me) + ".tensors",
                                  "holds the " + what + ", which rank " + std::to_string(s.src) +
                                      "'s log does not record",
                                  "the files are from different runs; record the run again");
    if (tensor_hash(s.value, it->second.hash_def) != it->second.hash)
      return core::error::at_file(mdir + "/rank_" + std::to_string(me) + ".tensors",
                                  "the stored bytes of the " + what +
                                      " do not match the hash in " + it->second.file + " line " +
                                      std::to_string(it->second.line),
                                  "the file is damaged; record the run again");
    if (is_tp_kind(s.tag.kind))
      collective_inbox[message_key{s.src, s.dst, s.tag}] = std::move(s.value);
    else
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
  // In scope: what worker R itself sent, snapshots excepted (they come after the step, from the
  // actors, which this replay does not run).
  message_checker checker(run, first, last_step + 1, !opt.dump_dir.empty(),
                          [me](const message_record& r) { return r.src == me && !is_snapshot(r.tag.kind); });
  const address stage_addr{role::stage, d, p, t}, shard_addr{role::shard, p, d, t};

  // Tensor parallel: the group's collectives run over recorded_group_endpoint, which takes the
  // peers' slices from rank_<R>.tensors and checks R's own against rank_<R>.log.
  std::unique_ptr<recorded_group_endpoint> group_ep;
  std::unique_ptr<tp_group> group;
  model::chunk_tp tp;
  if (l.tp > 1) {
    std::vector<int> ranks;
    for (int r = 0; r < l.tp; ++r) ranks.push_back(l.worker(d, p, r));
    group_ep = std::make_unique<recorded_group_endpoint>(
        me, std::move(collective_inbox), *be, mdir + "/rank_" + std::to_string(me) + ".tensors",
        [&](int dst, const transport::tag& tg, const core::tensor& x) {
          const core::tensor host = host_view(x, be.get());
          address to = stage_addr;
          to.c = l.tp_of(dst);
          message_record r = record_of(stage_addr, me, to, dst, tg, host, nullptr);
          r.op = group->collective();
          return checker.check(r, host);
        });
    group = std::make_unique<tp_group>(*group_ep, ranks, *be, cfg.parallel.sequence_parallel,
                                       model::kv_replicas(cfg.model, l.tp),
                                       std::chrono::milliseconds(0));
    tp = model::chunk_tp{l.tp, t, group.get()};
  }
  auto chunks = build_stage_chunks(cfg, l, p, *be, ck ? &*ck : nullptr, tp);
  if (!chunks) return chunks.err();
  stage_engine stage(cfg, l, d, p, sched->ranks.at(p), *be, std::move(chunks.value()),
                     stage_engine::clock::now());
  stage.set_tp(t, group.get());
  stage.set_data(data);
  auto host_be = make_host_backend(cfg);
  auto shard_or = build_shard(cfg, l, p, d, *be, stage.chunks(), ck ? &*ck : nullptr, host_be.get(), t);
  if (!shard_or) return shard_or.err();
  shard_engine& shard = *shard_or.value();

  replay_report rep;
  rep.first_step = first;
  rep.last_step = last_step;

  // Sends of worker R: compared, then handed on when they stay on R; the rest were the
  // neighbours' business and are dropped.
  auto deliver_local = [&](const address& to, const transport::tag& tg, core::tensor x) {
    if (to.who == role::shard) shard.deliver(d, tg, std::move(x));
    else stage.deliver(tg, std::move(x));
  };
  auto send = [&](const address& from, const address& to, const transport::tag& tg,
                  core::tensor x, const sample_key* sample) {
    const int dst = worker_of(l, to);
    core::tensor host = host_view(x, be.get());
    if (!checker.check(record_of(from, me, to, dst, tg, host, sample), host)) return false;
    if (dst == me) deliver_local(to, tg, std::move(x));
    return true;
  };

  try {
    for (int s = first; s <= last_step; ++s) {
      if (opt.log) std::fprintf(opt.log, "replay --rank %d: step %d\n", me, s);
      if (data && p == 0 && t == 0) {
        const auto& o = data->options();
        const int last_chunk = l.chunks() - 1;
        for (int mb = 0; mb < l.microbatches; ++mb) {
          model::batch b = data->cut(static_cast<std::uint64_t>(s), d, mb);
          const sample_key key{o.seed, s, static_cast<std::int64_t>(d * l.microbatches + mb) * o.micro_batch_size,
                               o.micro_batch_size};
          const address loader{role::loader, d, 0};
          // Every tensor-parallel rank of the first and last stage reads all the tokens / targets.
          bool sent = true;
          for (int r = 0; r < l.tp && sent; ++r)
            sent = send(loader, address{role::stage, d, 0, r},
                        transport::tag{s, static_cast<std::uint32_t>(tensor_kind::tokens), 0, mb, 0},
                        b.tokens, &key) &&
                   send(loader, address{role::stage, d, l.rank_of_chunk(last_chunk), r},
                        transport::tag{s, static_cast<std::uint32_t>(tensor_kind::targets), last_chunk, mb, 0},
                        b.targets, &key);
          if (!sent) break;
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
      for (auto& in : inbox[s]) {
        if (is_snapshot(in.tag.kind)) continue;
        // A gradient slice is for the shard, from the stage of replica dp_of(src).
        if (static_cast<tensor_kind>(in.tag.kind) == tensor_kind::grad_slice)
          shard.deliver(l.dp_of(in.src), in.tag, std::move(in.value));
        else
          stage.deliver(in.tag, std::move(in.value));
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
    // A collective's slice that differs stops the stage inside the collective: a difference,
    // reported as the others are.
    if (!checker.mismatch())
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
