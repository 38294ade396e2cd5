// `troupe train CONFIG [--set key=value]... [--resume RUN_DIR|CKPT_DIR] [--init DIR] [--steps N]
// [--single-rank]`:
// trains the job as actors (runtime/runtime.hpp): every stage, optimizer shard, data loader and the
// checkpoint writer of the data_parallel × pipeline_stage layout, in this process. --single-rank
// runs the plain loop of model/trainer.hpp instead — the oracle the actors match bit for bit.
// With --resume and no CONFIG, the config saved in the checkpoint is used (--set applies on top).
// --init DIR is --set model.init=DIR: start from those weights (docs/finetune.md).
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "runtime/preflight.hpp"
#include "runtime/runtime.hpp"
#include "cli/command.hpp"
#include "cli/plan_check.hpp"
#include "cli/live_report.hpp"
#include "core/config.hpp"
#include "core/machine.hpp"
#include "model/checkpoint.hpp"
#include "model/trainer.hpp"

namespace troupe::cli {
namespace {

struct train_args {
  std::string config;
  std::vector<std::string> sets;
  std::string resume;
  std::string init;
  int steps = -1;
  bool single_rank = false;
  std::string device_memory;  // for the plan check (cli/plan_check.hpp)
  bool no_plan_check = false;
};

core::result<core::config> resolve_config(const train_args& a) {
  if (!a.config.empty()) return core::load_config(a.config, a.sets);
  auto dir = model::checkpoint::resolve(a.resume);
  if (!dir) return dir.err();
  auto ck = model::checkpoint::reader::open(dir.value());
  if (!ck) return ck.err();
  return core::parse_config(ck->info().config_toml, dir.value() + "/manifest.json", a.sets);
}

int run_train(const train_args& a) {
  if (a.config.empty() && a.resume.empty()) {
    print_error(core::error::make("train needs a CONFIG file",
                                  "troupe train configs/tiny.toml, or --resume RUN_DIR to continue "
                                  "with the config saved in its checkpoint")
                    .to_string());
    return 2;
  }
  if (!a.init.empty() && !a.resume.empty()) {
    print_error(core::error::make("--init and --resume together",
                                  "--init starts a fresh run from weights (step 0, new optimizer); "
                                  "--resume continues a run with its optimizer: pass one")
                    .to_string());
    return 2;
  }
  auto cfg = resolve_config(a);
  if (!cfg) {
    print_error(cfg.err().to_string());
    return 1;
  }
  core::raise_open_file_limit();
  const auto& par = cfg->parallel;
  const int workers = a.single_rank ? 1 : par.data_parallel * par.pipeline_stage;
  if (auto st = core::check_local_workers(
          cfg.value(), workers, false,
          fmt::format("data_parallel {} x pipeline_stage {} = {} workers in this process",
                      par.data_parallel, par.pipeline_stage, workers));
      !st) {
    print_error(st.err().to_string());
    return 1;
  }
  if (auto st = actors::preflight(cfg.value()); !st) {
    print_error(st.err().to_string());
    return 1;
  }
  if (!a.no_plan_check)
    if (int rc = check_plan(cfg.value(), a.device_memory, false)) return rc;
  core::result<model::train_summary> summary = core::error::make("not run");
  std::shared_ptr<report::live_report> live;  // runtime.report_interval
  if (a.single_rank) {
    model::train_options opt;
    opt.resume = a.resume;
    opt.max_steps = a.steps;
    live = attach_live_report(cfg.value(), opt.step_hooks);
    summary = model::train_single_rank(cfg.value(), opt);
  } else {
    actors::run_options opt;
    opt.resume = a.resume;
    opt.max_steps = a.steps;
    live = attach_live_report(cfg.value(), opt.step_hooks);
    summary = actors::run_actor_job(cfg.value(), opt);
  }
  finish_live_report(live);
  if (!summary) {
    print_error(summary.err().to_string());
    explain_out_of_memory(cfg.value(), summary.err().to_string(), a.device_memory, false);
    return 1;
  }
  const auto& s = summary.value();
  if (s.end_step > s.first_step) {
    std::printf("done: %d steps in %.1f s", s.end_step - s.first_step, s.seconds);
    if (!s.losses.empty()) std::printf(", final loss %.4f", s.losses.back());
    if (s.final_val_loss) std::printf(", val loss %.4f", *s.final_val_loss);
    std::printf("\n  metrics: %s/metrics.jsonl\n", cfg->runtime.run_dir.c_str());
  }
  return 0;
}

const command_registrar reg{command{
    "train", "Train a model from a TOML config: every stage, optimizer shard and loader as an actor", [](CLI::App& app) {
      auto a = std::make_shared<train_args>();
      app.add_option("config", a->config, "run configuration (TOML); optional with --resume");
      app.add_option("--set", a->sets,
                     "override a config key, e.g. --set train.steps=50 (repeatable)")
          ->allow_extra_args(false);
      app.add_option("--resume", a->resume,
                     "continue from a run directory or checkpoint directory, bit for bit");
      app.add_option("--init", a->init,
                     "start from the weights of a Hugging Face model directory or a troupe "
                     "checkpoint (= --set model.init=DIR): step 0, fresh optimizer");
      app.add_option("--steps", a->steps,
                     "stop after N steps in this invocation (the learning-rate schedule still "
                     "spans train.steps)")
          ->check(CLI::NonNegativeNumber);
      app.add_option("--device-memory", a->device_memory,
                     "bytes of the device for the plan check, e.g. 80GiB (default: the GPU's own "
                     "size on CUDA; no check on the CPU)");
      app.add_flag("--no-plan-check", a->no_plan_check,
                   "start even when `troupe plan` says the layout does not fit");
      app.add_flag("--single-rank", a->single_rank,
                   "run the plain single-rank loop (the reference the actor runtime matches bit "
                   "for bit) over the same global batch");
      return [a] {
        if (!a->init.empty()) a->sets.push_back("model.init=" + a->init);
        return run_train(*a);
      };
    }}};

}  // namespace
}  // namespace troupe::cli
