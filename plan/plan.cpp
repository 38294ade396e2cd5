#include "plan/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/build.hpp"
#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"

namespace troupe::plan {

namespace {

constexpr std::uint64_t mib = std::uint64_t{1} << 20;
constexpr std::uint64_t gib = std::uint64_t{1} << 30;
// What the CUDA backend allocates for itself on every backend (cuBLASLt's workspace,
// kernels/cuda/cuda_context.cpp), inside the allocator's count.
constexpr std::uint64_t cuda_workspace = 32 * mib;
// Outside the allocator: the CUDA context of a process (kernels, cuBLAS handles).
constexpr std::uint64_t cuda_context = 512 * mib;
// The caching allocator's slack: blocks cached but not in use at the peak, as a share of it.
constexpr double cuda_slack = 0.05;

const char* recompute_name(core::recompute_mode m) {
  return m == core::recompute_mode::none ? "none" : m == core::recompute_mode::full ? "full" : "selective";
}
const char* precision_name(core::precision_kind p) {
  return p == core::precision_kind::fp32 ? "fp32" : p == core::precision_kind::bf16 ? "bf16" : "fp16";
}
bool on_cuda(const core::config& cfg) { return cfg.runtime.device.rfind("cuda", 0) == 0; }

void add_term(std::vector<memory_term>& terms, const std::string& name, std::uint64_t bytes) {
  if (bytes == 0) return;
  for (auto& t : terms)
    if (t.name == name) {
      t.bytes += bytes;
      return;
    }
  terms.push_back({name, bytes});
}

std::string describe(const job_plan& p) {
  std::ostringstream s;
  s << "dp " << p.dp;
  if (p.tp > 1) s << " × tp " << p.tp << (p.sequence_parallel ? " (sequence parallel)" : "");
  s << " × pp " << p.pp;
  if (p.v > 1) s << " (virtual " << p.v << ")";
  const auto& cl = p.chunk_layers;
  if (std::any_of(cl.begin(), cl.end(), [&](int n) { return n != cl.front(); })) {
    s << ", layers [";
    for (std::size_t i = 0; i < cl.size(); ++i) s << (i ? ", " : "") << cl[i];
    s << "]";
  }
  s << ", " << p.schedule << ", " << p.microbatches << " micro-batches of " << p.micro_batch_size
    << ", recompute " << p.recompute << ", ZeRO-" << p.zero_stage << ", " << p.precision;
  if (p.offload) s << ", offload";
  return s.str();
}

}  // namespace

std::string rank_name(const job_plan& p, const rank_plan& r) {
  std::string s = "dp" + std::to_string(r.dp);
  if (p.tp > 1) s += "/tp" + std::to_string(r.tp);
  return s + "/pp" + std::to_string(r.pp);
}

std::string format_bytes(std::uint64_t b) {
  char buf[64];
  if (b >= gib) std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / gib);
  else if (b >= mib) std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / mib);
  else std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024);
  return buf;
}

core::result<std::uint64_t> parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (...) {
    used = 0;
  }
  std::string unit = text.substr(used);
  std::transform(unit.begin(), unit.end(), unit.begin(), ::tolower);
  const std::map<std::string, double> units{{"", 1},        {"b", 1},        {"kb", 1e3},
                                            {"mb", 1e6},    {"gb", 1e9},     {"tb", 1e12},
                                            {"kib", 1024.0}, {"mib", 1048576.0},
                                            {"gib", 1073741824.0}, {"tib", 1099511627776.0},
                                            {"k", 1024.0},  {"m", 1048576.0}, {"g", 1073741824.0}};
  auto it = units.find(unit);
  if (used == 0 || it == units.end() || !(v > 0) || !std::isfinite(v))
    return core::error::make("'" + text + "' is not a memory size",
                             "write a number with a unit, e.g. 80GiB, 141GB or 512MiB");
  return static_cast<std::uint64_t>(v * it->second);
}

