#include "runtime/build.hpp"

#include "model/hf.hpp"
#include "kernels/select.hpp"
#include "model/params.hpp"
#include "model/tensor_parallel.hpp"
#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/validate.hpp"

namespace troupe::actors {

job_layout layout_of(const core::config& cfg) {
  job_layout layout;
  layout.dp = cfg.parallel.data_parallel;
  layout.pp = cfg.parallel.pipeline_stage;
  layout.tp = cfg.parallel.model_parallel;
  layout.v = cfg.parallel.virtual_pipeline;
  layout.zero_stage = cfg.optimizer.zero_stage;
  layout.microbatches = cfg.parallel.micro_batch_num * cfg.train.gradient_accumulation_steps;
  return layout;
}

job_layout layout_of(const core::config& cfg, const schedules::schedule& s) {
  job_layout layout = layout_of(cfg);
  layout.place = s.place;
  return layout;
}

core::result<schedules::schedule> build_schedule(const core::config& cfg, int microbatches) {
  schedules::schedule_options o;
  o.virtual_stages = cfg.parallel.virtual_pipeline;
  const std::string& which = cfg.schedule.file.empty() ? cfg.schedule.name : cfg.schedule.file;
  auto s = schedules::make_schedule(which, cfg.parallel.pipeline_stage, microbatches, o);
  if (!s.ok()) {
    core::error e = s.err();
    if (e.where.key.empty()) e.where.key = cfg.schedule.file.empty() ? "schedule.name" : "schedule.file";
    if (e.where.file.empty()) e.where.file = cfg.source;
    return e;
  }
  schedules::schedule lowered = schedules::lower(s.value());
  if (auto st = schedules::validate(lowered); !st.ok()) return st.err();
  return lowered;
}

core::result<std::vector<model::chunk>> build_stage_chunks(const core::config& cfg,
                                                           const job_layout& l, int pp,
                                                           kernels::backend& be,
                                                           const model::checkpoint::reader* ck,
                                                           const model::chunk_tp& tp) {
  auto specs = model::partition(cfg);
  // A fresh run with model.init starts from those weights; each chunk loads only its own tensors.
  std::shared_ptr<const model::hf::weights> init;
  if (!ck && !cfg.model.init.empty()) {
    auto w = model::hf::weights::open(cfg.model.init, cfg.model, cfg.source);
    if (!w.ok()) return w.err();
    init = w.value();
  }
  std::vector<model::chunk> chunks;
  for (int i = 0; i < l.v; ++i) {
    model::chunk c(cfg.model, specs[l.chunk_of(pp, i)], be, cfg.precision.compute, tp);
    c.init(cfg.train.seed);
    c.set_recompute(cfg.recompute.mode, core::recompute_layers(cfg),
                    core::keep_gelu_layers(cfg));
    if (ck) {
      if (auto st = model::hf::load_frozen_base(cfg, be, c); !st) return st.err();
      auto st = model::checkpoint::restore(*ck, be, cfg.model, c, nullptr);
      if (!st.ok()) return st.err();
    } else if (init) {
      auto st = model::hf::load_chunk(*init, be, cfg.model, c);
      if (!st.ok()) return st.err();
    }
    chunks.push_back(std::move(c));
  }
  return chunks;
}

core::result<std::unique_ptr<shard_engine>> build_shard(const core::config& cfg,
                                                        const job_layout& l, int pp, int part,
                                                        kernels::backend& be,
                                                        std::vector<model::chunk>& owner,
                                                        const model::checkpoint::reader* ck,
                                                        kernels::backend* host, int tp) {
  std::vector<shard_chunk> sc;
  for (int i = 0; i < l.v; ++i) {
    auto& c = owner[i];
    sc.push_back(shard_chunk{l.chunk_of(pp, i), c.params(), c.flat_params(), c.flat_low()});
  }
  auto e = std::make_unique<shard_engine>(cfg, l, pp, part, be, std::move(sc), host);
  e->set_tp(tp);
  if (!ck) return e;
  for (auto& slot : e->slots()) {
    for (auto [suffix, dst] : {std::pair<const char*, core::tensor*>{".exp_avg", &slot.exp_avg},
                               {".exp_avg_sq", &slot.exp_avg_sq}}) {
      std::string name = slot.info.name + suffix;
      if (slot.info.tied) name = model::embedding_name(cfg.model) + suffix;
      auto t = ck->load(name);
      if (!t.ok()) return t.err();
      // Tensor parallel: this rank's slice of the whole moment (a checkpoint holds whole ones).
      if (l.tp > 1) t = model::shard_tensor(cfg.model, slot.info.name, t.value(), l.tp, tp);
      // slot.info.offset is where the slice starts in the chunk buffer; the moment tensor in
      // the checkpoint starts where the whole parameter does.
      std::int64_t start = -1;
      for (auto& c : e->chunks())
        for (auto& pi : c.params)
          if (pi.name == slot.info.name) start = pi.offset;
      TROUPE_CHECK(start >= 0, "no parameter named " + slot.info.name);
      be.copy(t.value().reshape({t.value().numel()}).slice(slot.info.offset - start, {slot.info.numel}), *dst);
    }
  }
  return e;
}

std::unique_ptr<kernels::backend> make_host_backend(const core::config& cfg) {
  if (!cfg.optimizer.offload) return nullptr;
  return kernels::make_backend("cpu");
}

}  // namespace troupe::actors
