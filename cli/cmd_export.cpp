// `troupe export CHECKPOINT --out DIR [--dtype fp32|bf16] [--max-shard-size SIZE] [--tokenizer DIR]
//  [--merge-lora] [--peft DIR]`:
// writes a troupe checkpoint (a run, checkpoint root or step directory) as a Hugging Face model
// directory that transformers.AutoModelForCausalLM.from_pretrained(DIR) loads: config.json,
// generation_config.json, model.safetensors (shards and model.safetensors.index.json past the
// size limit) and the tokenizer files of the run's data.tokenizer_dir (model/hf.hpp).
#include <cstdio>
#include <string>

#include "cli/command.hpp"
#include "model/hf.hpp"
#include "model/lora.hpp"

namespace troupe::cli {
namespace {

struct export_args {
  std::string checkpoint;
  std::string out;
  std::string dtype = "fp32";
  std::string max_shard_size = "5GB";
  std::string tokenizer_dir;
  bool merge_lora = false;
  std::string peft_dir;
};

int fail(const core::error& e) {
  print_error(e.to_string());
  return 1;
}

int run_export(const export_args& a) {
  namespace hf = model::hf;
  if (a.dtype != "fp32" && a.dtype != "bf16")
    return fail(core::error::at_key("--dtype", "", 0, 0, "'" + a.dtype + "' is not an export dtype",
                                    "fp32 (the masters, bit for bit) or bf16"));
  auto shard = hf::parse_size(a.max_shard_size);
  if (!shard) {
    core::error e = shard.err();
    e.where.file = "--max-shard-size";
    return fail(e);
  }
  auto ck = hf::read_checkpoint(a.checkpoint);
  if (!ck) return fail(ck.err());
  auto& [cfg, params] = ck.value();
  const bool adapters = cfg.model.lora.rank > 0;
  if (!adapters && (a.merge_lora || !a.peft_dir.empty()))
    return fail(core::error::make(a.checkpoint + " holds no LoRA adapters (its [lora] rank is 0)",
                                  "export it without --merge-lora and --peft"));
  if (adapters && !a.peft_dir.empty()) {
    if (auto st = model::write_peft_adapter(cfg.model, params, a.peft_dir); !st)
      return fail(st.err());
    std::printf("wrote the LoRA adapters in PEFT's layout to %s\n", a.peft_dir.c_str());
  }
  if (adapters && !a.merge_lora) {
    if (!a.peft_dir.empty() && a.out.empty()) return 0;
    return fail(core::error::make(
        a.checkpoint + " holds LoRA adapters: a Hugging Face model directory has no place for them",
        "pass --merge-lora to fold them into the weights (W += alpha/rank * B A), and/or --peft "
        "DIR to write them in PEFT's layout"));
  }
  if (a.out.empty())
    return fail(core::error::make("--out is required", "pass --out DIR, the model directory to write"));
  // The weights exported are the checkpoint's, with the adapters folded in (--merge-lora).
  if (adapters) {
    auto merged = model::merge_lora(cfg.model, params);
    if (!merged) return fail(merged.err());
    params = std::move(merged.value());
    std::printf("merged the LoRA adapters (rank %d, alpha %g) into their weights\n",
                cfg.model.lora.rank, cfg.model.lora.alpha);
  }
  cfg.model = model::without_lora(cfg.model);
  core::config tok_cfg = cfg;
  if (!a.tokenizer_dir.empty()) {
    tok_cfg.data.tokenizer = a.tokenizer_dir;
    tok_cfg.data.tokenizer_dir.clear();
  }
  auto opt = hf::tokenizer_export(tok_cfg, cfg.model);
  if (!opt) return fail(opt.err());
  opt->dtype = a.dtype == "bf16" ? core::dtype::bf16 : core::dtype::f32;
  opt->max_shard_bytes = shard.value();
  if (auto st = hf::write_dir(a.out, cfg.model, params, opt.value()); !st) return fail(st.err());
  std::uint64_t elems = 0;
  for (const auto& [n, t] : params) elems += static_cast<std::uint64_t>(t.numel());
  std::printf("exported %zu tensors (%.2fM parameters, %s) to %s\n", params.size(), elems / 1e6,
              a.dtype.c_str(), a.out.c_str());
  if (opt->tokenizer.empty())
    std::printf("note: no tokenizer files written (the run's config names no data.tokenizer; "
                "pass --tokenizer DIR)\n");
  return 0;
}

const command_registrar reg{command{
    "export", "Write a checkpoint as a Hugging Face model directory (transformers loads it)",
    [](CLI::App& app) {
      auto a = std::make_shared<export_args>();
      app.add_option("checkpoint", a->checkpoint, "run, checkpoint root or step directory")
          ->required();
      app.add_option("--out", a->out,
                     "the model directory to write (required unless only --peft is wanted)");
      app.add_flag("--merge-lora", a->merge_lora,
                   "fold a LoRA run's adapters into their weights (W += alpha/rank * B A, fp32) "
                   "and write the merged model");
      app.add_option("--peft", a->peft_dir,
                     "also write a LoRA run's adapters in PEFT's layout (adapter_config.json, "
                     "adapter_model.safetensors) to this directory");
      app.add_option("--dtype", a->dtype, "fp32 (default: the masters bit for bit) or bf16");
      app.add_option("--max-shard-size", a->max_shard_size,
                     "largest safetensors file before the weights are sharded with an index "
                     "(default 5GB, as transformers)");
      app.add_option("--tokenizer", a->tokenizer_dir,
                     "tokenizer.json or tokenizer folder to copy from (default: the run's data.tokenizer)");
      return [a] { return run_export(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