core::result<job_plan> make_plan(const core::config& cfg, const plan_options& o) {
  const bool cuda = on_cuda(cfg);
  auto sched = actors::build_schedule(cfg, actors::layout_of(cfg).microbatches);
  if (!sched.ok()) return sched.err();
  const actors::job_layout l = actors::layout_of(cfg, sched.value());
  const std::vector<int> in_flight = schedules::peak_activations(sched.value());
  core::config dry_cfg = cfg;
  if (o.dry_run_microbatches > 0 && o.dry_run_microbatches < l.microbatches) {
    core::config fewer = cfg;
    fewer.parallel.micro_batch_num = o.dry_run_microbatches;
    fewer.train.gradient_accumulation_steps = 1;
    auto s = actors::build_schedule(fewer, o.dry_run_microbatches);
    if (s.ok() && schedules::peak_activations(s.value()) == in_flight) dry_cfg = fewer;
  }
  auto dry = dry_run(dry_cfg, cuda ? device_model::cuda : device_model::cpu, o.dry_run_steps);
  if (!dry.ok()) return dry.err();
  const dry_run_result& d = dry.value();

  job_plan p;
  p.device = cuda ? "cuda" : "cpu";
  p.dp = l.dp, p.tp = l.tp, p.pp = l.pp, p.v = l.v, p.microbatches = l.microbatches;
  p.sequence_parallel = cfg.parallel.sequence_parallel;
  p.micro_batch_size = cfg.parallel.micro_batch_size;
  p.zero_stage = l.zero_stage;
  p.schedule = sched.value().name;
  p.recompute = recompute_name(cfg.recompute.mode);
  if (cfg.recompute.mode != core::recompute_mode::none && cfg.recompute.layers > 0)
    p.recompute += " (the first " + std::to_string(cfg.recompute.layers) + " of each chunk's layers)";
  if (cfg.recompute.mode != core::recompute_mode::none && !cfg.recompute.layer_list.empty()) {
    p.recompute += " (layers";
    for (std::size_t i = 0; i < cfg.recompute.layer_list.size(); ++i)
      p.recompute += (i ? ", " : " ") + std::to_string(cfg.recompute.layer_list[i]);
    p.recompute += ")";
  }
  p.chunk_layers = core::chunk_layers(cfg);
  p.precision = precision_name(cfg.precision.compute);
  p.one_device = o.one_device;
  p.device_memory = o.device_memory;
  p.offload = cfg.optimizer.offload;
  p.name = describe(p);
  p.calibration = o.cal.source;

  for (int dp = 0; dp < l.dp; ++dp)
    for (int tp = 0; tp < l.tp; ++tp)
      for (int pp = 0; pp < l.pp; ++pp) {
        rank_plan r;
        r.dp = dp, r.tp = tp, r.pp = pp;
        const backend_peak& st = d.stages.at({dp, pp, tp});
        const backend_peak& sh = d.shards.at({pp, dp, tp});
        r.stage_peak = st.peak + (cuda ? cuda_workspace : 0);
        r.shard_peak = sh.peak + (cuda ? cuda_workspace : 0);
        for (const auto& [label, bytes] : st.split) {
          if (label == "parameters and gradients") {
            add_term(r.terms, "fp32 parameters", d.params[pp]);
            add_term(r.terms, "fp32 gradients", d.grads[pp]);
            add_term(r.terms, "low-precision weights", d.low[pp]);
            add_term(r.terms, "frozen base weights", d.frozen[pp]);
          } else if (label == "logits") {
            add_term(r.terms, "logits and cross-entropy", bytes);
          } else if (label == "communication") {
            add_term(r.terms, "communication buffers", bytes);
          } else {
            add_term(r.terms, "activations and scratch", bytes);
          }
        }
        if (cfg.optimizer.offload) r.host_bytes = d.shard_host.at({pp, dp, tp});
        for (const auto& [label, bytes] : sh.split) {
          if (label == "optimizer state" && cfg.optimizer.offload) {
            // master slice and moments are host memory (r.host_bytes): the summed-gradient slice
            // is what stays on the device
            add_term(r.terms, "reduced gradient slice", bytes);
          } else if (label == "optimizer state") {
            // Two moments, plus equal fp32 buffers for the master slice and the summed-gradient
            // slice, except with one replica, where the shard updates the stage's own parameters
            // and reads its gradient where it is (but ZeRO-1 returns a summed copy).
            const bool master = l.dp > 1, summed = l.dp > 1 || l.zero_stage == 1;
            const std::uint64_t one = bytes / (2 + (master ? 1 : 0) + (summed ? 1 : 0));
            if (master) add_term(r.terms, "fp32 master weights", one);
            add_term(r.terms, "AdamW moments", 2 * one);
            if (summed) add_term(r.terms, "reduced gradient slice", one);
          } else if (label == "communication") {
            add_term(r.terms, "communication buffers", bytes);
          } else {
            add_term(r.terms, "optimizer scratch", bytes);
          }
        }
        if (dp == 0 && tp == 0 && pp == 0 && d.evaluation > 0) {
          // The coordinator runs in worker 0's process, on its device, with a backend of its own.
          r.evaluation = d.evaluation + (cuda ? cuda_workspace : 0);
          add_term(r.terms, "evaluation copy of the model", r.evaluation);
        }
        if (cuda) {
          add_term(r.terms, "GEMM workspace", 2 * cuda_workspace);
          r.reserve = static_cast<std::uint64_t>(
              cuda_slack * static_cast<double>(r.stage_peak + r.shard_peak + r.evaluation));
          if (!o.one_device) r.reserve += cuda_context;
          add_term(r.terms, "allocator reserve and context", r.reserve);
        }
        std::sort(r.terms.begin(), r.terms.end(),
                  [](const memory_term& a, const memory_term& b) { return a.bytes > b.bytes; });
        r.saved_per_microbatch = d.saved_per_microbatch[pp];
        r.peak_in_flight = in_flight.at(pp);
        p.ranks.push_back(std::move(r));
      }

  for (const auto& r : p.ranks) p.host_need += r.host_bytes;

  // Devices: all workers on one, or one each.
  std::vector<memory_term> fullest;
  if (o.one_device) {
    for (const auto& r : p.ranks) {
      p.need += r.total();
      for (const auto& t : r.terms) add_term(fullest, t.name, t.bytes);
    }
    if (cuda) {
      p.need += cuda_context;
      add_term(fullest, "allocator reserve and context", cuda_context);
    }
  } else {
    for (const auto& r : p.ranks)
      if (r.total() > p.need) p.need = r.total(), fullest = r.terms;
  }
  std::sort(fullest.begin(), fullest.end(),
            [](const memory_term& a, const memory_term& b) { return a.bytes > b.bytes; });
  if (!fullest.empty()) p.largest_term = fullest.front().name;
  p.fits = o.device_memory == 0 || p.need <= o.device_memory;

  // Time: the slowest chunk's costs through the simulator, then the optimizer's tail.
  const schedules::cost_model costs = chunk_costs(cfg, o.cal, sched.value().place);
  auto sim = schedules::simulate(sched.value(), costs);
  if (!sim.ok()) return sim.err();
  p.pipeline_s = sim.value().makespan;
  p.bubble = sim.value().bubble;
  if (o.one_device && l.workers() > 1) {
    // One device runs every worker's work and its streams fill each other's bubbles: the step is
    // the whole model's forward and backward (every layer once, the head once) for every
    // micro-batch of every replica and tensor-parallel rank, back to back.
    core::config whole = cfg;
    whole.parallel.pipeline_stage = 1;
    whole.parallel.virtual_pipeline = 1;
    whole.parallel.stage_layers.clear();
    whole.parallel.first_stage_layers = whole.parallel.last_stage_layers = 0;
    // The same layers recompute as in the config's chunks, named by index.
    const std::vector<bool> again = core::recompute_layers(cfg);
    if (std::find(again.begin(), again.end(), false) != again.end()) {
      whole.recompute.layers = 0;
      whole.recompute.layer_list.clear();
      for (std::size_t i = 0; i < again.size(); ++i)
        if (again[i]) whole.recompute.layer_list.push_back(static_cast<int>(i));
      if (whole.recompute.layer_list.empty()) whole.recompute.mode = core::recompute_mode::none;
    }
    // Tensor parallel: the device runs every rank's share (and its collectives) one after another.
    // The workers' streams also fill each other's gaps within the work (o.cal.concurrent_speedup).
    const schedules::cost_model w = chunk_costs(whole, o.cal);
    p.concurrent_speedup = o.cal.concurrent_speedup;
    p.pipeline_s = (w.f + w.b) * l.microbatches * l.dp * l.tp / p.concurrent_speedup;
  }
  std::int64_t stage_elems = 0, shard_elems = 0;
  for (int pp = 0; pp < l.pp; ++pp) {
    stage_elems = std::max<std::int64_t>(stage_elems, d.params[pp] / 4);
    const auto& split = d.shards.at({pp, 0, 0}).split;
    auto it = split.find("optimizer state");
    if (cfg.optimizer.offload)  // host: master slice and two moments (and a few staging pieces)
      shard_elems = std::max<std::int64_t>(shard_elems, d.shard_host.at({pp, 0, 0}) / 12);
    else if (it != split.end())
      shard_elems = std::max<std::int64_t>(shard_elems, it->second / 16);
  }
  p.optimizer_s = optimizer_seconds(cfg, o.cal, stage_elems, shard_elems, o.one_device);
  if (o.one_device) p.optimizer_s *= l.workers();
  p.step_s = p.pipeline_s + p.optimizer_s;
  p.tokens_per_step = core::derive(cfg).tokens_per_step;
  p.tokens_per_s = p.step_s > 0 ? static_cast<double>(p.tokens_per_step) / p.step_s : 0;

  if (!p.fits && o.suggest) {
    std::vector<std::pair<std::string, core::config>> tries;
    auto variant = [&](const std::string& change, auto edit) {
      core::config c = cfg;
      edit(c);
      tries.emplace_back(change, c);
    };
    if (cfg.recompute.mode == core::recompute_mode::none)
      variant("--set recompute.mode=selective", [](core::config& c) { c.recompute.mode = core::recompute_mode::selective; });
    if (cfg.recompute.mode != core::recompute_mode::full)
      variant("--set recompute.mode=full", [](core::config& c) { c.recompute.mode = core::recompute_mode::full; });
    if (l.dp > 1)
      for (int z = cfg.optimizer.zero_stage + 1; z <= 2; ++z)
        variant("--set optimizer.zero_stage=" + std::to_string(z), [z](core::config& c) { c.optimizer.zero_stage = z; });
    if (cfg.parallel.micro_batch_size % 2 == 0)  // halved at twice the count: same global batch
      variant("--set parallel.micro_batch_size=" + std::to_string(cfg.parallel.micro_batch_size / 2) +
                  " --set parallel.micro_batch_num=" + std::to_string(cfg.parallel.micro_batch_num * 2) +
                  " (same global batch)",
              [](core::config& c) {
                c.parallel.micro_batch_size /= 2;
                c.parallel.micro_batch_num *= 2;
              });
    if (!cfg.optimizer.offload)
      variant("--set optimizer.offload=true (optimizer state in host memory)",
              [](core::config& c) { c.optimizer.offload = true; });
    const int pp2 = cfg.parallel.pipeline_stage * 2;
    // Not with an uneven split: its keys name the present chunks, so the one --set would not do.
    const bool even = cfg.parallel.stage_layers.empty() && cfg.parallel.first_stage_layers == 0 &&
                      cfg.parallel.last_stage_layers == 0;
    if (!o.one_device && even && cfg.model.num_layers % (pp2 * cfg.parallel.virtual_pipeline) == 0 &&
        cfg.parallel.micro_batch_num * cfg.train.gradient_accumulation_steps >= pp2)
      variant("--set parallel.pipeline_stage=" + std::to_string(pp2) + " (twice the devices)",
              [pp2](core::config& c) { c.parallel.pipeline_stage = pp2; });
    for (auto& [change, c] : tries) {
      plan_options q = o;
      q.suggest = false;
      auto alt = make_plan(c, q);
      if (alt.ok() && alt.value().fits) p.suggestions.push_back({change, alt.value().need});
    }
  }
  return p;
}

