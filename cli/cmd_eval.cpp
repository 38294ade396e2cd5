// `troupe eval CHECKPOINT --data FILE [--batches N] [--batch-size B] [--device cpu|cuda] [--json]`:
// the loss and perplexity of a checkpoint's model on token shards or instruction shards. The
// batches are the loader's evaluation cuts (model/loader.hpp: the same rows for every seed and
// step), and the loss is model::validation_loss, the training run's own: the mean over the trained
// targets (every target of token shards; the responses of instruction data), so `troupe eval RUN
// --data VAL` with the run's eval_batches reproduces the run's last validation loss.
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/command.hpp"
#include "core/config.hpp"
#include "kernels/select.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "model/loader.hpp"
#include "model/run_policy.hpp"

namespace troupe::cli {
namespace {

struct eval_args {
  std::string checkpoint;
  std::string data;
  int batches = 0;     // 0: the run's train.eval_batches
  int batch_size = 0;  // 0: the run's parallel.micro_batch_size
  std::string device;  // "": the run's runtime.device
  bool json = false;
};

int fail(const core::error& e) {
  print_error(e.to_string());
  return 1;
}

int run_eval(const eval_args& a) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(a.checkpoint, ec) && !fs::exists(fs::path(a.checkpoint) / "manifest.json", ec) &&
      fs::exists(fs::path(a.checkpoint) / "config.json", ec))
    return fail(core::error::at_file(a.checkpoint,
                                     "is a Hugging Face model directory (config.json), not a troupe "
                                     "checkpoint",
                                     "evaluate a troupe checkpoint or run directory"));
  auto dir = model::checkpoint::resolve(a.checkpoint);
  if (!dir) return fail(dir.err());
  auto ck = model::checkpoint::reader::open(dir.value());
  if (!ck) return fail(ck.err());
  auto cfg = core::parse_config(ck->info().config_toml, dir.value() + "/manifest.json");
  if (!cfg) return fail(cfg.err());
  const core::model_config& m = cfg->model;
  const std::string device = a.device.empty() ? cfg->runtime.device : a.device;
  const int batches = a.batches > 0 ? a.batches : cfg->train.eval_batches;

  model::loader_options lo = model::loader_options::from(cfg.value());
  if (a.batch_size > 0) lo.micro_batch_size = a.batch_size;
  auto data = model::loader::open(a.data, lo);
  if (!data) return fail(data.err());

  kernels::set_cpu_threads(cfg->runtime.threads);
  std::unique_ptr<kernels::backend> be;
  try {
    be = kernels::make_backend(device);
  } catch (const std::exception& e) {
    return fail(core::error::make(std::string("--device ") + device + ": " + e.what(),
                                  "--device cpu runs anywhere"));
  }
  model::chunk net(m, model::partition(m, 1)[0], *be, cfg->precision.compute);
  if (auto st = model::checkpoint::restore(ck.value(), *be, m, net, nullptr); !st)
    return fail(st.err());

  std::int64_t trained = 0;
  for (int i = 0; i < batches; ++i) trained += data->eval_cut(i).trained;
  double loss = 0;
  try {
    loss = model::validation_loss(data.value(), batches, *be, {&net});
  } catch (const core::failure& e) {
    return fail(core::error::at_file(a.data, e.what(), "evaluate with data of the model's vocabulary"));
  }
  const std::int64_t targets = static_cast<std::int64_t>(batches) * lo.micro_batch_size * m.seq_length;
  const double ppl = std::exp(loss);
  if (a.json) {
    nlohmann::ordered_json j;
    j["checkpoint"] = dir.value();
    j["step"] = ck->info().next_step;
    j["data"] = a.data;
    j["device"] = device;
    j["batches"] = batches;
    j["batch_size"] = lo.micro_batch_size;
    j["seq_length"] = m.seq_length;
    j["targets"] = targets;
    j["trained_targets"] = trained;
    j["masked"] = data->masked();
    j["loss"] = loss;
    j["perplexity"] = ppl;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("eval %s (step %d) on %s, %s:\n", dir.value().c_str(), ck->info().next_step,
              a.data.c_str(), device.c_str());
  std::printf("  %d batches × %d × %d = %lld targets", batches, lo.micro_batch_size, m.seq_length,
              static_cast<long long>(targets));
  if (data->masked())
    std::printf(", %lld trained (instruction data: the loss is their mean)",
                static_cast<long long>(trained));
  std::printf("\n  loss %.6f  perplexity %.4f\n", loss, ppl);
  return 0;
}

const command_registrar reg{command{
    "eval", "Loss and perplexity of a checkpoint on token or instruction shards",
    [](CLI::App& app) {
      auto a = std::make_shared<eval_args>();
      app.add_option("checkpoint", a->checkpoint, "checkpoint directory or run directory")
          ->required();
      app.add_option("--data", a->data,
                     "token shards or instruction shards: a file, a folder of *.bin, or a glob")
          ->required();
      app.add_option("--batches", a->batches,
                     "evaluation micro-batches (default: the run's train.eval_batches)")
          ->check(CLI::PositiveNumber);
      app.add_option("--batch-size", a->batch_size,
                     "sequences per batch (default: the run's parallel.micro_batch_size)")
          ->check(CLI::Range(1, 1 << 16));
      app.add_option("--device", a->device, "cpu or cuda (default: the run's runtime.device)")
          ->check(CLI::IsMember({"cpu", "cuda"}));
      app.add_flag("--json", a->json, "print one JSON object instead of the summary");
      return [a] { return run_eval(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
