// gpu_pipeline_bench: GPT-2 124M (configs/gpt2_124m.toml's shapes, T = 1024) trained by the actor
// runtime as a P-stage pipeline on one GPU — every stage and optimizer shard a CUDA backend with its
// own stream, tensors handed over with events — and, for comparison, the same global batch as one
// stage through the same runtime. Prints, per run: tokens/s and model TFLOP/s over the timed steps,
// the runtime's measured bubble (metrics.jsonl) beside the simulator's for the schedule, and the
// peak device memory of every stage (its backend's allocator plus its optimizer shard's).
//
// On one GPU the stages share the SMs: a stage idle in the schedule leaves the GPU to the others,
// so the pipeline's cost shows as the throughput ratio to the one-stage run, not as idle hardware.
// The measured bubble is the host's view (an instruction's time is the time to queue its kernels,
// and a stage waits where a peer has not yet queued what it needs), see docs/PERFORMANCE.md.
//
// Usage: gpu_pipeline_bench [--config FILE] [--pp P] [--micro M] [--micro-batch B] [--steps S]
//                           [--warmup W] [--schedule NAME] [--virtual V] [--stage-layers LIST]
//                           [--precision bf16|fp32|fp16] [--device cuda|cpu] [--no-single]
//                           [--keep DIR] [--out FILE.json]
// --virtual is parallel.virtual_pipeline (default 2 for zb_v, else 1); --stage-layers is
// parallel.stage_layers of the pipelined run, e.g. [2,1,2,1,2,1,2,1] gives every rank of zb_v at
// pp 4 three of GPT-2 124M's 12 layers (its ranks hold chunks r and 7-r).
// (--device cpu --precision fp32 --config configs/tiny.toml checks the program on a CPU.)
// Random tokens (vocab 50257), vocabulary padded to 50304 like bench/torch_gpt2.py.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/runtime.hpp"
#include "core/config.hpp"
#include "core/rng.hpp"
#include "model/shards.hpp"
#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"

using namespace troupe;
namespace fs = std::filesystem;

