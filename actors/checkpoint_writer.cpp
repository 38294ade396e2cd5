// The checkpoint-writer actor: after a step, stages and optimizer shards send it copies of their
// state (so training goes on while it writes); once every piece of a step has arrived it assembles
// per-stage safetensors shards — parameters by Hugging Face name, AdamW moments by
// "<name>.exp_avg" / "<name>.exp_avg_sq", and the loss scaler's state when dynamic loss scaling is
// on (it comes with the coordinator's announcement) — and writes them with model::checkpoint::save
// (temporary directory, fsync, rename), then tells the coordinator. Under tensor parallel every
// rank sends its slices (the rank in the tag's micro-batch field, -1 - tp) and the writer joins
// them into the whole tensors (model::unshard_param): a checkpoint does not depend on the layout.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>

#include "actors/actors.hpp"
#include "model/checkpoint.hpp"
#include "model/lora.hpp"
#include "model/params.hpp"
#include "model/tensor_parallel.hpp"

namespace troupe::actors {
namespace {

struct pending {
  bool announced = false;                                    // the coordinator's ckpt message came
  std::vector<double> scaler;                                // loss-scaler state (empty: off)
  using key = std::tuple<int, int, int>;
  std::map<std::pair<int, int>, core::tensor> params;        // (chunk, tp) -> flat params
  std::map<key, core::tensor> exp_avg;                       // (chunk, part, tp) -> slice
  std::map<key, core::tensor> exp_avg_sq;
};

struct writer_state {
  std::map<std::int64_t, pending> steps;
  std::int64_t step = -1;  // of the last message, for failure reports
  std::optional<model::base_identity> base;  // the frozen base ([lora]), made once
};

/// Parts whose moments the writer gets: ZeRO-0 shards hold everything, only replica 0's is sent.
int moment_parts(const job_layout& l) { return l.zero_stage == 0 ? 1 : l.dp; }

bool complete(const job& j, const pending& p) {
  int chunks = j.layout.chunks();
  int parts = moment_parts(j.layout);
  const int tp = j.layout.tp;
  return p.announced && static_cast<int>(p.params.size()) == chunks * tp &&
         static_cast<int>(p.exp_avg.size()) == chunks * parts * tp &&
         static_cast<int>(p.exp_avg_sq.size()) == chunks * parts * tp;
}

/// Joins the shards' slices of one chunk's moment buffer (of tensor-parallel rank t) into a flat
/// buffer of `numel`.
core::tensor join(const job& j, const std::map<pending::key, core::tensor>& parts, int chunk,
                  int t, std::int64_t numel) {
  core::tensor flat = core::tensor::zeros({numel});
  for (int k = 0; k < moment_parts(j.layout); ++k) {
    auto [lo, hi] = j.layout.shard_range(numel, k);
    const core::tensor& s = parts.at({chunk, k, t});
    TROUPE_CHECK(s.numel() == hi - lo, "moment slice " + std::to_string(k) + " of chunk " +
                                           std::to_string(chunk) + " has the wrong size");
    if (hi > lo) std::memcpy(flat.data<float>() + lo, s.data<float>(), s.bytes());
  }
  return flat;
}

core::result<std::string> write(const job& j, const std::string& root, std::int64_t step,
                                 pending& p, const model::base_identity& base) {
  model::checkpoint::save_request req;
  req.base_source = base.source;
  req.base_xxh64 = base.xxh64;
  req.step = static_cast<int>(step) + 1;
  req.seed = j.cfg.train.seed;
  req.config_toml = core::to_toml(j.cfg);
  auto specs = model::partition(j.cfg);
  const int tp = j.layout.tp;
  for (int c = 0; c < j.layout.chunks(); ++c) {
    auto defs = model::define_params(j.cfg.model, specs[c], tp);
    std::vector<core::tensor> flat, m, v;  // per tensor-parallel rank
    for (int t = 0; t < tp; ++t) {
      const std::int64_t numel =
          model::flat_numel(tp == 1 ? defs : model::shard_defs(j.cfg.model, defs, tp, t));
      flat.push_back(p.params.at({c, t}));
      TROUPE_CHECK(flat.back().numel() == numel,
                   "parameter snapshot of chunk " + std::to_string(c) + " has " +
                       std::to_string(flat.back().numel()) + " elements, expected " +
                       std::to_string(numel));
      m.push_back(join(j, p.exp_avg, c, t, numel));
      v.push_back(join(j, p.exp_avg_sq, c, t, numel));
    }
    auto whole = [&](const std::vector<core::tensor>& of, std::size_t i) {
      return model::unshard_param(j.cfg.model, defs, i, tp,
                                  [&](int t) -> const core::tensor& { return of[t]; });
    };
    char file[64];
    std::snprintf(file, sizeof file, "model-chunk%03d.safetensors", c);
    model::checkpoint::shard_spec ms{file, "model", {}};
    std::snprintf(file, sizeof file, "optimizer-chunk%03d.safetensors", c);
    model::checkpoint::shard_spec os{file, "optimizer", {}};
    for (std::size_t i = 0; i < defs.size(); ++i) {
      const auto& info = defs[i].info;
      if (info.tied) continue;  // the head copy of a tied embedding is not stored
      ms.tensors.push_back({info.name, whole(flat, i)});
      os.tensors.push_back({info.name + ".exp_avg", whole(m, i)});
      os.tensors.push_back({info.name + ".exp_avg_sq", whole(v, i)});
    }
    req.shards.push_back(std::move(ms));
    req.shards.push_back(std::move(os));
  }
  if (!p.scaler.empty()) {
    core::tensor s = core::tensor::zeros({static_cast<std::int64_t>(p.scaler.size())}, core::dtype::f64);
    std::copy(p.scaler.begin(), p.scaler.end(), s.data<double>());
    req.shards.push_back({"optimizer-scaler.safetensors", "optimizer",
                          {{model::loss_scaler_tensor_name, s}}});
  }
  if (j.fault && j.fault->kind == core::fault_kind::enospc && j.fault->step == req.step) {
    // TROUPE_FAULT=enospc (test only): the disk fills up while the second file is written.
    req.full_at_shard = req.shards.size() > 1 ? 1 : 0;
    std::fprintf(stderr, "troupe: %s: the disk fills up halfway through %s of the checkpoint of step %d\n",
                 j.fault->label().c_str(), req.shards[req.full_at_shard].file.c_str(), req.step);
    std::fflush(stderr);
  }
  return model::checkpoint::save(root, req, j.cfg.checkpoint.keep);
}

/// Writes step's checkpoint once the coordinator announced it and every piece is in; tells the
/// coordinator.
void write_when_complete(caf::stateful_actor<writer_state>* self, const job& j,
                         const std::string& root, std::int64_t step) {
  auto& p = self->state.steps[step];
  if (!complete(j, p)) return;
  checkpoint_written done{step, "", ""};
  try {
    if (!self->state.base)
      self->state.base = j.cfg.model.lora.partial() ? model::identify_base(j.cfg) : model::base_identity{};
    auto r = write(j, root, step, p, *self->state.base);
    if (r.ok()) done.path = r.value();
    else done.error = r.err().to_string();
  } catch (const std::exception& e) {
    done.error = e.what();
  }
  self->state.steps.erase(step);
  self->send(j.coordinator, std::move(done));
}

caf::behavior writer_actor(caf::stateful_actor<writer_state>* self, std::shared_ptr<job> j,
                           std::string root) {
  report_exceptions(self, j, address{role::writer, 0, 0},
                    [self] { return std::pair{self->state.step, std::string()}; });
  return {
      [=](ckpt_atom, std::int64_t step, std::vector<double>& scaler) {
        self->state.step = step;
        auto& p = self->state.steps[step];
        p.announced = true;
        p.scaler = std::move(scaler);
        write_when_complete(self, *j, root, step);
      },
      [=](tensor_ready& m) {
        self->state.step = m.step;
        auto& p = self->state.steps[m.step];
        core::tensor t = receive(*j, 0, m);
        switch (static_cast<tensor_kind>(m.kind)) {
          case tensor_kind::snap_params: p.params[{m.chunk, -1 - m.mb}] = std::move(t); break;
          case tensor_kind::snap_exp_avg: p.exp_avg[{m.chunk, m.part, -1 - m.mb}] = std::move(t); break;
          case tensor_kind::snap_exp_avg_sq: p.exp_avg_sq[{m.chunk, m.part, -1 - m.mb}] = std::move(t); break;
          default: throw core::failure("checkpoint writer got an unexpected tensor " + m.tag().to_string());
        }
        write_when_complete(self, *j, root, m.step);
      },
  };
}

}  // namespace

caf::actor spawn_writer(caf::actor_system& sys, std::shared_ptr<job> j, std::string root) {
  return sys.spawn(writer_actor, std::move(j), std::move(root));
}

}  // namespace troupe::actors
