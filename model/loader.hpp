// Cuts micro-batches out of memory-mapped token shards as a pure function of
// (seed, step, data-parallel rank, micro-batch), so that every schedule, pipeline split and rank
// count sees the same sequences (docs/design.md, Determinism contract).
//
// Contract. With B = micro_batch_size and M = micro-batches per replica per step
// (micro_batch_num × gradient_accumulation_steps), sequence i of micro-batch `mb` on replica
// `dp_rank` has the global index k = (dp_rank·M + mb)·B + i within its step, and starts at
//   start(k) = core::rng_stream(core::stream_key(seed, 0xda7a, step, k)).below(windows)
// where `windows` counts the T+1-token windows of the shards (a shard of n tokens has n − T; the
// shards' windows are numbered in the order given, so no sequence straddles two shards). Replica r
// of DP=d and M micro-batches therefore holds the same sequences as micro-batches r·M … r·M+M−1 of
// one replica with d·M micro-batches: changing data_parallel at a fixed global batch changes who
// computes a sequence, never which sequences there are.
//
// Instruction shards (model/instruction_shards.hpp) hold fixed rows of T+1 tokens with a loss mask:
// there a "window" is a whole row, so the same formula draws rows (windows = rows over all
// shards), and a target whose mask is 0 is −1, the cross-entropy's ignore index. The loss of a
// step is then the mean over the trained targets of the whole global batch: trained_targets(step,
// sequences) counts them from the same draws, so every rank knows the step's denominator before
// the step runs (model/trainer.hpp, actors/stage_engine.hpp). Token shards and instruction shards
// are not mixed in one loader.
//
// Packed instruction rows also give each token the start of its example (batch::doc_starts), which
// travels with the micro-batch to every chunk: examples packed in one row do not see each other.
//
// Evaluation batches do not depend on the seed or the step: sequence j = index·B + i of
// eval_cut(index) starts at rng_stream(stream_key(0, 0xe7a1, j)).below(windows), so validation
// losses of different runs and steps are measured on the same text.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "model/instruction_shards.hpp"
#include "model/shards.hpp"

namespace troupe::model {

/// Inputs and next-token targets of one micro-batch: host int32 tensors of shape [B*T], row-major
/// by sequence; targets[j] is the token that follows tokens[j], or −1 where it is masked.
struct batch {
  core::tensor tokens;
  core::tensor targets;
  int batch_size = 0;  // B
  int seq_length = 0;  // T
  std::int64_t trained = 0;  // targets that are not masked (B*T from token shards)
  /// Packed instruction rows only (else undefined): host int32 [B*T], doc_starts[j] = the index
  /// within its sequence where the example holding token j begins. Token t of a sequence then
  /// sits at position t − doc_starts[t] and attends to tokens doc_starts[t] … t only
  /// (model::chunk::forward), as if each example had a row of its own.
  core::tensor doc_starts;
};

struct loader_options {
  int seq_length = 64;            // T
  int micro_batch_size = 1;       // B
  int micro_batches = 1;          // M: micro_batch_num × gradient_accumulation_steps
  std::uint64_t seed = 1234;
  /// Token ids must be below this (model.vocab_size); 0 = not checked. Checked on every cut, on
  /// the host: a GPU embedding would read out of bounds without a word.
  int vocab_size = 0;

  /// The options a config implies (model.seq_length, parallel.micro_batch_size, ...).
  static loader_options from(const core::config& c);
};

/// Shard paths named by `spec`: a file, a folder (its *.bin files, sorted), or a glob pattern
/// (matches sorted). An error when nothing matches.
core::result<std::vector<std::string>> resolve_shards(const std::string& spec);

class loader {
 public:
  /// Maps every shard of `spec` (see resolve_shards) and checks each holds at least T+1 tokens,
  /// or, for instruction shards, rows of exactly T+1 tokens.
  static core::result<loader> open(const std::string& spec, const loader_options& opt);
  /// Same, for an explicit list of shard files.
  static core::result<loader> open(const std::vector<std::string>& paths,
                                   const loader_options& opt);

  /// Micro-batch `mb` of replica `dp_rank` at `step`. REQUIRES: dp_rank >= 0, 0 <= mb < M.
  batch cut(std::uint64_t step, int dp_rank, int mb) const;
  /// Evaluation micro-batch `index` (B sequences), the same for every seed and step.
  batch eval_cut(int index) const;
  /// Start offset of global sequence k at `step`, as a position in the shards' windows.
  std::uint64_t window_of(std::uint64_t step, std::uint64_t k) const;
  /// Where global sequence k of `step` comes from: its shard file and, in it, the offset of its
  /// first token (token shards) or its row (instruction shards).
  struct position {
    std::string path;
    std::uint64_t offset = 0;
    bool row = false;  // offset counts rows of an instruction shard
  };
  position position_of(std::uint64_t step, std::uint64_t k) const;
  /// Unmasked targets of global sequences 0 .. sequences-1 at `step`: the denominator of the
  /// step's mean loss (sequences × T without a mask; at least 1, so a step whose targets are all
  /// masked has loss 0, not 0/0).
  std::int64_t trained_targets(std::uint64_t step, std::uint64_t sequences) const;
  /// True when the shards are instruction shards (targets may be masked).
  bool masked() const { return !rows_.empty(); }
  /// The row layout of instruction shards (all agree); REQUIRES: masked().
  const row_layout& rows_layout() const { return rows_.front().layout(); }

  /// Tokens over all shards.
  std::uint64_t tokens() const { return total_tokens_; }
  /// Number of distinct T+1-token windows sequences are drawn from.
  std::uint64_t windows() const { return total_windows_; }
  const loader_options& options() const { return opt_; }

 private:
  explicit loader(loader_options opt) : opt_(opt) {}
  batch gather(const std::vector<std::uint64_t>& windows) const;

  loader_options opt_;
  /// Where window w lives: (shard index, offset of the window in that shard).
  std::pair<std::size_t, std::uint64_t> locate(std::uint64_t w) const;

  std::vector<shard> shards_;
  std::vector<instruction_shard> rows_;       // instead of shards_ for instruction data
  std::vector<std::uint64_t> first_window_;  // window number where each shard's windows begin
  std::uint64_t total_tokens_ = 0;
  std::uint64_t total_windows_ = 0;
};

}  // namespace troupe::model