std::string render_text(const job_plan& p) {
  std::ostringstream s;
  char line[512];
  s << "plan: " << p.name << " on " << p.device
    << (p.one_device ? " (every worker in one process on one device)" : " (one device per worker)")
    << "\n";
  std::snprintf(line, sizeof line, "%-12s %12s %12s %12s %12s %12s  %s\n", "rank", "stage",
                "optimizer", "evaluation", "reserve", "total", "largest terms");
  s << line;
  for (const auto& r : p.ranks) {
    std::string top;
    for (std::size_t i = 0; i < r.terms.size() && i < 3; ++i)
      top += (i ? ", " : "") + r.terms[i].name + " " + format_bytes(r.terms[i].bytes);
    std::snprintf(line, sizeof line, "%-12s %12s %12s %12s %12s %12s  %s\n",
                  rank_name(p, r).c_str(), format_bytes(r.stage_peak).c_str(),
                  format_bytes(r.shard_peak).c_str(),
                  r.evaluation ? format_bytes(r.evaluation).c_str() : "-",
                  format_bytes(r.reserve).c_str(), format_bytes(r.total()).c_str(), top.c_str());
    s << line;
  }
  for (const auto& r : p.ranks) {
    if (r.dp != 0 || r.tp != 0) continue;
    // With v chunks a rank the simulator counts (chunk, micro-batch) passes, and a micro-batch's
    // activations are its v chunks' together: say so rather than multiply the two.
    if (p.v > 1)
      s << "  pp" << r.pp << ": saved activations " << format_bytes(r.saved_per_microbatch)
        << " per micro-batch over its " << p.v << " chunks; at most " << r.peak_in_flight
        << " (chunk, micro-batch) passes in flight (simulator); terms:";
    else
      s << "  pp" << r.pp << ": saved activations " << format_bytes(r.saved_per_microbatch)
        << " per micro-batch × at most " << r.peak_in_flight << " in flight (simulator); terms:";
    for (const auto& t : r.terms) s << " " << t.name << " " << format_bytes(t.bytes) << ";";
    s << "\n";
  }
  char tbuf[256];
  std::snprintf(tbuf, sizeof tbuf,
                "time: step %.4g s (pipeline %.4g s, bubble %.1f %%, optimizer %.4g s), %.4g tokens/s "
                "[calibration: %s]\n",
                p.step_s, p.pipeline_s, 100 * p.bubble, p.optimizer_s, p.tokens_per_s,
                p.calibration.c_str());
  s << tbuf;
  if (p.concurrent_speedup != 1) {
    std::snprintf(tbuf, sizeof tbuf,
                  "  (every worker on one device: side by side they run %.3g times as fast as "
                  "one stream, concurrent_speedup)\n",
                  p.concurrent_speedup);
    s << tbuf;
  }
  s << "memory: " << format_bytes(p.need) << " on the fullest device";
  if (p.device_memory) s << " of " << format_bytes(p.device_memory);
  s << "; largest term: " << p.largest_term << "\n";
  if (p.offload) {
    s << "host memory (optimizer.offload: fp32 master weights, AdamW moments, gradient staging, "
         "page-locked): "
      << format_bytes(p.host_need) << " in all";
    for (const auto& r : p.ranks)
      s << (&r == &p.ranks.front() ? "; " : ", ") << rank_name(p, r) << " "
        << format_bytes(r.host_bytes);
    s << "\n";
  }
  if (p.device_memory) s << (p.fits ? "fits\n" : "DOES NOT FIT\n");
  if (!p.fits) {
    if (p.suggestions.empty())
      s << "no single change of recompute, ZeRO stage, micro-batch size, pipeline stages or "
           "optimizer.offload fits\n";
    for (const auto& g : p.suggestions)
      s << "  would fit: " << g.change << " -> " << format_bytes(g.need) << "\n";
  }
  return s.str();
}

