// The run configuration: one TOML file parsed once into these plain structs (house rule 6); no
// toml:: type leaves core/. Every key, its default and its meaning is documented in
// configs/README.md. Keys follow the names users already write in mindformers/Megatron configs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace troupe::core {

enum class arch_kind { gpt2, llama };
enum class recompute_mode { none, full, selective };
enum class precision_kind { fp32, bf16, fp16 };

struct model_config {
  arch_kind arch = arch_kind::gpt2;
  int num_layers = 4;
  int hidden_size = 128;
  int num_heads = 4;
  int num_kv_heads = 0;        // 0 = num_heads (multi-head attention)
  int ffn_hidden_size = 0;     // 0 = 4*hidden (gpt2) or the LLaMA rule (multiple of 256 of 8/3*hidden)
  int seq_length = 64;
  int vocab_size = 50257;
  bool tie_embeddings = true;  // default: true for gpt2, false for llama (set during validation)
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  float init_std = 0.02f;

  int head_dim() const { return hidden_size / num_heads; }
  int kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
};

struct parallel_config {
  int data_parallel = 1;
  int model_parallel = 1;       // tensor parallel size
  int pipeline_stage = 1;
  int micro_batch_num = 1;
  int micro_batch_size = 1;
  int virtual_pipeline = 1;     // model chunks per pipeline rank (interleaved schedules)
};

struct schedule_config {
  std::string name = "1f1b";    // a registered generator or a schedule file
  std::string file;             // path of a custom schedule file (overrides name when set)
};

struct recompute_config {
  recompute_mode mode = recompute_mode::none;
};

struct precision_config {
  precision_kind compute = precision_kind::fp32;
  double loss_scale = 65536.0;  // fp16 initial dynamic loss scale
  int loss_scale_window = 1000; // good steps before the scale doubles
};

struct optimizer_config {
  double lr = 1e-3;
  double min_lr = 0.0;          // floor of the cosine decay
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  int zero_stage = 0;
  bool offload = false;
};

struct train_config {
  int steps = 100;
  int gradient_accumulation_steps = 1;
  std::uint64_t seed = 1234;
  double grad_clip = 1.0;       // 0 = no clipping
  int warmup_steps = 0;
  int log_interval = 1;
  int eval_interval = 0;        // 0 = only at the end
  int eval_batches = 4;
};

struct data_config {
  std::string train;            // token shard (llm.c format) or a directory / glob of shards
  std::string val;
  std::string tokenizer_dir;    // folder with encoder.json and vocab.bpe
};

struct checkpoint_config {
  std::string dir;              // "" = <run_dir>/checkpoints
  int interval = 0;             // 0 = only the final checkpoint
  int keep = 0;                 // 0 = keep all
};

struct runtime_config {
  std::string device = "cpu";   // cpu | cuda
  bool deterministic = true;
  std::string run_dir = "runs/latest";
  int threads = 0;              // 0 = all cores
  std::string fault_inject;     // test-only: "rank:step:instruction" makes that instruction throw
};

struct config {
  model_config model;
  parallel_config parallel;
  schedule_config schedule;
  recompute_config recompute;
  precision_config precision;
  optimizer_config optimizer;
  train_config train;
  data_config data;
  checkpoint_config checkpoint;
  runtime_config runtime;
  std::string source;           // file the config came from ("" for defaults)
};

/// Values derived from a config, printed by `troupe config check`.
struct derived_values {
  std::int64_t global_batch = 0;        // sequences per optimizer step
  std::int64_t tokens_per_step = 0;
  int workers = 0;                      // data × model × pipeline
  int layers_per_stage = 0;             // per pipeline rank
  std::int64_t parameters = 0;          // unique parameters (tied counted once)
};

/// Parse TOML text; `name` is the file name used in messages. Applies `overrides` ("a.b=value")
/// after parsing, then validates. Unknown keys, wrong types, out-of-range and inconsistent values
/// are errors naming file, line, column and key, with the nearest valid key as a hint.
result<config> parse_config(const std::string& text, const std::string& name,
                            const std::vector<std::string>& overrides = {});
/// Read and parse a file.
result<config> load_config(const std::string& path, const std::vector<std::string>& overrides = {});
/// Checks that need the file system (data files exist and have valid headers is the loader's job).
status check_files(const config& c);
/// Derived values of a validated config.
derived_values derive(const config& c);
/// Parameter count of the whole model (tied embeddings counted once).
std::int64_t parameter_count(const model_config& m);
/// The config as TOML text (resolved, every key), for run directories and checkpoints.
std::string to_toml(const config& c);

}  // namespace troupe::core
