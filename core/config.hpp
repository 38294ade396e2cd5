// The run configuration: one TOML file parsed once into these plain structs (docs/design.md, rule
// 6); no toml:: type leaves core/. Every key, its default and its meaning is documented in
// configs/README.md. Keys follow the names users already write in mindformers/Megatron configs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "core/error.hpp"

namespace troupe::core {

enum class arch_kind { gpt2, llama };
enum class recompute_mode { none, full, selective };
enum class precision_kind { fp32, bf16, fp16 };
enum class rope_scaling_kind { none, llama3 };

/// LoRA adapters and partial training ([lora], docs/finetune.md): which weights train. Base
/// weights that do not train are frozen: no gradient, no optimizer state, never sent.
struct lora_config {
  int rank = 0;                        // adapter rank r; 0 = no adapters
  double alpha = 0;                    // adapters add (alpha / rank) · B·A·x; default rank (validation)
  std::vector<std::string> targets;    // linear modules with adapters; default per family (validation)
  std::vector<std::string> trainable;  // base modules trained in full (with adapters: besides them)
  std::vector<std::string> freeze;     // base modules frozen, the rest trained (no adapters)

  /// Some base weights are frozen: adapters, or a subset trained in full.
  bool partial() const { return rank > 0 || !trainable.empty() || !freeze.empty(); }
  bool operator==(const lora_config&) const = default;
};

/// The linear modules a LoRA adapter may target in `arch` ("c_proj" names both GPT-2 projections,
/// "attn.c_proj" and "mlp.c_proj" one each).
const std::vector<std::string>& lora_target_names(arch_kind arch);
/// The base modules `lora.trainable` and `lora.freeze` may name in `arch`.
const std::vector<std::string>& lora_module_names(arch_kind arch);

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
  // RoPE frequency scaling (Hugging Face `rope_scaling`); llama only. llama3: wavelengths longer
  // than original_max_positions / low_freq_factor are stretched by `factor`, shorter than
  // original_max_positions / high_freq_factor kept, the band between interpolated smoothly.
  rope_scaling_kind rope_scaling = rope_scaling_kind::none;
  double rope_scaling_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int rope_original_max_positions = 8192;
  double norm_eps = 1e-5;
  float init_std = 0.02f;
  // Dropout in training (docs/training.md, Dropout); evaluation and generation never drop.
  float attention_dropout = 0;  // of the attention probabilities (HF attn_pdrop / attention_dropout)
  float hidden_dropout = 0;     // of the embedding output and both residual branches (HF
                                // resid_pdrop and embd_pdrop)
  lora_config lora;            // the [lora] table
  /// Weights to start from ("" = random init): a Hugging Face model directory or a troupe
  /// checkpoint (model/hf.hpp). Only the parameters are taken: step 0, fresh optimizer.
  std::string init;

  int head_dim() const { return hidden_size / num_heads; }
  int kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
  /// The feed-forward width: ffn_hidden_size, or the architecture's default when it is 0 (gpt2:
  /// 4*hidden; llama: 2/3 of 4*hidden, so SwiGLU's three matrices cost what two would, rounded up
  /// to a multiple of 256).
  int ffn_size() const {
    if (ffn_hidden_size > 0) return ffn_hidden_size;
    if (arch == arch_kind::gpt2) return 4 * hidden_size;
    return static_cast<int>((8LL * hidden_size / 3 + 255) / 256 * 256);
  }

  bool operator==(const model_config&) const = default;
  /// Same architecture and shapes (every field but `init`, where the weights come from, and the
  /// dropout rates, which are training settings).
  bool same_model(const model_config& o) const {
    model_config a = *this, b = o;
    a.init.clear();
    b.init.clear();
    a.attention_dropout = b.attention_dropout = 0;
    a.hidden_dropout = b.hidden_dropout = 0;
    return a == b;
  }
};

struct parallel_config {
  int data_parallel = 1;
  int model_parallel = 1;       // tensor parallel size
  // Sequence parallel (Megatron): with model_parallel > 1, norms, residuals and dropout hold
  // seq_length / model_parallel tokens per rank (docs/model.md, "Tensor and sequence parallel").
  bool sequence_parallel = false;
  int pipeline_stage = 1;
  int micro_batch_num = 1;
  int micro_batch_size = 1;
  int virtual_pipeline = 1;     // model chunks per pipeline rank (interleaved schedules)
  // Uneven pipeline stages (docs/training.md, "Pipeline splits"). Empty / 0 = every model chunk
  // holds num_layers / chunks layers. stage_layers: the layers of each chunk in model order (one
  // entry per chunk, pipeline_stage x virtual_pipeline; chunk c runs on pipeline rank c %
  // pipeline_stage). first/last_stage_layers: the layers of the first chunk (with the embedding)
  // and of the last (with the head), the rest spread evenly over the chunks between.
  std::vector<int> stage_layers;
  int first_stage_layers = 0;
  int last_stage_layers = 0;

  bool operator==(const parallel_config&) const = default;
};

struct schedule_config {
  std::string name = "1f1b";    // a registered generator or a schedule file
  std::string file;             // path of a custom schedule file (overrides name when set)

  bool operator==(const schedule_config&) const = default;
};

struct recompute_config {
  recompute_mode mode = recompute_mode::none;
  // Which layers `mode` applies to (the others keep every activation); both empty = every layer.
  int layers = 0;                // N > 0: the first N layers of each model chunk
  std::vector<int> layer_list;   // or these global layer indices
  // GPT-2: the last N layers of the model keep their GELU output for c_proj's weight gradient
  // instead of recomputing it from the kept pre-activation (0: every layer recomputes it).
  int keep_gelu = 0;

