#include "plan/cost_model.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

namespace troupe::plan {

calibration default_calibration(const std::string& device, core::precision_kind precision) {
  calibration c;
  c.precision = precision == core::precision_kind::fp32   ? "fp32"
                : precision == core::precision_kind::bf16 ? "bf16"
                                                          : "fp16";
  if (device.rfind("cuda", 0) == 0) {
    c.device = "cuda";
    c.flops_per_s = precision == core::precision_kind::fp32 ? 5e13 : 4e14;
    c.op_overhead_s = 5e-6;
    c.memory_bytes_per_s = 3e12;
    c.link_bytes_per_s = 1e11;
    c.concurrent_speedup = 1.1;
    c.offload_link_bytes_per_s = 5e10;
    c.host_adamw_bytes_per_s = 1e11;
  }
  return c;
}

core::result<calibration> load_calibration(const std::string& path) {
  std::ifstream f(path);
  if (!f)
    return core::error::make("cannot read calibration file '" + path + "'",
                             "write one with `troupe plan CONFIG --calibrate " + path + "`");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    return core::error::make("calibration file '" + path + "' is not JSON: " + e.what(),
                             "write it again with `troupe plan CONFIG --calibrate " + path + "`");
  }
  calibration c;
  c.source = path;
  for (auto [key, dst] : {std::pair<const char*, double*>{"flops_per_s", &c.flops_per_s},
                          {"op_overhead_s", &c.op_overhead_s},
                          {"memory_bytes_per_s", &c.memory_bytes_per_s},
                          {"link_bytes_per_s", &c.link_bytes_per_s}}) {
    if (!j.contains(key) || !j[key].is_number() || j[key].get<double>() <= 0)
      return core::error::make("calibration file '" + path + "': key \"" + key +
                                   "\" is missing or not a positive number",
                               "write it again with `troupe plan CONFIG --calibrate " + path + "`");
    *dst = j[key].get<double>();
  }
  c.device = j.value("device", "cpu");
  c.precision = j.value("precision", "fp32");
  // Keys later versions measure: files written before lack them and take the device's default.
  calibration d = default_calibration(c.device, core::precision_kind::fp32);
  if (c.device == "cpu")  // offload on the CPU device: host copies and AdamW at its memory rate
    d.offload_link_bytes_per_s = d.host_adamw_bytes_per_s = c.memory_bytes_per_s;
  for (auto [key, dst, fallback, most] :
       {std::tuple<const char*, double*, double, double>{"concurrent_speedup",
                                                        &c.concurrent_speedup,
                                                        d.concurrent_speedup, 4.0},
        {"offload_link_bytes_per_s", &c.offload_link_bytes_per_s, d.offload_link_bytes_per_s,
         1e15},
        {"host_adamw_bytes_per_s", &c.host_adamw_bytes_per_s, d.host_adamw_bytes_per_s, 1e15}}) {
    *dst = fallback;
    if (!j.contains(key)) continue;
    const auto& v = j[key];
    if (!v.is_number() || v.get<double>() <= 0 || v.get<double>() > most) {
      char range[32];
      std::snprintf(range, sizeof range, "(0, %g]", most);
      return core::error::make("calibration file '" + path + "': key \"" + key +
                                   "\" is not a number in " + range,
                               "write it again with `troupe plan CONFIG --calibrate " + path + "`");
    }
    *dst = v.get<double>();
  }
  return c;
}

core::status save_calibration(const calibration& c, const std::string& path) {
  nlohmann::ordered_json j;
  j["device"] = c.device;
  j["precision"] = c.precision;
  j["flops_per_s"] = c.flops_per_s;
  j["op_overhead_s"] = c.op_overhead_s;
  j["memory_bytes_per_s"] = c.memory_bytes_per_s;
  j["link_bytes_per_s"] = c.link_bytes_per_s;
  j["concurrent_speedup"] = c.concurrent_speedup;
  j["offload_link_bytes_per_s"] = c.offload_link_bytes_per_s;
  j["host_adamw_bytes_per_s"] = c.host_adamw_bytes_per_s;
  if (!c.chunk_seconds.empty()) {
    nlohmann::ordered_json t;
    for (const auto& [layers, s] : c.chunk_seconds) t[std::to_string(layers)] = s;
    j["chunk_seconds_by_layers"] = t;
  }
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) return core::error::make("cannot write calibration file '" + path + "'", "choose a writable path");
  return core::status{};
}

double forward_flops(const core::model_config& m, int layers, bool head, std::int64_t rows) {
  const double C = m.hidden_size, F = m.ffn_size(), T = m.seq_length, V = m.vocab_size;
  const double kv = static_cast<double>(m.kv_heads()) * m.head_dim();
  const double mlp = m.arch == core::arch_kind::gpt2 ? 2 * F * C : 3 * F * C;
  const double weights = C * C + 2 * kv * C + C * C + mlp;  // q, k, v, output projection, MLP
  const double per_layer = 2.0 * static_cast<double>(rows) * weights +
                           2.0 * static_cast<double>(rows) * T * C;  // causal QKᵀ and PV
  return layers * per_layer + (head ? 2.0 * static_cast<double>(rows) * V * C : 0.0);
}

int forward_ops_per_layer(const core::model_config& m) {
  return m.arch == core::arch_kind::gpt2 ? 7 : 10;
}

