// Checkpoints: a directory per saved step (e.g. <root>/step_000300/) holding safetensors shard
// files and a manifest.json, plus a `latest` file in <root> naming the newest one.
//
//   manifest.json  {"format": "troupe-checkpoint", "version": 1,
//                   "step": 300,                        // optimizer steps completed
//                   "data_position": {"next_step": 300}, // the loader cut to continue from
//                   "seed": 1234,
//                   "config": "<resolved TOML>",
//                   "base": {"source", "xxh64"},        // only with frozen weights ([lora])
//                   "files":   [{"path", "kind": "model"|"optimizer", "bytes", "xxh64"}, ...],
//                   "tensors": {"<name>": {"file", "dtype", "shape", "xxh64"}, ...}}
//
// Parameters are stored by their Hugging Face names (model files), AdamW moments as
// "<name>.exp_avg" / "<name>.exp_avg_sq" (optimizer files). The tied LM-head copy of GPT-2 is not
// stored (Hugging Face GPT-2 ties it too); loading copies the embedding into it. Because loading
// goes by name through the manifest, a checkpoint written as one file per pipeline stage loads
// into any other split, and vice versa: `files` may list any number of shards of each kind.
//
// Crash safety: everything is written into a hidden temporary directory, every file fsynced, the
// directory renamed into place and the parent fsynced; `latest` is replaced the same way. Loading
// verifies every file's and tensor's xxhash64, so a truncated or tampered checkpoint is refused
// with a message naming the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"
#include "model/optimizer.hpp"
#include "model/safetensors.hpp"

namespace troupe::model::checkpoint {

inline constexpr int format_version = 1;

/// One file to write: its name inside the checkpoint directory, its kind ("model" or
/// "optimizer") and its tensors (host tensors).
struct shard_spec {
  std::string file;
  std::string kind;
  std::vector<safetensors::named_tensor> tensors;
};

/// Everything a checkpoint records.
struct save_request {
  int step = 0;                 // optimizer steps completed; also the next step to run
  std::uint64_t seed = 0;
  std::string config_toml;      // core::to_toml of the run's config
  std::vector<shard_spec> shards;
  /// The frozen base weights the trainable ones belong to ([lora]; model::base_identity): where
  /// they came from and their hash. Empty when every weight trains (no "base" in the manifest).
  std::string base_source;
  std::string base_xxh64;
  /// Test only (TROUPE_FAULT=enospc, core/fault.hpp): the write of shards[full_at_shard] finds the
  /// disk full halfway through its tensors' bytes. -1 = never.
  int full_at_shard = -1;
};

/// "step_000300".
std::string dir_name(int step);

/// Writes <root>/step_NNNNNN atomically (replacing an older one of the same step), updates
/// <root>/latest, then deletes the oldest step directories beyond `keep` (0 = keep all).
/// Returns the checkpoint directory. On failure (a full disk, ...) the error names the file; the
/// partly written temporary directory is removed and every earlier checkpoint and `latest` are
/// left as they were.
core::result<std::string> save(const std::string& root, const save_request& req, int keep = 0);

struct file_record {
  std::string path;  // relative to the checkpoint directory
  std::string kind;
  std::uint64_t bytes = 0;
  std::uint64_t xxh64 = 0;
};

struct tensor_record {
  std::string file;
  std::string dtype;
  core::shape_t shape;
  std::uint64_t xxh64 = 0;
};

struct manifest {
  int version = 0;
  int step = 0;
  int next_step = 0;
  std::uint64_t seed = 0;
  std::string config_toml;
  std::string base_source, base_xxh64;  // "" when the manifest names no frozen base
  std::vector<file_record> files;
  std::map<std::string, tensor_record> tensors;
};

/// Parses the text of a manifest.json (`path` names it in errors): its format, version and every
/// field's type and range. The files and tensors it lists are checked by reader::open.
core::result<manifest> parse_manifest(std::string_view text, const std::string& path);

/// The checkpoint directory `path` names: a checkpoint directory itself (it has manifest.json),
/// a checkpoint root with a `latest` file, or a run directory whose checkpoints/ has one.
core::result<std::string> resolve(const std::string& path);

class reader;

/// Opens the checkpoint `path` names (see resolve) for resuming. When `path` is a checkpoint root
/// or run directory and the newest checkpoint there cannot be read (missing or corrupt files,
/// wrong hashes), the next older step_* directory that reads whole is used instead; each one
/// passed over is described in `skipped` (the file, tensor and why). A checkpoint directory named
/// directly is used as it is or not at all.
core::result<reader> open_for_resume(const std::string& path, std::vector<std::string>* skipped);

/// An opened, verified checkpoint.
class reader {
 public:
  /// Reads the manifest, maps every file and checks sizes, headers and hashes against it.
  static core::result<reader> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const manifest& info() const { return manifest_; }
  bool contains(const std::string& name) const { return manifest_.tensors.count(name) > 0; }
  /// Host copy of tensor `name` (its hash was verified at open).
  core::result<core::tensor> load(const std::string& name) const;

 private:
  std::string dir_;
  manifest manifest_;
  std::map<std::string, std::shared_ptr<safetensors::file>> files_;
};

/// Host views (CPU backend) or copies (device backends) of the chunk's stored parameters (tied
/// copies left out) and, when `state` is given, of their AdamW moments.
shard_spec model_shard(kernels::backend& be, chunk& c, std::string file = "model.safetensors");
shard_spec optimizer_shard(kernels::backend& be, chunk& c, optimizer_state& state,
                           std::string file = "optimizer.safetensors");

/// Loads every parameter of `c` (and, when `state` is not null, its moments) by name from `ck`:
/// shapes must match; a tied head copy takes the embedding (model::embedding_name). Calls
/// c.params_updated().
core::status restore(const reader& ck, kernels::backend& be, const core::model_config& cfg,
                     chunk& c, optimizer_state* state);

}  // namespace troupe::model::checkpoint
