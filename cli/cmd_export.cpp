// `troupe export CHECKPOINT --out DIR [--dtype fp32|bf16] [--max-shard-size SIZE] [--tokenizer DIR]`:
// writes a troupe checkpoint (a run, checkpoint root or step directory) as a Hugging Face model
// directory that transformers.AutoModelForCausalLM.from_pretrained(DIR) loads: config.json,
// generation_config.json, model.safetensors (shards and model.safetensors.index.json past the
// size limit) and the tokenizer files of the run's data.tokenizer_dir (model/hf.hpp).
#include <cstdio>
#include <string>

#include "cli/command.hpp"
#include "model/hf.hpp"

namespace troupe::cli {
namespace {

struct export_args {
  std::string checkpoint;
  std::string out;
  std::string dtype = "fp32";
  std::string max_shard_size = "5GB";
  std::string tokenizer_dir;
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
  // The weights exported are the checkpoint's; a rewrite of them (e.g. folding LoRA adapters in)
  // maps `params` to the tensors to write here, before the options below.
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
      app.add_option("--out", a->out, "the model directory to write")->required();
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
