// Token shards in llm.c's formats, so shards made here and by llm.c's data scripts are
// interchangeable: a header of 256 little-endian int32 — [0] magic, [1] version, [2] token count,
// the rest zero — followed by the tokens. Two kinds, told apart by magic and version:
//   magic 20240520, version 1: uint16 tokens (llm.c's GPT-2 shards), for vocabularies of at most
//                              65,536 ids;
//   magic 20240801, version 7: uint32 tokens (llm.c's LLaMA-3 shards), for larger vocabularies
//                              (LLaMA-3's 128,256).
// Writers pick the narrowest kind that holds the vocabulary (`write_tokens`), so GPT-2 data stays
// byte-identical to llm.c's. Readers memory-map the file
// (a shard is read at random offsets by every data-parallel rank; the page cache shares it) and
// check the header against the file size, so a truncated or foreign file is refused with a message
// instead of being read as garbage tokens.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace troupe::model {

inline constexpr std::int32_t shard_magic = 20240520;  // uint16 tokens
inline constexpr std::int32_t shard_version = 1;
inline constexpr std::int32_t shard32_magic = 20240801;  // uint32 tokens
inline constexpr std::int32_t shard32_version = 7;
/// Largest vocabulary a uint16 shard holds; above it `write_tokens` writes uint32 shards.
inline constexpr std::int64_t shard16_max_vocab = 65536;
inline constexpr std::size_t shard_header_ints = 256;
inline constexpr std::size_t shard_header_bytes = shard_header_ints * sizeof(std::int32_t);

/// Writes `tokens` as a shard at `path`: to a temporary name beside it, fsynced, then renamed, so
/// a crash never leaves a partial file under the real name. The count must fit llm.c's int32.
core::status write_shard(const std::string& path, std::span<const std::uint16_t> tokens);
/// Same, as a uint32 shard (magic 20240801, version 7).
core::status write_shard(const std::string& path, std::span<const std::uint32_t> tokens);

/// Writes `ids` as a uint16 shard when `vocab_size` <= 65,536, else as a uint32 shard. An id
/// outside [0, vocab_size) is refused, naming it and its position. REQUIRES: vocab_size >= 1.
core::status write_tokens(const std::string& path, std::span<const int> ids,
                          std::int64_t vocab_size);

/// Narrows token ids to uint16; an id outside [0, 65535] is an error naming it and its position.
core::result<std::vector<std::uint16_t>> to_u16(std::span<const int> ids);

/// A read-only, memory-mapped shard. Move-only; unmaps on destruction.
class shard {
 public:
  /// Maps `path` and checks magic, version and that the size is header + width × count bytes.
  static core::result<shard> open(const std::string& path);

  shard(shard&& o) noexcept;
  shard& operator=(shard&& o) noexcept;
  shard(const shard&) = delete;
  shard& operator=(const shard&) = delete;
  ~shard();

  /// Token `i`, whichever the width. REQUIRES: i < size().
  std::uint32_t id(std::size_t i) const {
    return width_ == 2 ? static_cast<const std::uint16_t*>(tokens_)[i]
                       : static_cast<const std::uint32_t*>(tokens_)[i];
  }
  /// Bytes per token: 2 (magic 20240520) or 4 (magic 20240801).
  int width() const { return width_; }
  /// The tokens of a uint16 shard, valid while this shard lives. REQUIRES: width() == 2.
  std::span<const std::uint16_t> tokens16() const;
  /// The tokens of a uint32 shard, valid while this shard lives. REQUIRES: width() == 4.
  std::span<const std::uint32_t> tokens32() const;
  std::size_t size() const { return count_; }
  const std::string& path() const { return path_; }

 private:
  shard() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
  int width_ = 2;
  std::size_t count_ = 0;
};

}  // namespace troupe::model