double tp_comm_seconds(const core::config& cfg, const calibration& cal, int layers,
                       bool embedding, bool head) {
  const int n = cfg.parallel.model_parallel;
  if (n == 1) return 0;
  const bool sp = cfg.parallel.sequence_parallel;
  const double rows = static_cast<double>(cfg.parallel.micro_batch_size) * cfg.model.seq_length;
  const double a = rows * cfg.model.hidden_size * 4;  // one fp32 activation [rows, C]
  const double share = static_cast<double>(n - 1) / n;
  const double half = share * a, whole = 2 * share * a;  // a gather or scatter / an all-reduce
  double bytes = layers * 2 * whole;  // per layer: attention and MLP, each an all-reduce or its halves
  if (embedding) bytes += sp ? half : whole;
  if (head) {
    // The final norm's rows gathered (sequence parallel), the loss's row maxima all-gathered, its
    // two row sums all-reduced, and the final norm's gradient summed.
    bytes += (sp ? half : 0) + share * rows * 4 * n + 2 * share * rows * 8 + (sp ? half : whole);
  }
  return bytes / cal.link_bytes_per_s;
}

schedules::cost_model chunk_costs(const core::config& cfg, const calibration& cal,
                                  schedules::placement place) {
  const std::vector<int> split = core::chunk_layers(cfg);
  const std::vector<bool> recomputed = core::recompute_layers(cfg);
  const std::int64_t rows =
      static_cast<std::int64_t>(cfg.parallel.micro_batch_size) * cfg.model.seq_length;
  const int tp = cfg.parallel.model_parallel;
  // Tensor parallel: each rank does 1/tp of the arithmetic but launches every op.
  const auto forward_time = [&](int layers, bool head) {
    const double ops = forward_ops_per_layer(cfg.model) * layers;
    return forward_flops(cfg.model, layers, head, rows) / tp / cal.flops_per_s +
           ops * cal.op_overhead_s;
  };
  // The slowest chunk sets the pipeline's pace (the embedding is a lookup; the head is not):
  // with an uneven split, the chunk whose layers (and head) cost most. Per chunk: forward compute
  // fi, the collectives of its forward ci (its backward moves as much again), and xi, the
  // recomputed forward inside the backward (with its collectives under full recompute).
  double f = 0, comm = 0, extra = 0;
  const auto cost = [](double fi, double ci, double xi) { return 3 * fi + 2 * ci + xi; };
  const int pp = cfg.parallel.pipeline_stage, v = cfg.parallel.virtual_pipeline;
  std::vector<double> rank_f(static_cast<std::size_t>(pp), 0), rank_c(rank_f.size(), 0),
      rank_x(rank_f.size(), 0);
  int first = 0;
  for (std::size_t i = 0; i < split.size(); ++i) {
    const int layers = split[i];
    const bool head = i + 1 == split.size();
    int again = 0;  // layers of this chunk that recompute
    for (int l = first; l < first + layers; ++l) again += recomputed[static_cast<std::size_t>(l)];
    first += layers;
    const double fi = forward_time(layers, head);
    const double ci = tp_comm_seconds(cfg, cal, layers, i == 0, head);
    double xi = 0;
    if (cfg.recompute.mode == core::recompute_mode::full) {
      // Every layer recomputing reruns the chunk, head included; otherwise only those layers.
      xi = again == layers ? fi + ci
                           : forward_time(again, false) + tp_comm_seconds(cfg, cal, again, false, false);
    } else if (cfg.recompute.mode == core::recompute_mode::selective) {
      xi = again * 2.0 * static_cast<double>(rows) * cfg.model.seq_length *
           cfg.model.hidden_size / tp / cal.flops_per_s;
    }
    if (cost(fi, ci, xi) > cost(f, comm, extra)) f = fi, comm = ci, extra = xi;
    const auto r = static_cast<std::size_t>(schedules::chunk_rank(place, pp, static_cast<int>(i)));
    rank_f[r] += fi;
    rank_c[r] += ci;
    rank_x[r] += xi;
  }
  if (place == schedules::placement::v) {
    f = comm = extra = 0;
    for (std::size_t r = 0; r < rank_f.size(); ++r)
      if (cost(rank_f[r], rank_c[r], rank_x[r]) > cost(f, comm, extra))
        f = rank_f[r], comm = rank_c[r], extra = rank_x[r];
    f /= v;
    comm /= v;
    extra /= v;
  }
  schedules::cost_model c;
  c.f = f + comm;
  c.b = 2 * f + comm + extra;
  c.i = f + comm + extra;  // the input gradient carries the backward's collectives
  c.w = f;
  const std::size_t act = cfg.precision.compute == core::precision_kind::fp32 ? 4 : 2;
  // Under sequence parallel a rank sends its rows of the activation to the next stage.
  const std::int64_t sent = cfg.parallel.sequence_parallel ? rows / tp : rows;
  c.comm = static_cast<double>(sent) * cfg.model.hidden_size * act / cal.link_bytes_per_s;
  return c;
}

double optimizer_seconds(const core::config& cfg, const calibration& cal,
                         std::int64_t stage_elements, std::int64_t shard_elements,
                         bool one_device) {
  const int dp = cfg.parallel.data_parallel;
  double t = 0;
  const double exchange =
      one_device && cal.device == "cuda" ? cal.memory_bytes_per_s : cal.link_bytes_per_s;
  if (dp > 1)  // every replica's gradient slices go to their shards, parameters come back
    t += 2.0 * static_cast<double>(stage_elements) * 4 * (dp - 1) / dp / exchange;
  // AdamW reads parameter, gradient and both moments and writes three of them back: 28 B/element.
  const double n = static_cast<double>(shard_elements);
  if (!cfg.optimizer.offload) return t + 28.0 * n / cal.memory_bytes_per_s;
  t += std::max(8.0 * n / cal.offload_link_bytes_per_s, 28.0 * n / cal.host_adamw_bytes_per_s);
  return t;
}

}  // namespace troupe::plan
