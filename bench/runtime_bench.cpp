// runtime_bench: what the actor runtime costs beyond the arithmetic, and how its measured pipeline
// bubble compares with the simulator's prediction for the same schedule.
//
// Run it with at least P idle cores: each stage computes on one core (kernel_threads = 1).
//
//  1. Overhead. The same tiny job (one stage, many micro-batches, a model so small that kernels
//     take microseconds) runs through the actors and through the plain single-rank loop; both do
//     the same arithmetic bit for bit, so the difference in step time divided by the number of
//     instructions is the runtime's cost per instruction: message handling, stashing, transport
//     and scheduling.
//  2. Bubble. A balanced pipeline (small vocabulary, so the LM head does not dominate) runs each
//     built-in schedule; the coordinator's measured bubble (idle share of each stage within the
//     step's span, averaged) is printed beside schedules::simulate's prediction fed with the mean
//     measured F / B / I / W / transfer durations of the same run.
//
// Usage: runtime_bench [--pp P] [--micro M] [--steps S] [--out FILE.json]
// Run it on an otherwise idle machine with at least P cores.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/runtime.hpp"
#include "core/config.hpp"
#include "model/shards.hpp"
#include "core/rng.hpp"
#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"

using namespace troupe;
namespace fs = std::filesystem;

namespace {

void write_tokens(const std::string& path, std::size_t n, int vocab) {
  core::rng_stream rng(core::stream_key(7, 0x5eed));
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>(rng.below(vocab));
  auto st = model::write_shard(path, t);
  if (!st.ok()) throw std::runtime_error(st.err().to_string());
}

core::config base_config(const std::string& dir) {
  core::config c;
  c.data.train = dir + "/train.bin";
  c.runtime.run_dir = dir + "/run";
  c.checkpoint.dir = dir + "/run/checkpoints";
  c.train.eval_interval = 0;
  c.train.warmup_steps = 0;
  c.model.vocab_size = 256;
  return c;
}

// Last-step trace events of a run, by instruction kind letter (F, B, I, W, S = transfer).
std::map<char, std::pair<double, int>> mean_durations(const std::string& run_dir, int step) {
  std::map<char, std::pair<double, int>> acc;
  std::ifstream in(run_dir + "/trace.json");
  auto j = nlohmann::json::parse(in);
  for (const auto& e : j["traceEvents"]) {
    if (e["args"]["step"].get<int>() != step) continue;
    std::string name = e["name"];
    if (name.rfind("wait", 0) == 0) continue;
    char k = 0;
    if (name.find("SEND") != std::string::npos || name.find("RECV") != std::string::npos) k = 'S';
    else
      for (char c : {'F', 'B', 'I', 'W'})
        if (name.find(c) != std::string::npos && name.find("REDUCE") == std::string::npos && name != "STEP") k = c;
    if (!k) continue;
    acc[k].first += e["dur"].get<double>();
    acc[k].second += 1;
  }
  return acc;
}

double last_bubble(const std::string& run_dir) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return nlohmann::json::parse(last)["bubble"].get<double>();
}