namespace {

struct options {
  std::string config = "configs/gpt2_124m.toml";
  int pp = 4, micro = 8, micro_batch = 16, steps = 12, warmup = 4;
  std::string schedule = "1f1b", precision = "bf16", device = "cuda", out = "gpu_pipeline_bench.json";
  std::string keep;  // a directory to copy each run's metrics.jsonl and trace.json to
  int virtual_stages = 0;    // 0: 2 for zb_v, else 1
  std::string stage_layers;  // parallel.stage_layers of the pipelined run ("" = even)
  int v() const { return virtual_stages > 0 ? virtual_stages : schedule == "zb_v" ? 2 : 1; }
  bool single = true;
};

struct measured {
  double tokens_per_s = 0, tflops = 0, bubble = 0, first_loss = 0, last_loss = 0;
  int skipped = 0;
  std::vector<std::pair<double, double>> stage_gib;  // (stage backend, its optimizer shard)
};

void write_tokens(const std::string& path, std::size_t n, int vocab) {
  core::rng_stream rng(core::stream_key(11, 0x5eed));
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>(rng.below(vocab));
  auto st = model::write_shard(path, t);
  if (!st.ok()) throw std::runtime_error(st.err().to_string());
}

core::config make_config(const options& o, const std::string& dir, int pp) {
  std::vector<std::string> sets = {
      "parallel.pipeline_stage=" + std::to_string(pp),
      "parallel.data_parallel=1",
      "parallel.micro_batch_num=" + std::to_string(o.micro),
      "parallel.micro_batch_size=" + std::to_string(o.micro_batch),
      "train.gradient_accumulation_steps=1",
      "train.steps=" + std::to_string(o.steps),
      "train.warmup_steps=0",
      "train.eval_interval=0",
      "model.vocab_size=50304",
      // One stage of one chunk cannot run a schedule that needs two (zb_v): 1f1b there.
      "schedule.name=\"" + (pp == o.pp || o.v() == 1 ? o.schedule : std::string("1f1b")) + "\"",
      "recompute.mode=\"none\"",
      "precision.compute=\"" + o.precision + "\"",
      "optimizer.zero_stage=0",
      "data.train=\"" + dir + "/train.bin\"",
      "data.val=\"\"",
      "runtime.device=\"" + o.device + "\"",
      "runtime.record=false",
      "runtime.run_dir=\"" + dir + "/run_pp" + std::to_string(pp) + "\"",
      "checkpoint.dir=\"" + dir + "/ckpt_pp" + std::to_string(pp) + "\"",
  };
  // The one-stage comparison keeps one chunk: the same work without a pipeline.
  if (pp == o.pp) {
    sets.push_back("parallel.virtual_pipeline=" + std::to_string(o.v()));
    if (!o.stage_layers.empty()) sets.push_back("parallel.stage_layers=" + o.stage_layers);
  }
  auto c = core::load_config(o.config, sets);
  if (!c.ok()) throw std::runtime_error(c.err().to_string());
  return c.value();
}

double flops_per_token(const core::config& c) {
  // As bench/torch_gpt2.py counts: 6N + 12·L·C·T, N with the tied matrix once.
  const double n = static_cast<double>(core::parameter_count(c.model));
  return 6 * n + 12.0 * c.model.num_layers * c.model.hidden_size * c.model.seq_length;
}

measured run(const core::config& c, const options& o) {
  actors::run_options ro;
  ro.log = stdout;
  auto r = actors::run_actor_job(c, ro);
  if (!r.ok()) throw std::runtime_error(r.err().to_string());
  std::ifstream in(c.runtime.run_dir + "/metrics.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) lines.push_back(nlohmann::json::parse(l));
  if (static_cast<int>(lines.size()) <= o.warmup)
    throw std::runtime_error("fewer steps than --warmup + 1");
  measured m;
  const double tokens = static_cast<double>(o.micro) * o.micro_batch * c.model.seq_length;
  const auto& w = lines[o.warmup - 1];
  const auto& last = lines.back();
  const double seconds = last["elapsed_s"].get<double>() - w["elapsed_s"].get<double>();
  m.tokens_per_s = tokens * static_cast<double>(lines.size() - o.warmup) / seconds;
  m.tflops = m.tokens_per_s * flops_per_token(c) / 1e12;
  std::vector<double> bubbles;
  for (std::size_t i = o.warmup; i < lines.size(); ++i) bubbles.push_back(lines[i]["bubble"].get<double>());
  std::sort(bubbles.begin(), bubbles.end());
  m.bubble = bubbles[bubbles.size() / 2];
  m.first_loss = lines.front()["loss"].get<double>();
  m.last_loss = last["loss"].get<double>();
  for (const auto& l : lines) m.skipped += l.value("skipped", false) ? 1 : 0;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  std::vector<nlohmann::json> stages(last["stages"].begin(), last["stages"].end());
  std::sort(stages.begin(), stages.end(),  // listed in the order the stages reported
            [](const auto& a, const auto& b) { return a["pp"].template get<int>() < b["pp"].template get<int>(); });
  for (const auto& s : stages)
    m.stage_gib.emplace_back(s.value("peak_device_bytes", 0.0) / gib,
                             s.value("optimizer_peak_device_bytes", 0.0) / gib);
  return m;
}

double simulated_bubble(const options& o) {
  schedules::schedule_options so;
  so.costs.f = 1;
  so.costs.b = 2;
  so.virtual_stages = o.v();
  auto s = schedules::make_schedule(o.schedule, o.pp, o.micro, so);
  if (!s.ok()) throw std::runtime_error(s.err().to_string());
  auto sim = schedules::simulate(schedules::lower(s.value(), so.costs), so.costs);
  if (!sim.ok()) throw std::runtime_error(sim.err().to_string());
  return sim.value().bubble;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--config") o.config = next();
    else if (a == "--pp") o.pp = std::stoi(next());
    else if (a == "--micro") o.micro = std::stoi(next());
    else if (a == "--micro-batch") o.micro_batch = std::stoi(next());
    else if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--schedule") o.schedule = next();
    else if (a == "--virtual") o.virtual_stages = std::stoi(next());
    else if (a == "--stage-layers") o.stage_layers = next();
    else if (a == "--precision") o.precision = next();
    else if (a == "--device") o.device = next();
    else if (a == "--keep") o.keep = next();
    else if (a == "--no-single") o.single = false;
    else if (a == "--out") o.out = next();
    else {
      std::fprintf(stderr, "usage: gpu_pipeline_bench [--config FILE] [--pp P] [--micro M] "
                           "[--micro-batch B] [--steps S] [--warmup W] [--schedule NAME] [--virtual V] "
                           "[--stage-layers LIST] [--precision bf16|fp32|fp16] [--device cuda|cpu] [--no-single] "
                           "[--keep DIR] [--out FILE.json]\n");
      return 2;
    }
  }
  try {
    const std::string dir =
        (fs::temp_directory_path() / ("troupe_gpu_pipeline_" + std::to_string(::getpid()))).string();
    fs::create_directories(dir);
    const std::size_t need = static_cast<std::size_t>(o.steps + 1) * o.micro * o.micro_batch * 1025;
    write_tokens(dir + "/train.bin", need, 50257);

    nlohmann::json report;
    const double sim = simulated_bubble(o);
    std::vector<int> splits = {o.pp};
    if (o.single && o.pp != 1) splits.push_back(1);
    std::vector<measured> results;
    for (int pp : splits) {
      core::config c = make_config(o, dir, pp);
      std::printf("== %s, pipeline_stage %d, %d micro-batches of %d x %d, %s ==\n",
                  o.schedule.c_str(), pp, o.micro, o.micro_batch, c.model.seq_length,
                  o.precision.c_str());
      std::fflush(stdout);
      results.push_back(run(c, o));
      if (!o.keep.empty()) {
        fs::create_directories(o.keep);
        for (const char* f : {"metrics.jsonl", "trace.json"})
          fs::copy_file(c.runtime.run_dir + "/" + f,
                        o.keep + "/pp" + std::to_string(pp) + "_" + f,
                        fs::copy_options::overwrite_existing);
      }
      const measured& m = results.back();
      nlohmann::json j = {{"pp", pp},           {"tokens_per_s", m.tokens_per_s},
                          {"tflops", m.tflops}, {"bubble_measured", m.bubble},
                          {"first_loss", m.first_loss}, {"last_loss", m.last_loss},
                          {"skipped_steps", m.skipped}};
      for (const auto& [s, opt] : m.stage_gib) j["peak_gib"].push_back({{"stage", s}, {"optimizer", opt}});
      report["runs"].push_back(j);
    }
    std::printf("\n%-8s %12s %10s %10s %10s  %s\n", "stages", "tokens/s", "TFLOP/s", "bubble",
                "simulated", "peak GiB per stage (stage + optimizer shard)");
    for (std::size_t k = 0; k < results.size(); ++k) {
      const measured& m = results[k];
      std::printf("%-8d %12.0f %10.1f %10.3f %10s  ", splits[k], m.tokens_per_s, m.tflops, m.bubble,
                  splits[k] == o.pp ? std::to_string(sim).substr(0, 5).c_str() : "-");
      for (const auto& [s, opt] : m.stage_gib) std::printf("%.2f+%.2f ", s, opt);
      std::printf("\n");
    }
    if (results.size() == 2)
      std::printf("pipeline / one stage throughput: %.3f\n",
                  results[0].tokens_per_s / results[1].tokens_per_s);
    report["simulated_bubble"] = sim;
    report["steps"] = o.steps;
    report["warmup"] = o.warmup;
    std::ofstream(o.out) << report.dump(2) << "\n";
    std::printf("wrote %s\n", o.out.c_str());
    fs::remove_all(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_pipeline_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
