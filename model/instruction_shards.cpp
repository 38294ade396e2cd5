#include "model/instruction_shards.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "core/files.hpp"

namespace troupe::model {

namespace {

constexpr std::size_t kHeaderInts = 256;
constexpr std::size_t kHeaderBytes = kHeaderInts * sizeof(std::int32_t);
constexpr const char* kPrepareHint =
    "make instruction shards with `troupe data prepare --input FILE.jsonl --out DIR --config "
    "CONFIG` (docs/data.md)";

}  // namespace

core::status write_instruction_shard(const std::string& path, const row_layout& layout,
                                     std::span<const std::int32_t> rows,
                                     std::span<const std::uint8_t> mask,
                                     std::span<const std::uint8_t> starts) {
  TROUPE_CHECK(layout.row_tokens >= 2 && rows.size() == mask.size() &&
                   rows.size() % static_cast<std::size_t>(layout.row_tokens) == 0,
               "instruction rows and mask do not make whole rows of " +
                   std::to_string(layout.row_tokens) + " tokens");
  TROUPE_CHECK(starts.empty() || starts.size() == rows.size(),
               "instruction rows and their document starts differ in length");
  const std::size_t n = rows.size() / static_cast<std::size_t>(layout.row_tokens);
  std::vector<std::uint8_t> row_starts;
  if (starts.empty()) {
    row_starts.assign(rows.size(), 0);
    for (std::size_t i = 0; i < rows.size(); i += static_cast<std::size_t>(layout.row_tokens))
      row_starts[i] = 1;
    starts = row_starts;
  }
  if (n > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    return core::error::at_file(path, "cannot hold " + std::to_string(n) + " rows in one shard",
                                "split the records into several files");
  std::int32_t max_id = 0;
  for (std::int32_t id : rows) {
    TROUPE_CHECK(id >= 0, "negative token id " + std::to_string(id) + " in an instruction row");
    max_id = std::max(max_id, id);
  }
  const int width = max_id <= 0xFFFF ? 2 : 4;
  std::int32_t header[kHeaderInts] = {};
  header[0] = instruction_shard_magic;
  header[1] = instruction_shard_version;
  header[2] = static_cast<std::int32_t>(n);
  header[3] = layout.row_tokens;
  header[4] = width;
  header[5] = layout.packing ? 1 : 0;
  header[6] = layout.template_id;
  header[7] = layout.pad_id;
  std::vector<std::uint16_t> narrow;
  if (width == 2) narrow.assign(rows.begin(), rows.end());
  const std::span<const std::byte> tokens =
      width == 2 ? std::as_bytes(std::span<const std::uint16_t>(narrow)) : std::as_bytes(rows);
  const std::span<const std::byte> parts[] = {std::as_bytes(std::span(header)), tokens,
                                               std::as_bytes(mask), std::as_bytes(starts)};
  return core::write_file_atomic(path, parts);
}

bool is_instruction_shard(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  std::int32_t magic = 0;
  const ssize_t got = ::pread(fd, &magic, sizeof magic, 0);
  ::close(fd);
  return got == static_cast<ssize_t>(sizeof magic) && magic == instruction_shard_magic;
}

core::result<instruction_shard> instruction_shard::open(const std::string& path) {
  core::input_spec spec;
  spec.what = "instruction shard";
  spec.hint = kPrepareHint;
  auto in = core::open_input(path, spec);
  if (!in) return in.err();
  const int fd = in->release();
  const auto file_bytes = static_cast<std::size_t>(in->size());
  if (file_bytes < kHeaderBytes) {
    ::close(fd);
    return core::error::at_file(path,
                                "an instruction shard cut off inside its header (" +
                                    std::to_string(file_bytes) + " of " +
                                    std::to_string(kHeaderBytes) + " bytes)",
                                kPrepareHint);
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED)
    return core::error::at_file(path, std::string("cannot memory-map: ") + std::strerror(map_errno),
                                "check that the file is readable and the address space not full");
  instruction_shard s;
  s.path_ = path;
  s.map_ = map;
  s.map_bytes_ = file_bytes;
  std::int32_t h[8];
  std::memcpy(h, map, sizeof h);
  auto bad = [&](const std::string& what) {
    return core::error::at_file(path, "corrupt instruction shard header: " + what,
                                "re-create it with `troupe data prepare`");
  };
  if (h[0] != instruction_shard_magic)
    return core::error::at_file(path,
                                "not an instruction shard: expected magic " +
                                    std::to_string(instruction_shard_magic) + ", found " +
                                    std::to_string(h[0]),
                                kPrepareHint);
  if (h[1] != 1 && h[1] != instruction_shard_version)
    return core::error::at_file(path,
                                "unsupported instruction shard version " + std::to_string(h[1]) +
                                    " (this build reads versions 1 and " +
                                    std::to_string(instruction_shard_version) + ")",
                                "re-create it with `troupe data prepare`");
  if (h[1] == 1 && h[5] == 1)
    return core::error::at_file(path,
                                "a version-1 instruction shard of packed rows: it does not record "
                                "where each packed example begins, so its examples cannot be "
                                "kept from attending to each other",
                                "re-create it with this build's `troupe data prepare` (version " +
                                    std::to_string(instruction_shard_version) + ")");
  if (h[2] < 0) return bad("row count " + std::to_string(h[2]) + " is negative");
  if (h[3] < 2) return bad("tokens per row " + std::to_string(h[3]) + " is below 2");
  if (h[4] != 2 && h[4] != 4) return bad("bytes per token " + std::to_string(h[4]) + " is not 2 or 4");
  if (h[5] != 0 && h[5] != 1) return bad("packing flag " + std::to_string(h[5]) + " is not 0 or 1");
  if (h[6] != 0 && h[6] != 1) return bad("template " + std::to_string(h[6]) + " is not 0 or 1");
  const auto n = static_cast<std::size_t>(h[2]);
  const auto L = static_cast<std::size_t>(h[3]);
  const std::size_t sections = h[1] == 1 ? 1 : 2;  // the mask, then (version 2) the starts
  const std::size_t expected =
      kHeaderBytes + n * L * static_cast<std::size_t>(h[4]) + sections * n * L;
  if (file_bytes != expected)
    return core::error::at_file(path,
                                std::string(file_bytes < expected ? "truncated" : "has trailing bytes") +
                                    ": the header promises " + std::to_string(n) + " rows of " +
                                    std::to_string(L) + " tokens, so expected " +
                                    std::to_string(expected) + " bytes, found " +
                                    std::to_string(file_bytes),
                                "re-create the shard with `troupe data prepare`");
  s.layout_.row_tokens = h[3];
  s.layout_.packing = h[5] == 1;
  s.layout_.template_id = h[6];
  s.layout_.pad_id = h[7];
  s.token_bytes_ = h[4];
  s.tokens_ = static_cast<const unsigned char*>(map) + kHeaderBytes;
  s.mask_ = reinterpret_cast<const std::uint8_t*>(s.tokens_ + n * L * static_cast<std::size_t>(h[4]));
  s.version_ = h[1];
  if (h[1] >= 2) s.starts_ = s.mask_ + n * L;
  s.rows_ = n;
  return s;
}

int instruction_shard::trained(std::size_t r) const {
  int n = 0;
  const auto m = mask(r);
  for (std::size_t t = 1; t < m.size(); ++t) n += m[t] != 0;  // token 0 is never a target
  return n;
}

instruction_shard::instruction_shard(instruction_shard&& o) noexcept { *this = std::move(o); }

instruction_shard& instruction_shard::operator=(instruction_shard&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    layout_ = o.layout_;
    token_bytes_ = o.token_bytes_;
    tokens_ = std::exchange(o.tokens_, nullptr);
    mask_ = std::exchange(o.mask_, nullptr);
    starts_ = std::exchange(o.starts_, nullptr);
    version_ = o.version_;
    rows_ = std::exchange(o.rows_, 0);
  }
  return *this;
}

instruction_shard::~instruction_shard() { unmap(); }

void instruction_shard::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
}

}  // namespace troupe::model