double seconds_of(const core::config& c, bool actors_runtime, int kernel_threads = 0) {
  auto t0 = std::chrono::steady_clock::now();
  core::result<model::train_summary> r = core::error::make("");
  if (actors_runtime) {
    actors::run_options o;
    o.log = nullptr;
    o.kernel_threads = kernel_threads;
    r = actors::run_actor_job(c, o);
  } else {
    model::train_options o;
    o.log = nullptr;
    r = model::train_single_rank(c, o);
  }
  if (!r.ok()) throw std::runtime_error(r.err().to_string());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int pp = 2, micro = 8, steps = 6;
  std::string out = "runtime_bench.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--pp") pp = std::atoi(argv[i + 1]);
    else if (a == "--micro") micro = std::atoi(argv[i + 1]);
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--out") out = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: runtime_bench [--pp P] [--micro M] [--steps S] [--out FILE]\n");
      return 2;
    }
  }
  std::string dir = (fs::temp_directory_path() / ("troupe_runtime_bench_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  write_tokens(dir + "/train.bin", 200000, 256);
  nlohmann::json report;

  // 1. overhead per instruction
  {
    core::config c = base_config(dir);
    c.model.num_layers = 1;
    c.model.hidden_size = 16;
    c.model.num_heads = 2;
    c.model.seq_length = 8;
    c.parallel.micro_batch_size = 1;
    c.parallel.micro_batch_num = 64;
    c.train.steps = steps;
    auto parsed = core::parse_config(core::to_toml(c), "bench");
    if (!parsed.ok()) { std::fprintf(stderr, "%s\n", parsed.err().to_string().c_str()); return 1; }
    c = parsed.value();
    seconds_of(c, true);  // warm caches and the allocator
    double t_loop = seconds_of(c, false);
    double t_actor = seconds_of(c, true);
    // F and B per micro-batch, plus REDUCE_GRAD and STEP, per step
    int instructions = steps * (2 * c.parallel.micro_batch_num + 2);
    double per_instr_us = (t_actor - t_loop) / instructions * 1e6;
    // From the stage's own timeline: the step's span minus its kernel time, per instruction.
    double span_us = 0, compute_us = 0;
    int count = 0;
    {
      std::ifstream in(c.runtime.run_dir + "/trace.json");
      auto tj = nlohmann::json::parse(in);
      std::map<int, std::pair<double, double>> bounds;
      for (const auto& e : tj["traceEvents"]) {
        int st = e["args"]["step"].get<int>();
        double a = e["ts"].get<double>(), b = a + e["dur"].get<double>();
        auto it = bounds.find(st);
        if (it == bounds.end()) bounds[st] = {a, b};
        else it->second = {std::min(it->second.first, a), std::max(it->second.second, b)};
        if (e["cat"] == "compute") compute_us += e["dur"].get<double>();
        if (e["cat"] != "wait") ++count;
      }
      for (auto& [st, ab] : bounds) span_us += ab.second - ab.first;
    }
    double engine_us = (span_us - compute_us) / std::max(count, 1);
    std::printf("overhead: stage timeline: %.1f us per instruction outside the kernels "
                "(%d instructions, %.1f ms span, %.1f ms kernels)\n",
                engine_us, count, span_us / 1000, compute_us / 1000);
    report["overhead_timeline_us_per_instruction"] = engine_us;
    std::printf("overhead: %d steps of %d micro-batches, 1 stage: actors %.3f s, plain loop %.3f s -> "
                "%.1f us per instruction beyond the kernels\n",
                steps, c.parallel.micro_batch_num, t_actor, t_loop, per_instr_us);
    report["overhead"] = {{"actor_s", t_actor}, {"loop_s", t_loop}, {"instructions", instructions},
                          {"us_per_instruction", per_instr_us}};
  }

  // 2. measured vs simulated bubble
  std::printf("\n%-18s %10s %10s %10s %10s %10s %10s\n", "schedule", "F ms", "B ms", "I ms", "W ms",
              "measured", "simulated");
  for (std::string name : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"}) {
    core::config c = base_config(dir);
    c.model.num_layers = 8;
    c.model.hidden_size = 128;
    c.model.num_heads = 4;
    c.model.seq_length = 64;
    c.parallel.pipeline_stage = pp;
    c.parallel.micro_batch_num = micro;
    c.parallel.micro_batch_size = 4;
    c.parallel.virtual_pipeline = name == "interleaved_1f1b" || name == "zb_v" ? 2 : 1;
    c.schedule.name = name;
    c.train.steps = steps;
    c.runtime.threads = pp;
    auto parsed = core::parse_config(core::to_toml(c), "bench");
    if (!parsed.ok()) { std::fprintf(stderr, "%s\n", parsed.err().to_string().c_str()); return 1; }
    c = parsed.value();
    seconds_of(c, true, 1);  // one core per stage: the simulator's model
    double measured = last_bubble(c.runtime.run_dir);
    auto d = mean_durations(c.runtime.run_dir, steps - 1);
    auto mean = [&](char k) { return d.count(k) ? d[k].first / d[k].second / 1000.0 : 0.0; };
    schedules::schedule_options o;
    o.virtual_stages = c.parallel.virtual_pipeline;
    o.costs.f = mean('F');
    o.costs.b = mean('B') > 0 ? mean('B') : mean('I') + mean('W');
    o.costs.i = mean('I');
    o.costs.w = mean('W');
    o.costs.comm = mean('S');
    auto s = schedules::make_schedule(name, pp, micro, o);
    if (!s.ok()) { std::fprintf(stderr, "%s\n", s.err().to_string().c_str()); return 1; }
    auto sim = schedules::simulate(schedules::lower(s.value(), o.costs), o.costs);
    if (!sim.ok()) { std::fprintf(stderr, "%s\n", sim.err().to_string().c_str()); return 1; }
    std::printf("%-18s %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f\n", name.c_str(), mean('F'), mean('B'),
                mean('I'), mean('W'), measured, sim.value().bubble);
    report["bubble"][name] = {{"measured", measured}, {"simulated", sim.value().bubble},
                              {"f_ms", mean('F')}, {"b_ms", mean('B')}, {"i_ms", mean('I')},
                              {"w_ms", mean('W')}, {"transfer_ms", mean('S')}, {"pp", pp}, {"m", micro}};
  }
  std::ofstream(out) << report.dump(2) << "\n";
  std::printf("\nwrote %s\n", out.c_str());
  fs::remove_all(dir);
  return 0;
}
