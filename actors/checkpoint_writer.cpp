// The checkpoint-writer actor: after a step, stages and optimizer shards send it copies of their
// state (so training goes on while it writes); once every piece of a step has arrived it assembles
// per-stage safetensors shards — parameters by Hugging Face name, AdamW moments by
// "<name>.exp_avg" / "<name>.exp_avg_sq", and the loss scaler's state when dynamic loss scaling is
// on (it comes with the coordinator's announcement) — and writes them with model::checkpoint::save
// (temporary directory, fsync, rename), then tells the coordinator.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>

#include "actors/actors.hpp"
#include "model/checkpoint.hpp"
#include "model/lora.hpp"
#include "model/params.hpp"

namespace troupe::actors {
namespace {

struct pending {
  bool announced = false;                                    // the coordinator's ckpt message came
  std::vector<double> scaler;                                // loss-scaler state (empty: off)
  std::map<int, core::tensor> params;                        // chunk -> flat params
  std::map<std::pair<int, int>, core::tensor> exp_avg;       // (chunk, part) -> slice
  std::map<std::pair<int, int>, core::tensor> exp_avg_sq;
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
  return p.announced && static_cast<int>(p.params.size()) == chunks &&
         static_cast<int>(p.exp_avg.size()) == chunks * parts &&
         static_cast<int>(p.exp_avg_sq.size()) == chunks * parts;
}

/// Joins the shards' slices of one chunk's moment buffer into a flat buffer of `numel`.
core::tensor join(const job& j, const std::map<std::pair<int, int>, core::tensor>& parts, int chunk,
                  std::int64_t numel) {
  core::tensor flat = core::tensor::zeros({numel});
  for (int k = 0; k < moment_parts(j.layout); ++k) {
    auto [lo, hi] = j.layout.shard_range(numel, k);
    const core::tensor& s = parts.at({chunk, k});
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
  for (int c = 0; c < j.layout.chunks(); ++c) {
    auto defs = model::define_params(j.cfg.model, specs[c]);
    std::int64_t numel = model::flat_numel(defs);
    core::tensor flat = p.params.at(c);
    TROUPE_CHECK(flat.numel() == numel, "parameter snapshot of chunk " + std::to_string(c) +
                                            " has " + std::to_string(flat.numel()) +
                                            " elements, expected " + std::to_string(numel));
    core::tensor m = join(j, p.exp_avg, c, numel), v = join(j, p.exp_avg_sq, c, numel);
    char file[64];
    std::snprintf(file, sizeof file, "model-chunk%03d.safetensors", c);
    model::checkpoint::shard_spec ms{file, "model", {}};
    std::snprintf(file, sizeof file, "optimizer-chunk%03d.safetensors", c);
    model::checkpoint::shard_spec os{file, "optimizer", {}};
    for (const auto& d : defs) {
      const auto& info = d.info;
      if (info.tied) continue;  // the head copy of a tied embedding is not stored
      ms.tensors.push_back({info.name, flat.slice(info.offset, info.shape)});
      os.tensors.push_back({info.name + ".exp_avg", m.slice(info.offset, info.shape)});
      os.tensors.push_back({info.name + ".exp_avg_sq", v.slice(info.offset, info.shape)});
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
          case tensor_kind::snap_params: p.params[m.chunk] = std::move(t); break;
          case tensor_kind::snap_exp_avg: p.exp_avg[{m.chunk, m.part}] = std::move(t); break;
          case tensor_kind::snap_exp_avg_sq: p.exp_avg_sq[{m.chunk, m.part}] = std::move(t); break;
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
