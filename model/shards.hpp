// Token shards in llm.c's format, so shards made here and by llm.c's data scripts are
// interchangeable: a header of 256 little-endian int32 — [0] magic 20240520, [1] version 1,
// [2] token count, the rest zero — followed by the tokens as uint16. Readers memory-map the file
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

inline constexpr std::int32_t shard_magic = 20240520;
inline constexpr std::int32_t shard_version = 1;
inline constexpr std::size_t shard_header_ints = 256;
inline constexpr std::size_t shard_header_bytes = shard_header_ints * sizeof(std::int32_t);

/// Writes `tokens` as a shard at `path`: to a temporary name beside it, fsynced, then renamed, so
/// a crash never leaves a partial file under the real name. The count must fit llm.c's int32.
core::status write_shard(const std::string& path, std::span<const std::uint16_t> tokens);

/// Narrows token ids to uint16; an id outside [0, 65535] is an error naming it and its position.
core::result<std::vector<std::uint16_t>> to_u16(std::span<const int> ids);

/// A read-only, memory-mapped shard. Move-only; unmaps on destruction.
class shard {
 public:
  /// Maps `path` and checks magic, version and that the size is header + 2 × count bytes.
  static core::result<shard> open(const std::string& path);

  shard(shard&& o) noexcept;
  shard& operator=(shard&& o) noexcept;
  shard(const shard&) = delete;
  shard& operator=(const shard&) = delete;
  ~shard();

  /// The tokens, valid while this shard lives.
  std::span<const std::uint16_t> tokens() const { return {tokens_, count_}; }
  std::size_t size() const { return count_; }
  const std::string& path() const { return path_; }

 private:
  shard() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  const std::uint16_t* tokens_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace troupe::model