std::string render_json(const job_plan& p) {
  nlohmann::ordered_json j;
  j["layout"] = p.name;
  j["device"] = p.device;
  j["data_parallel"] = p.dp;
  j["model_parallel"] = p.tp;
  j["sequence_parallel"] = p.sequence_parallel;
  j["pipeline_stage"] = p.pp;
  j["virtual_pipeline"] = p.v;
  j["microbatches"] = p.microbatches;
  j["micro_batch_size"] = p.micro_batch_size;
  j["schedule"] = p.schedule;
  j["recompute"] = p.recompute;
  j["zero_stage"] = p.zero_stage;
  j["precision"] = p.precision;
  j["one_device"] = p.one_device;
  j["ranks"] = nlohmann::ordered_json::array();
  for (const auto& r : p.ranks) {
    nlohmann::ordered_json jr;
    jr["dp"] = r.dp;
    jr["tp"] = r.tp;
    jr["pp"] = r.pp;
    jr["stage_peak_bytes"] = r.stage_peak;
    jr["optimizer_peak_bytes"] = r.shard_peak;
    jr["evaluation_bytes"] = r.evaluation;
    jr["reserve_bytes"] = r.reserve;
    jr["host_bytes"] = r.host_bytes;
    jr["total_bytes"] = r.total();
    jr["saved_activation_bytes_per_microbatch"] = r.saved_per_microbatch;
    jr["peak_in_flight"] = r.peak_in_flight;
    jr["terms"] = nlohmann::ordered_json::object();
    for (const auto& t : r.terms) jr["terms"][t.name] = t.bytes;
    j["ranks"].push_back(jr);
  }
  j["need_bytes"] = p.need;
  j["device_memory_bytes"] = p.device_memory;
  j["fits"] = p.fits;
  j["offload"] = p.offload;
  j["host_bytes"] = p.host_need;
  j["largest_term"] = p.largest_term;
  j["step_s"] = p.step_s;
  j["pipeline_s"] = p.pipeline_s;
  j["optimizer_s"] = p.optimizer_s;
  j["bubble"] = p.bubble;
  j["concurrent_speedup"] = p.concurrent_speedup;
  j["tokens_per_step"] = p.tokens_per_step;
  j["tokens_per_s"] = p.tokens_per_s;
  j["calibration"] = p.calibration;
  j["suggestions"] = nlohmann::ordered_json::array();
  for (const auto& g : p.suggestions) j["suggestions"].push_back({{"change", g.change}, {"need_bytes", g.need}});
  return j.dump(2);
}

}  // namespace troupe::plan
