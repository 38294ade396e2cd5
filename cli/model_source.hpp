// The model a read-only command (`troupe generate`, `troupe eval`) runs: a Hugging Face model
// directory (config.json + safetensors, read by model/hf.hpp, the reader model.init uses) or a
// troupe checkpoint or run directory (its manifest's config). Both end in the same chunk, loaded
// by `load`, so every later step (forward, loss, sampling) is one code path for both sources.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "core/config.hpp"
#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"

namespace troupe::cli {

struct model_source {
  core::model_config model;          // the model: config.json's, or the checkpoint run's [model]
  std::optional<core::config> run;   // a troupe checkpoint's run config (none for a directory)
  std::string path;                  // the model directory, or the resolved checkpoint directory
  int step = -1;                     // a checkpoint's next step (-1 for a model directory)
  bool hf_dir = false;
  /// Loads the weights into a chunk built for `model` (or for it with a shorter seq_length, a
  /// model directory only). A LoRA checkpoint gets its frozen base from the run's starting point
  /// (seeded initialisation, or model.init) before its trainable weights are restored.
  std::function<core::status(kernels::backend&, const core::model_config&, model::chunk&)> load;
};

/// Opens `path` as a Hugging Face model directory when it holds a config.json and no
/// manifest.json, else as a troupe checkpoint or run directory.
core::result<model_source> open_model_source(const std::string& path);

}  // namespace troupe::cli
