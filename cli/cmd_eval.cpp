// `troupe eval CHECKPOINT|DIR --data FILE [--batches N] [--batch-size B] [--seq-length T]
// [--device cpu|cuda] [--json]`: the loss and perplexity of a checkpoint's model, or of a Hugging
// Face model directory's (read as model.init reads it, cli/model_source.hpp), on token shards or
// instruction shards. The
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
#include "cli/model_source.hpp"
#include "core/config.hpp"
#include "kernels/select.hpp"
#include "model/instruction_shards.hpp"
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
  int seq_length = 0;  // 0: the run's model.seq_length (a model directory: see run_eval)
  std::string device;  // "": the run's runtime.device
  bool json = false;
};

int fail(const core::error& e) {
  print_error(e.to_string());
  return 1;
}

int run_eval(const eval_args& a) {
  auto src = open_model_source(a.checkpoint);
  if (!src) return fail(src.err());
  // A checkpoint evaluates as its run did (its [model], batch size, eval_batches, device,
  // threads); a model directory has no run, so the defaults of a config stand in, and the
  // sequence length is --seq-length, else the instruction shards' rows, else the model's positions.
  core::config cfg = src->run ? *src->run : core::config{};
  core::model_config m = src->model;
  if (!src->run) {
    auto paths = model::resolve_shards(a.data);
    if (!paths) return fail(paths.err());
    if (a.seq_length > 0) {
      if (a.seq_length > m.seq_length)
        return fail(core::error::at_file(
            src->path + "/config.json",
            "--seq-length " + std::to_string(a.seq_length) + " is longer than the model's " +
                std::to_string(m.seq_length) + " positions",
            "evaluate with --seq-length " + std::to_string(m.seq_length) + " or less"));
      m.seq_length = a.seq_length;
    } else if (model::is_instruction_shard(paths->front())) {
      auto rows = model::instruction_shard::open(paths->front());
      if (!rows) return fail(rows.err());
      const int t = rows->layout().row_tokens - 1;
      if (t > m.seq_length)
        return fail(core::error::at_file(
            paths->front(),
            "holds rows of " + std::to_string(t + 1) + " tokens (prepared for seq_length " +
                std::to_string(t) + "), longer than the model's " + std::to_string(m.seq_length) +
                " positions (" + src->path + "/config.json)",
            "prepare the data with a model.seq_length of " + std::to_string(m.seq_length) +
                " or less"));
      m.seq_length = t;
    }
    cfg.model = m;
  } else if (a.seq_length > 0 && a.seq_length != m.seq_length) {
    return fail(core::error::make(
        "--seq-length " + std::to_string(a.seq_length) + " for the checkpoint " + src->path +
            ", whose run has model.seq_length " + std::to_string(m.seq_length),
        "a checkpoint evaluates at its run's seq_length; export it (troupe export) to evaluate "
        "the model at another length"));
  }
  const std::string device = a.device.empty() ? cfg.runtime.device : a.device;
  const int batches = a.batches > 0 ? a.batches : cfg.train.eval_batches;

  model::loader_options lo = model::loader_options::from(cfg);
  if (a.batch_size > 0) lo.micro_batch_size = a.batch_size;
  auto data = model::loader::open(a.data, lo);
  if (!data) return fail(data.err());

  kernels::set_cpu_threads(cfg.runtime.threads);
  std::unique_ptr<kernels::backend> be;
  try {
    be = kernels::make_backend(device);
  } catch (const std::exception& e) {
    return fail(core::error::make(std::string("--device ") + device + ": " + e.what(),
                                  "--device cpu runs anywhere"));
  }
  model::chunk net(m, model::partition(m, 1)[0], *be, cfg.precision.compute);
  if (auto st = src->load(*be, m, net); !st) return fail(st.err());

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
  const std::string what = src->hf_dir ? "model" : "checkpoint";
  if (a.json) {
    nlohmann::ordered_json j;
    j[what] = src->path;
    if (!src->hf_dir) j["step"] = src->step;
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
  if (src->hf_dir)
    std::printf("eval %s (Hugging Face model directory) on %s, %s:\n", src->path.c_str(),
                a.data.c_str(), device.c_str());
  else
    std::printf("eval %s (step %d) on %s, %s:\n", src->path.c_str(), src->step, a.data.c_str(),
                device.c_str());
  std::printf("  %d batches × %d × %d = %lld targets", batches, lo.micro_batch_size, m.seq_length,
              static_cast<long long>(targets));
  if (data->masked())
    std::printf(", %lld trained (instruction data: the loss is their mean)",
                static_cast<long long>(trained));
  std::printf("\n  loss %.6f  perplexity %.4f\n", loss, ppl);
  return 0;
}

const command_registrar reg{command{
    "eval", "Loss and perplexity of a checkpoint or Hugging Face model directory on token or instruction shards",
    [](CLI::App& app) {
      auto a = std::make_shared<eval_args>();
      app.add_option("checkpoint", a->checkpoint,
                     "checkpoint directory, run directory, or Hugging Face model directory")
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
      app.add_option("--seq-length", a->seq_length,
                     "tokens per sequence, a model directory only (default: the instruction "
                     "shards' rows, else the model's positions)")
          ->check(CLI::PositiveNumber);
      app.add_option("--device", a->device, "cpu or cuda (default: the run's runtime.device)")
          ->check(CLI::IsMember({"cpu", "cuda"}));
      app.add_flag("--json", a->json, "print one JSON object instead of the summary");
      return [a] { return run_eval(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
