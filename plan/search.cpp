// The layout search of `troupe plan --search`: every data_parallel × model_parallel ×
// pipeline_stage split of the devices (model_parallel 1, 2, 4 or 8, with sequence parallel off
// and on), micro-batch size (and so count, at the config's global batch), schedule, virtual
// stages, recompute mode, ZeRO stage and (where it does not fit without) optimizer offload; each
// candidate is planned (dry run + simulator) and the fastest that fit are kept.
//
// A model_parallel (and sequence_parallel) the config check refuses for this model and precision
// (core/config.cpp: heads, key/value heads and widths it does not split, compute below fp32, ...)
// is refused here with the check's own message, for every layout that would have used it.
//
// zb_v runs two chunks per rank in a V (rank r holds chunks r and 2p-1-r): it is tried wherever
// every rank can hold L / p layers split over its two chunks (L divisible by p, at least 2 layers
// per rank). Its split gives rank r its L / p layers as ceil((L/p) / 2) in chunk r (on the way
// down) and floor((L/p) / 2) in chunk 2p-1-r (on the way back), so the last chunk, which also
// runs the head, is the smaller one; L divisible by 2p is the even split.
#include <algorithm>
#include <map>
#include <sstream>

#include "model/chunk.hpp"
#include "model/params.hpp"
#include "plan/plan.hpp"
#include "schedules/schedule.hpp"