  bool operator==(const recompute_config&) const = default;
};

struct precision_config {
  precision_kind compute = precision_kind::fp32;
  double loss_scale = 65536.0;  // initial dynamic loss scale
  int loss_scale_window = 1000; // good steps before the scale doubles
  bool dynamic_loss_scale = false;  // default: true for fp16, false otherwise (set during validation)

  bool operator==(const precision_config&) const = default;
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

  bool operator==(const optimizer_config&) const = default;
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

  bool operator==(const train_config&) const = default;
};

struct data_config {
  std::string train;            // token shard (llm.c format) or a directory / glob of shards
  std::string val;
  std::string tokenizer;        // tokenizer.json, a folder holding one, or GPT-2's files' folder
  std::string tokenizer_dir;    // the older name: a folder (encoder.json + vocab.bpe, or tokenizer.json)

  /// The tokenizer the config names (data.tokenizer, else data.tokenizer_dir), or "".
  const std::string& tokenizer_spec() const { return tokenizer.empty() ? tokenizer_dir : tokenizer; }
  // How `troupe data prepare --config` turns JSONL instruction records into rows (model/instruct.hpp).
  std::string chat_template = "plain";  // data.template: "plain" or "llama3"
  bool packing = false;                 // several examples per row instead of one padded one

  bool operator==(const data_config&) const = default;
};

struct checkpoint_config {
  std::string dir;              // "" = <run_dir>/checkpoints
  int interval = 0;             // 0 = only the final checkpoint
  int keep = 0;                 // 0 = keep all

  bool operator==(const checkpoint_config&) const = default;
};

struct runtime_config {
  std::string device = "cpu";   // cpu | cuda
  bool deterministic = true;
  std::string run_dir = "runs/latest";
  int threads = 0;              // 0 = all cores
  std::string fault_inject;     // test-only: "rank:step:instruction" makes that instruction throw
  bool record = true;           // message logs in <run_dir>/messages/ (docs/replay.md)
  bool record_tensors = false;  // also the bytes of every tensor a worker receives from another
  int watchdog_s = 60;          // no progress this long: report who waits on whom and stop
  bool cuda_graph = true;       // single-rank CUDA training replays its step as a CUDA graph
  bool split_gpu = false;       // workers of one process on one GPU get disjoint shares of its SMs
  std::string gemm_tune_file;   // measured cuBLASLt algorithms, shared by runs ("" = heuristic)
  int report_interval = 0;      // rewrite <run_dir>/report.html every N steps (0 = never)
  // Step forensics (docs/faults.md): a step whose loss or gradient is not finite, or whose loss
  // jumps, is re-executed from the state before it; "stop" or "skip" is what a bad step that
  // reproduces bit for bit gets; "off" stops at once without re-executing.
  std::string forensics = "off";     // off | stop | skip
  double forensics_loss_jump = 0;    // > 1: a loss above this × the median of recent losses is
                                     // suspicious too; 0 = only non-finite values

  bool operator==(const runtime_config&) const = default;
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
  /// Where each key set by the file or by a `--set` override was written (absent = default), so
  /// that later checks can point at the line; an override's location has file "--set key=value".
  std::map<std::string, location> origins;

  /// Equal settings; `source` and `origins` (where the settings came from) are ignored.
  friend bool operator==(const config& a, const config& b);
};

/// Values derived from a config, printed by `troupe config check`.
struct derived_values {
  std::int64_t global_batch = 0;        // sequences per optimizer step
  std::int64_t tokens_per_step = 0;
  int workers = 0;                      // data × model × pipeline
  int layers_per_stage = 0;             // per pipeline rank (the largest, when uneven)
  std::vector<int> stage_layers;        // layers of each pipeline rank (its chunks summed)
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
/// The layers of each model chunk of a validated config, in model order (pipeline_stage x
/// virtual_pipeline entries summing to num_layers): parallel.stage_layers, or the first/last
/// offsets with the rest even, or an even split.
std::vector<int> chunk_layers(const config& c);
/// Which layers recompute (recompute.mode other than none; [num_layers], true = recompute): every
/// layer, the first recompute.layers of each chunk of chunk_layers(c), or recompute.layer_list.
/// All false when recompute.mode is none.
std::vector<bool> recompute_layers(const config& c);
/// Which layers keep their GELU output (recompute.keep_gelu; [num_layers], true = kept): the last
/// recompute.keep_gelu layers of the model, whatever the pipeline split.
std::vector<bool> keep_gelu_layers(const config& c);
/// Parameter count of the whole model (tied embeddings counted once).
std::int64_t parameter_count(const model_config& m);
/// The config as TOML text (resolved, every key), for run directories and checkpoints.
std::string to_toml(const config& c);

/// A config value as printed: integer, float, boolean or string (enums as their names).
using config_value = std::variant<std::int64_t, double, bool, std::string>;
/// One key of a config with its value and where the value came from.
struct config_entry {
  std::string key;     // dotted, e.g. "model.num_layers"
  config_value value;
  std::string origin;  // "file", "--set" or "default"
};
/// Every key a config accepts, in documentation order, with its value in `c` (keys that do not
/// apply to `c`, such as the llama3 rope factors without rope_scaling, left out).
std::vector<config_entry> config_entries(const config& c);
/// An error located where `key` was set in `c` (file, line, column; or the override), or at the
/// config file without a line when the key kept its default.
error config_error(const config& c, const std::string& key, std::string message, std::string hint = {});

}  // namespace troupe::core
