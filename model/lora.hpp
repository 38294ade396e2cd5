// LoRA outside the training loop: folding adapters into their base weights (a merged model that
// needs no [lora] table), and writing the adapters in PEFT's layout so that Hugging Face PEFT
// users can load them. Inside the loop, adapters are ordinary trainable parameters of a chunk
// (model/params.hpp names them "<module>.lora_A.weight" [r, in] and "<module>.lora_B.weight"
// [out, r]) and the layers add (alpha / r)·(x·Aᵀ)·Bᵀ to the module's output (model/lora_layer.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"

namespace troupe::model {

/// The frozen base weights of a config ([lora]) named for a checkpoint's manifest: where they
/// come from ("seed 1234") and the xxh64 of their values (each frozen tensor's hash, by name, hashed
/// together), made on the host one tensor at a time. Both training loops record it and
/// `--resume` compares it, so adapters are never continued on another base.
struct base_identity {
  std::string source;
  std::string xxh64;  // 16 hex digits; "" when every weight trains
};
base_identity identify_base(const core::config& cfg);

/// Named host fp32 tensors: a model's parameters by their troupe (Hugging Face) names.
using named_tensors = std::map<std::string, core::tensor>;

/// Every parameter of `chunks` — trainable and frozen, adapters included, the tied head copy too —
/// as host fp32 copies by name.
named_tensors gather_parameters(std::vector<chunk>& chunks, kernels::backend& be);

/// The model without adapters: for every adapter of module M, M.weight + (alpha / rank) ·
/// M.lora_B.weight · M.lora_A.weight (products summed in double, each weight rounded once to
/// fp32), adapters dropped. Errors name a missing or misshapen tensor.
core::result<named_tensors> merge_lora(const core::model_config& cfg, const named_tensors& params);

/// The config of the merged model: `cfg` with its [lora] table removed.
core::model_config without_lora(const core::model_config& cfg);

/// PEFT's name of an adapter tensor: "base_model.model." + the module's path in transformers'
/// model class + ".lora_A.weight" (GPT-2 modules sit under "transformer.").
std::string peft_name(const core::model_config& cfg, const std::string& troupe_name);

/// Writes `dir`/adapter_config.json and `dir`/adapter_model.safetensors (fp32) holding the
/// adapters of `params` under PEFT's names. Refuses a model that trains base modules in full
/// (lora.trainable): PEFT adapters hold adapters only; merge such a model instead.
core::status write_peft_adapter(const core::model_config& cfg, const named_tensors& params,
                                const std::string& dir);

}  // namespace troupe::model