namespace troupe::plan {

namespace {

/// A lower bound of one worker's bytes without a dry run: its chunks' fp32 parameters and
/// gradients, low-precision copy, frozen weights ([lora]), and its shard's optimizer state.
std::uint64_t static_bound(const core::config& c) {
  const int pp = c.parallel.pipeline_stage, v = c.parallel.virtual_pipeline;
  const int tp = c.parallel.model_parallel;
  const auto specs = model::partition(c);
  // The search builds named schedules only: zb_v's chunks sit in a V, the others' interleaved.
  const auto place = c.schedule.name == "zb_v" ? schedules::placement::v : schedules::placement::interleaved;
  std::uint64_t worst = 0;
  const std::uint64_t low = c.precision.compute == core::precision_kind::fp32 ? 0 : 2;
  for (int p = 0; p < pp; ++p) {
    std::uint64_t n = 0, frozen = 0;  // trainable and frozen ([lora]) elements
    for (int i = 0; i < v; ++i) {
      const auto& spec = specs[static_cast<std::size_t>(schedules::chunk_at(place, pp, p, i))];
      n += model::flat_numel(model::define_params(c.model, spec));
      frozen += model::flat_numel(model::define_frozen_params(c.model, spec));
    }
    // A tensor-parallel rank holds at least its 1/tp of them (the replicated norms on top).
    n /= static_cast<std::uint64_t>(tp);
    frozen /= static_cast<std::uint64_t>(tp);
    const std::uint64_t shard = c.optimizer.zero_stage == 0 ? n : n / c.parallel.data_parallel;
    // Per owned element: master weights, moments and the summed-gradient slice; under offload
    // only that slice stays on the device. With one replica the shard uses its stage's gradient
    // and parameter buffers (shard_engine::adopts_gradients / adopts_params), counted above.
    const bool one = c.parallel.data_parallel == 1;
    const std::uint64_t per = c.optimizer.offload ? (one ? 0 : 4) : (one ? 8 : 16);
    worst = std::max(worst, n * (8 + low) + frozen * (4 + low) + shard * per);
  }
  return worst;
}

/// zb_v's chunk layers for `layers` on `pp` ranks (see the top of this file); empty = even.
std::vector<int> v_split(int layers, int pp) {
  if (layers % (2 * pp) == 0) return {};
  const int share = layers / pp;
  std::vector<int> out(static_cast<std::size_t>(2 * pp));
  for (int r = 0; r < pp; ++r) {
    out[static_cast<std::size_t>(r)] = share - share / 2;
    out[static_cast<std::size_t>(2 * pp - 1 - r)] = share / 2;
  }
  return out;
}

/// Whether the config check allows model_parallel `tp` (sequence parallel `sp`) for `base`'s
/// model and precision: "" or the reason, the check's own words with the key.
std::string tp_refused(const core::config& base, int tp, bool sp) {
  core::config c = base;
  c.parallel.model_parallel = tp;
  c.parallel.sequence_parallel = sp;
  auto checked = core::parse_config(core::to_toml(c), base.source.empty() ? "search" : base.source);
  if (checked.ok()) return "";
  const core::error& e = checked.err();
  return "model_parallel " + std::to_string(tp) + (sp ? " with sequence parallel" : "") +
         " refused by the config check (" + (e.where.key.empty() ? "" : e.where.key + ": ") +
         e.message + ")";
}

}  // namespace

core::result<search_result> search(const core::config& base, const search_options& o) {
  search_result r;
  std::map<std::string, int> why;
  const std::int64_t global = core::derive(base).global_batch;
  std::vector<job_plan> fit;
  struct sched_choice {
    std::string name;
    int v;
  };
  struct tp_choice {
    int tp;
    bool sp;
  };
  std::vector<tp_choice> tps;
  for (int tp : {1, 2, 4, 8})
    if (o.gpus % tp == 0)
      for (bool sp : {false, true})
        if (tp > 1 || !sp) tps.push_back({tp, sp});
  for (const tp_choice& t : tps) {
    const std::string refused = t.tp == 1 ? "" : tp_refused(base, t.tp, t.sp);
    const int devices = o.gpus / t.tp;  // per tensor-parallel rank: dp × pp of them
    for (int pp = 1; pp <= devices; ++pp) {
      if (devices % pp != 0) continue;
      const int dp = devices / pp;
      if (base.model.num_layers % pp != 0) {
        why["pipeline stages do not divide the layers"] += 1;
        continue;
      }
      if (global % dp != 0) {
        why["data_parallel does not divide the global batch"] += 1;
        continue;
      }
      const std::int64_t per_replica = global / dp;
      std::vector<sched_choice> scheds{{"1f1b", 1}};
      if (pp > 1) {
        scheds.push_back({"zb_h1", 1});
        scheds.push_back({"interleaved_1f1b", 2});
        scheds.push_back({"zb_v", 2});
      }
      for (int mbs : o.micro_batch_sizes) {
        if (per_replica % mbs != 0) continue;
        const int m = static_cast<int>(per_replica / mbs);
        for (const auto& s : scheds) {
          const bool zb_v = s.name == "zb_v";
          const int skipped = 3 * (dp > 1 ? 3 : 1);  // the recompute × ZeRO candidates
          if (zb_v && base.model.num_layers < 2 * pp) {
            why["zb_v: fewer than 2 layers per rank (each of a rank's two chunks needs one)"] += skipped;
            r.considered += skipped;
            continue;
          }
          if (!zb_v && base.model.num_layers % (pp * s.v) != 0) {
            why["virtual stages do not divide the layers"] += skipped;
            r.considered += skipped;
            continue;
          }
          for (auto rc : {core::recompute_mode::none, core::recompute_mode::selective,
                          core::recompute_mode::full}) {
            for (int z = 0; z <= (dp > 1 ? 2 : 0); ++z) {
              ++r.considered;
              if (!refused.empty()) {
                why[refused] += 1;
                continue;
              }
              core::config c = base;
              c.parallel.data_parallel = dp;
              c.parallel.model_parallel = t.tp;
              c.parallel.sequence_parallel = t.sp;
              c.parallel.pipeline_stage = pp;
              c.parallel.virtual_pipeline = s.v;
              c.parallel.micro_batch_size = mbs;
              c.parallel.micro_batch_num = m;
              c.train.gradient_accumulation_steps = 1;
              c.schedule.name = s.name;
              c.schedule.file.clear();
              c.recompute.mode = rc;
              // The config's uneven split names its own chunk count; other layouts split evenly.
              // zb_v keeps the config's split only when the config is zb_v's at this pp (the same
              // list under the other placement gives the ranks other sums): else v_split's.
              const bool own = pp == base.parallel.pipeline_stage && s.v == base.parallel.virtual_pipeline &&
                               (!zb_v || base.schedule.name == "zb_v");
              if (!own) {
                c.parallel.stage_layers = zb_v ? v_split(base.model.num_layers, pp) : std::vector<int>{};
                c.parallel.first_stage_layers = c.parallel.last_stage_layers = 0;
              }
              c.optimizer.zero_stage = z;
              c.runtime.device = "cuda";
              plan_options po;
              po.device_memory = o.device_memory;
              po.one_device = false;
              po.cal = o.cal;
              po.suggest = false;
              po.dry_run_steps = 1;
              po.dry_run_microbatches = std::max(8, 4 * pp * s.v);
              // Offload only saves device memory and costs time: it is tried where the layout
              // without it does not fit.
              for (bool offload : {false, true}) {
                if (offload) ++r.considered;
                c.optimizer.offload = offload;
                if (o.device_memory && static_bound(c) > o.device_memory) {
                  why[offload ? "parameters and gradients alone do not fit, even with offload"
                              : "parameters, gradients and optimizer state alone do not fit"] += 1;
                  continue;
                }
                auto p = make_plan(c, po);
                if (!p.ok()) {
                  why["schedule does not apply (" + s.name + ": " + p.err().message + ")"] += 1;
                  break;
                }
                if (!p.value().fits) {
                  why["does not fit (largest term: " + p.value().largest_term + ")" +
                      (offload ? " with offload" : "")] += 1;
                  continue;
                }
                fit.push_back(std::move(p.value()));
                break;
              }
            }
          }
        }
      }
    }
  }
  std::sort(fit.begin(), fit.end(), [](const job_plan& a, const job_plan& b) {
    if (a.tokens_per_s != b.tokens_per_s) return a.tokens_per_s > b.tokens_per_s;
    return a.need < b.need;
  });
  const int fitting = static_cast<int>(fit.size());
  if (fitting > o.top) {
    why["fits, but slower than the " + std::to_string(o.top) + " shown"] += fitting - o.top;
    fit.resize(o.top);
  }
  r.best = std::move(fit);
  for (auto& [k, n] : why)
    if (n > 0) r.rejected.emplace_back(k, n);
  return r;
}

std::string render_search(const search_result& r, const search_options& o) {
  std::ostringstream s;
  s << "search: " << o.gpus << " device(s) of " << format_bytes(o.device_memory) << ", "
    << r.considered << " layouts considered (model_parallel 1, 2, 4, 8 where it divides the "
    << "devices, sequence parallel off and on; offload: tried where a layout does not fit "
    << "without it)\n";
  int i = 0;
  char line[512];
  for (const auto& p : r.best) {
    std::snprintf(line, sizeof line, "%d. %-90s %10.4g tokens/s  step %.4g s  %s per device (%s)\n",
                  ++i, p.name.c_str(), p.tokens_per_s, p.step_s, format_bytes(p.need).c_str(),
                  p.largest_term.c_str());
    s << line;
  }
  if (r.best.empty()) s << "no layout fits\n";
  s << "rejected:\n";
  for (const auto& [why, n] : r.rejected) s << "  " << n << " × " << why << "\n";
  return s.str();
}

}  // namespace troupe::plan
