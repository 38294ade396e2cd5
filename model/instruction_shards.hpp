// Instruction shards: fine-tuning data as fixed rows of T+1 tokens, each token with a loss-mask
// byte, written by `troupe data prepare` from JSONL records (model/instruct.hpp) and read by the
// loader (model/loader.hpp), which draws whole rows where it draws windows from token shards.
//
// Format (little-endian): a header of 256 int32 — [0] magic 20241201, [1] version 2, [2] rows n,
// [3] tokens per row L (= seq_length + 1), [4] bytes per token w (2: uint16 ids, 4: uint32 ids,
// chosen by the largest id), [5] packing (0: one example per row, padded; 1: examples packed),
// [6] template (0 plain, 1 llama3; what the rows were rendered with, for messages), [7] the pad
// id, the rest zero — then the tokens, n × L ids of w bytes, row after row, then the mask, n × L
// bytes: mask[r·L + t] = 1 when token t of row r is a trained target (part of a response or its
// closing end-of-turn token), 0 for prompt, template and padding tokens. mask[r·L] is always 0:
// the first token of a row is never predicted. A row's inputs are tokens 0..L−2 and its targets
// tokens 1..L−1, a target masked to −1 (the cross-entropy's ignore index) where its mask is 0.
// Version 2 adds the document starts, n × L bytes after the mask: starts[r·L + t] = 1 when token t
// of row r is the first token of an example (always at t = 0; in packed rows also where each
// later example begins; padding belongs to the example before it). The loader turns them into
// per-token document starts, so packed examples attend only within themselves and their positions
// restart at 0 (model/loader.hpp). Version 1 (no starts section) is still read when its rows are
// padded (each row one example, the same thing); packed version-1 rows are refused, since their
// examples cannot be told apart.
//
// The reader memory-maps the file and checks the header against the file size, as token shards
// do (model/shards.hpp), so a truncated or foreign file is refused with a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/error.hpp"

namespace troupe::model {

inline constexpr std::int32_t instruction_shard_magic = 20241201;
inline constexpr std::int32_t instruction_shard_version = 2;

/// How a set of rows was made (header fields 5-7).
struct row_layout {
  int row_tokens = 0;    // L = seq_length + 1
  bool packing = false;
  int template_id = 0;   // 0 plain, 1 llama3 (model/instruct.hpp)
  int pad_id = 0;
};

/// Writes `rows` (n × L ids), `mask` (n × L bytes of 0 / 1) and `starts` (n × L bytes of 0 / 1,
/// 1 where an example begins; empty: one example per row) as an instruction shard at `path`,
/// atomically (temporary name, fsync, rename). Ids are stored in 2 bytes when all are below
/// 65536, else in 4. REQUIRES: rows.size() == mask.size(), a multiple of layout.row_tokens;
/// starts empty or of that size.
core::status write_instruction_shard(const std::string& path, const row_layout& layout,
                                     std::span<const std::int32_t> rows,
                                     std::span<const std::uint8_t> mask,
                                     std::span<const std::uint8_t> starts = {});

/// True when the file at `path` starts with the instruction-shard magic (false when unreadable).
bool is_instruction_shard(const std::string& path);

/// A read-only, memory-mapped instruction shard. Move-only; unmaps on destruction.
class instruction_shard {
 public:
  /// Maps `path` and checks magic, version, the header's fields and the file size.
  static core::result<instruction_shard> open(const std::string& path);

  instruction_shard(instruction_shard&& o) noexcept;
  instruction_shard& operator=(instruction_shard&& o) noexcept;
  instruction_shard(const instruction_shard&) = delete;
  instruction_shard& operator=(const instruction_shard&) = delete;
  ~instruction_shard();

  std::size_t rows() const { return rows_; }
  const row_layout& layout() const { return layout_; }
  /// Token t of row r. REQUIRES: r < rows(), t < row_tokens.
  std::uint32_t token(std::size_t r, int t) const {
    const std::size_t i = r * static_cast<std::size_t>(layout_.row_tokens) + static_cast<std::size_t>(t);
    return token_bytes_ == 2 ? reinterpret_cast<const std::uint16_t*>(tokens_)[i]
                             : reinterpret_cast<const std::uint32_t*>(tokens_)[i];
  }
  /// The mask bytes of row r (row_tokens of them).
  std::span<const std::uint8_t> mask(std::size_t r) const {
    return {mask_ + r * static_cast<std::size_t>(layout_.row_tokens),
            static_cast<std::size_t>(layout_.row_tokens)};
  }
  /// Whether token t of row r begins an example (t = 0 always does). REQUIRES: as token().
  bool starts_example(std::size_t r, int t) const {
    if (t == 0) return true;
    if (!starts_) return false;  // version 1, padded: one example per row
    return starts_[r * static_cast<std::size_t>(layout_.row_tokens) + static_cast<std::size_t>(t)] != 0;
  }
  /// The format version the file was written in (1 or 2).
  int version() const { return version_; }
  /// Trained targets of row r: the ones of mask(r)[1..L).
  int trained(std::size_t r) const;
  const std::string& path() const { return path_; }

 private:
  instruction_shard() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  row_layout layout_;
  int token_bytes_ = 2;
  const unsigned char* tokens_ = nullptr;
  const std::uint8_t* mask_ = nullptr;
  const std::uint8_t* starts_ = nullptr;  // null in version 1
  int version_ = instruction_shard_version;
  std::size_t rows_ = 0;
};

}  // namespace troupe::model
