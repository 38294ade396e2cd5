// Parameter naming, layout and initialisation of a model chunk. Names are the Hugging Face ones
// (GPT-2: "wte.weight", "h.3.attn.c_attn.weight", ...; LLaMA: "model.embed_tokens.weight",
// "model.layers.3.self_attn.q_proj.weight", ...), so checkpoints export without a name map.
// Every tensor starts at a multiple of kernels::norm_block in the flat buffer: a tensor's place in
// its block grid does not depend on which other tensors share the chunk, which keeps grad-norm
// partial sums and ZeRO shards split-invariant.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "model/chunk.hpp"
#include "model/layer.hpp"

namespace troupe::model {

/// MLP width: cfg.ffn_hidden_size, or when 0 the family's rule (model_config::ffn_size: GPT-2
/// 4C; LLaMA 8C/3 rounded up to a multiple of 256, as in Meta's reference code).
int ffn_hidden(const core::model_config& cfg);

/// How a parameter is initialised.
enum class init_rule {
  normal,    // N(0, init_std)
  residual,  // N(0, init_std / sqrt(2 * num_layers)): projections that write into the residual
  ones,      // norm weights
  zeros,     // biases, LoRA B
  lora_a,    // LoRA A [r, in]: uniform in ±1/sqrt(in), PEFT's kaiming_uniform(a = sqrt(5))
};

/// A parameter with its place in the flat buffer and its initialisation.
struct param_def {
  param_info info;
  init_rule rule = init_rule::normal;
  std::string stream_name;  // whose random stream it draws from (the embedding's for a tied head)
};

/// Every trainable parameter of the chunk (the flat_params() buffer), in flat-buffer order,
/// offsets assigned: all base parameters without a [lora] table; with one, the LoRA adapters and
/// the base parameters cfg.lora lets train; at tensor-parallel degree `tp` (before
/// shard_defs). Where shares_head(cfg, spec, tp) the tied head has no parameter of its own.
std::vector<param_def> define_params(const core::model_config& cfg, const chunk_spec& spec,
                                     int tp = 1);
/// Whether a chunk of `spec` at tensor-parallel degree `tp` holds both uses of a trained tied
/// embedding and its head reads the embedding itself (chunk::shares_head): never under tensor
/// parallel, whose vocabulary-parallel head keeps its slice.
bool shares_head(const core::model_config& cfg, const chunk_spec& spec, int tp);
/// The chunk's frozen base parameters (the flat_frozen() buffer), offsets in that buffer; empty
/// without a [lora] table.
std::vector<param_def> define_frozen_params(const core::model_config& cfg, const chunk_spec& spec);
/// Whether base parameter `name` trains under cfg.lora. A tied embedding and its head copy are one
/// weight: naming either module in lora.trainable trains both, in lora.freeze freezes both.
bool base_trainable(const core::model_config& cfg, const std::string& name);
/// The factor the adapters' output is scaled by: lora.alpha / lora.rank (0 without adapters).
float lora_scale(const core::model_config& cfg);
/// Whether the tied embedding's two gradients exist (tie_embeddings and the embedding trains).
bool tied_gradients(const core::model_config& cfg);
/// "<module>.lora_A.weight" / "<module>.lora_B.weight" for a base weight "<module>.weight".
std::string lora_a_name(const std::string& weight_name);
std::string lora_b_name(const std::string& weight_name);
/// Elements of the flat buffer that holds `defs` (the last tensor padded to a whole block).
std::int64_t flat_numel(const std::vector<param_def>& defs);
/// Writes the initial value of `def` (numel floats) into `out`.
void init_param(const param_def& def, const core::model_config& cfg, std::uint64_t seed,
                float* out);

/// The rotary frequencies of a llama config (rope_theta and rope_scaling).
kernels::rope_spec rope_of(const core::model_config& cfg);

/// Name of the embedding table ("wte.weight" or "model.embed_tokens.weight").
std::string embedding_name(const core::model_config& cfg);

/// The views of global layer `layer` looked up by name through `view`.
layer_tensors layer_views(const core::model_config& cfg, int layer,
                          const std::function<tensor(const std::string&)>& view);
/// The final norm and the LM head looked up by name.
head_tensors head_views(const core::model_config& cfg,
                        const std::function<tensor(const std::string&)>& view);
/// The token (and GPT-2 position) embedding looked up by name.
embedding_tensors embedding_views(const core::model_config& cfg,
                                  const std::function<tensor(const std::string&)>& view);

}  // namespace troupe::model
