// `troupe import DIR --out CONFIG.toml [--seq-length N] [--force]`: writes a run config for
// fine-tuning the Hugging Face model in DIR: its [model] table from DIR/config.json,
// model.init = DIR, and training defaults for fine-tuning (small learning rate, no weight decay).
// The config is checked (parsed back) before it is written.
#include <cstdio>
#include <filesystem>
#include <string>

#include "cli/command.hpp"
#include "core/config.hpp"
#include "core/files.hpp"
#include "model/hf.hpp"

namespace troupe::cli {
namespace {

struct import_args {
  std::string dir;
  std::string out;
  int seq_length = 0;
  bool force = false;
};

int fail(const core::error& e) {
  print_error(e.to_string());
  return 1;
}

std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}

int run_import(const import_args& a) {
  auto m = model::hf::read_config(a.dir);
  if (!m) return fail(m.err());
  const int positions = m->seq_length;
  if (a.seq_length > 0) {
    if (a.seq_length > positions)
      return fail(core::error::at_key("--seq-length", "", 0, 0,
                                      std::to_string(a.seq_length) + " is above the model's " +
                                          std::to_string(positions) + " positions",
                                      "use at most " + std::to_string(positions)));
    m->seq_length = a.seq_length;
  }
  if (!a.force && std::filesystem::exists(a.out))
    return fail(core::error::at_file(a.out, "exists", "pass --force to replace it"));
  const bool gpt2 = m->arch == core::arch_kind::gpt2;
  std::string text =
      "# Written by `troupe import " + a.dir + "`: [model] matches its config.json (" +
      std::to_string(positions) +
      " positions; a shorter seq_length is allowed) and model.init starts from its weights\n"
      "# (step 0, fresh optimizer). Point [data] at token shards made with the model's tokenizer\n"
      "# (`troupe data prepare`). Every key: configs/README.md.\n\n" +
      model::hf::model_table_toml(m.value()) + "init = " + quoted(a.dir) +
      "\n\n"
      "[parallel]\n"
      "micro_batch_size = 4\n"
      "micro_batch_num = 4\n\n"
      "[optimizer]\n"
      "lr = 3e-5                  # fine-tuning: far below pre-training rates\n"
      "min_lr = 3e-6\n"
      "weight_decay = 0.0\n\n"
      "[train]\n"
      "steps = 100\n"
      "warmup_steps = 10\n"
      "eval_interval = 0\n"
      "eval_batches = 4\n\n"
      "[data]\n"
      "train = \"data/tokens/train.bin\"\n"
      "val = \"data/tokens/val.bin\"\n" +
      std::string(gpt2 ? "tokenizer_dir = \"data/gpt2\"\n" : "") +
      "\n[runtime]\n"
      "device = \"cpu\"\n"
      "run_dir = \"runs/finetune\"\n";
  auto check = core::parse_config(text, a.out);
  if (!check) return fail(check.err());
  if (auto st = core::write_file_atomic(a.out, text); !st) return fail(st.err());
  std::printf("wrote %s: %s, %d layers, hidden %d, seq_length %d, model.init = %s\n", a.out.c_str(),
              gpt2 ? "gpt2" : "llama", m->num_layers, m->hidden_size, m->seq_length, a.dir.c_str());
  return 0;
}

const command_registrar reg{command{
    "import", "Write a fine-tuning config for a Hugging Face model directory (model.init = DIR)",
    [](CLI::App& app) {
      auto a = std::make_shared<import_args>();
      app.add_option("dir", a->dir, "Hugging Face model directory (config.json + model.safetensors)")
          ->required();
      app.add_option("--out", a->out, "config file to write")->required();
      app.add_option("--seq-length", a->seq_length,
                     "model.seq_length (default: the model's positions; shorter is allowed)")
          ->check(CLI::PositiveNumber);
      app.add_flag("--force", a->force, "replace --out if it exists");
      return [a] { return run_import(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
