// Hugging Face model directories in and out (docs/finetune.md).
//
// In: a directory with config.json and model.safetensors, or shards listed by
// model.safetensors.index.json ({"weight_map": {tensor: file}}), as `save_pretrained` writes it.
// Supported model types: "gpt2" (GPT2LMHeadModel: Conv1D weights stored [in, out] are transposed
// to troupe's [out, in]; names with or without the "transformer." prefix) and "llama"
// (LlamaForCausalLM: grouped-query attention, rope_theta, rope_scaling of type "llama3",
// rms_norm_eps, tie_word_embeddings, no biases). F32, BF16 and F16 tensors become fp32 masters.
// Keys config.json leaves out take the transformers class defaults (GPT2Config, LlamaConfig).
// A troupe checkpoint is a weights source too (by troupe name, its manifest's [model]).
//
// Contract: nothing loads partially. A source is opened against the run's [model] table, which
// must describe the same model (seq_length may be shorter than the source's positions: GPT-2's
// position table is cut to its first rows); every tensor a chunk needs must be present with the
// shape the model needs. Every refusal names the file, the key or tensor, and what is supported.
//
// Out: write_dir turns troupe-named fp32 parameters into a directory that
// transformers.AutoModelForCausalLM.from_pretrained loads without missing or unexpected keys:
// config.json, generation_config.json, model.safetensors (or shards and an index past
// max_shard_bytes) and the tokenizer files.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"

namespace troupe::model::hf {

/// True when `dir` holds a config.json (a Hugging Face model directory).
bool is_model_dir(const std::string& dir);

/// <dir>/config.json as a troupe model config: seq_length is the checkpoint's positions
/// (n_positions / max_position_embeddings), init_std its initializer_range. The dropout rates
/// (attn_pdrop, resid_pdrop, embd_pdrop; LLaMA's attention_dropout) are not read: they describe the
/// run that trained the weights, not the weights, and a fine-tuning run chooses its own
/// (model.attention_dropout, model.hidden_dropout; docs/finetune.md).
core::result<core::model_config> read_config(const std::string& dir);

/// An error when `cfg` (the run's [model] table, read from `cfg_file`) does not describe the model
/// `source` (read from `source_file`) holds; cfg.seq_length may be below source.seq_length.
core::status check_same_model(const core::model_config& source, const std::string& source_file,
                              const core::model_config& cfg, const std::string& cfg_file);

/// Parameters by troupe name from a Hugging Face directory or a troupe checkpoint.
class weights {
 public:
  /// Opens `path` (a Hugging Face model directory, or a troupe run / checkpoint directory) for the
  /// model `cfg` describes; checks the source describes the same model (check_same_model) and
  /// that every tensor file is readable. `cfg_file` names where cfg came from, for messages.
  static core::result<std::shared_ptr<const weights>> open(const std::string& path,
                                                           const core::model_config& cfg,
                                                           const std::string& cfg_file = {});
  ~weights();

  /// The source's own model config.
  const core::model_config& source_config() const;
  /// What was opened: the model directory or the checkpoint directory.
  const std::string& path() const;
  /// Parameter `name` (troupe naming and [out, in] layout) as an fp32 host tensor of `shape`.
  /// The LM head of a tied model is the embedding; GPT-2's position table is cut to shape[0] rows.
  core::result<core::tensor> load(const std::string& name, const core::shape_t& shape) const;

  struct impl;

 private:
  explicit weights(std::unique_ptr<impl> p);
  std::unique_ptr<impl> p_;
};

/// Copies every base parameter of `c` from `w` — trainable and, under [lora], frozen; tied head
/// copies included; LoRA adapters keep their initialisation — and calls c.params_updated().
/// Loads only the chunk's own tensors.
core::status load_chunk(const weights& w, kernels::backend& be, const core::model_config& cfg,
                        chunk& c);

/// The frozen base of a LoRA chunk restored from a checkpoint (which holds the trainable weights
/// only): when cfg.model.init is set and `c` has frozen weights, loads them (with load_chunk)
/// from there; otherwise leaves the seeded initialisation already in `c`. Call before restoring
/// the checkpoint into `c`.
core::status load_frozen_base(const core::config& cfg, kernels::backend& be, chunk& c);

/// Troupe-named fp32 host parameters of a whole model, the tied LM-head copy left out (as a
/// checkpoint stores them). The transformation point of `troupe export`: whatever rewrites
/// weights before export (e.g. folding adapters in) maps one of these to another.
using param_map = std::map<std::string, core::tensor>;

/// A tokenizer file to place next to exported weights: `source` copied as `name`.
struct tokenizer_file {
  std::string source;
  std::string name;
};

/// Special token ids written to config.json / generation_config.json (-1 = unknown, left out).
struct special_tokens {
  int bos = -1;
  int eos = -1;
  int pad = -1;
};

struct export_options {
  core::dtype dtype = core::dtype::f32;           // f32 or bf16
  std::uint64_t max_shard_bytes = 5'000'000'000;  // transformers' default max_shard_size "5GB"
  std::vector<tokenizer_file> tokenizer;          // copied as given
  special_tokens tokens;
  std::string tokenizer_class;                    // tokenizer_config.json's, "" = none written
};

/// The tokenizer files of a run's data.tokenizer (or data.tokenizer_dir) (model/text_tokenizer.hpp) and the special
/// tokens it defines: its tokenizer.json, and GPT-2's encoder.json and vocab.bpe as the vocab.json
/// and merges.txt transformers reads. Empty when the config names none.
core::result<export_options> tokenizer_export(const core::config& run, const core::model_config& m);

/// "5GB", "500MB", "10GiB", "1000" (bytes) as bytes; decimal units as transformers reads them.
core::result<std::uint64_t> parse_size(const std::string& text);

/// Every parameter of the model a troupe checkpoint directory (see checkpoint::resolve) holds,
/// with its config; fp32 host tensors. Under [lora] that is the trainable weights from the
/// checkpoint (adapters included) and the frozen base as the run started from it.
core::result<std::pair<core::config, param_map>> read_checkpoint(const std::string& path);

/// Writes a Hugging Face model directory `dir` (created; files in it replaced) from `params`.
/// REQUIRES: params hold every stored parameter of m (checked: a missing one is an error).
core::status write_dir(const std::string& dir, const core::model_config& m, const param_map& params,
                       const export_options& opt);

/// The [model] table of a config for `m` (keys in documentation order), as TOML text.
std::string model_table_toml(const core::model_config& m);

}  // namespace troupe::model::hf
