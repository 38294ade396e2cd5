#include "model/shards.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/files.hpp"

namespace troupe::model {

namespace {

constexpr const char* kPrepareHint =
    "make token shards with `troupe data prepare --input TEXT... --out DIR`";


// The files llm.c writes that a user may point us at by mistake, by their magic number.
const char* llmc_kind(std::int32_t magic) {
  switch (magic) {
    case 20240326: return "an llm.c GPT-2 model checkpoint";
    case 20240327: return "an llm.c debug state file";
    case 20240328: return "an llm.c tokenizer file";
    default: return nullptr;
  }
}

// First bytes of a file in readable form, to show what a foreign file looks like.
std::string preview(const unsigned char* p, std::size_t n) {
  std::string out;
  bool text = true;
  for (std::size_t i = 0; i < n && i < 16; ++i) {
    unsigned char c = p[i];
    if (c == '\n' || c == '\t' || c == '\r' || (c >= 0x20 && c < 0x7F)) {
      out += c == '\n' ? ' ' : static_cast<char>(c);
    } else if (c < 0x80) {
      text = false;
    }
  }
  if (!text || out.empty()) {
    static const char* hex = "0123456789abcdef";
    out.clear();
    for (std::size_t i = 0; i < n && i < 8; ++i) {
      if (i) out += ' ';
      out += hex[p[i] >> 4];
      out += hex[p[i] & 15];
    }
    return "bytes " + out;
  }
  return "text '" + out + "'";
}

}  // namespace

namespace {

template <typename T>
core::status write_any(const std::string& path, std::span<const T> tokens, std::int32_t magic,
                       std::int32_t version) {
  if (tokens.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    return core::error::at_file(path,
                                "cannot hold " + std::to_string(tokens.size()) +
                                    " tokens: the llm.c header stores the count as int32",
                                "split the text into several shards");
  std::int32_t header[shard_header_ints] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<std::int32_t>(tokens.size());

  const std::span<const std::byte> parts[] = {std::as_bytes(std::span(header)),
                                               std::as_bytes(tokens)};
  return core::write_file_atomic(path, parts);
}

}  // namespace

core::status write_shard(const std::string& path, std::span<const std::uint16_t> tokens) {
  return write_any(path, tokens, shard_magic, shard_version);
}

core::status write_shard(const std::string& path, std::span<const std::uint32_t> tokens) {
  return write_any(path, tokens, shard32_magic, shard32_version);
}

core::status write_tokens(const std::string& path, std::span<const int> ids,
                          std::int64_t vocab_size) {
  TROUPE_CHECK(vocab_size >= 1, "write_tokens needs a vocabulary size of at least 1");
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab_size)
      return core::error::at_file(path,
                                  "token id " + std::to_string(ids[i]) + " at position " +
                                      std::to_string(i) + " is outside the vocabulary [0, " +
                                      std::to_string(vocab_size) + ")",
                                  "the tokenizer produced an id its vocabulary does not hold; "
                                  "check the tokenizer file");
  if (vocab_size <= shard16_max_vocab) {
    std::vector<std::uint16_t> narrow(ids.begin(), ids.end());
    return write_shard(path, std::span<const std::uint16_t>(narrow));
  }
  std::vector<std::uint32_t> wide(ids.begin(), ids.end());
  return write_shard(path, std::span<const std::uint32_t>(wide));
}

core::result<std::vector<std::uint16_t>> to_u16(std::span<const int> ids) {
  std::vector<std::uint16_t> out(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > 0xFFFF)
      return core::error::make("token id " + std::to_string(ids[i]) + " at position " +
                                   std::to_string(i) + " does not fit a uint16 shard",
                               "llm.c version-1 shards hold vocabularies of at most 65536 tokens; "
                               "larger ones are written as uint32 shards (write_tokens)");
    out[i] = static_cast<std::uint16_t>(ids[i]);
  }
  return out;
}

core::result<shard> shard::open(const std::string& path) {
  core::input_spec spec;
  spec.what = "token shard";
  // The header counts tokens in an int32, so no shard is larger than this.
  spec.max_bytes = shard_header_bytes +
                   static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()) * 4;
  spec.hint = kPrepareHint;
  auto in = core::open_input(path, spec);
  if (!in) return in.err();
  const int fd = in->release();
  const auto file_bytes = static_cast<std::size_t>(in->size());
  if (file_bytes < shard_header_bytes) {
    // Read what is there, to say whether it is a cut-off shard or something else entirely.
    unsigned char head[16] = {};
    ssize_t got = ::pread(fd, head, sizeof head, 0);
    ::close(fd);
    std::int32_t magic = 0;
    if (got >= 4) std::memcpy(&magic, head, 4);
    std::string what = got >= 4 && (magic == shard_magic || magic == shard32_magic)
                           ? "a token shard cut off inside its header"
                           : "not a token shard (starts with " +
                                 preview(head, got > 0 ? static_cast<std::size_t>(got) : 0) + ")";
    return core::error::at_file(
        path,
        "expected at least the " + std::to_string(shard_header_bytes) +
            "-byte llm.c shard header, found a file of " + std::to_string(file_bytes) +
            " bytes: " + what,
        kPrepareHint);
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED)
    return core::error::at_file(path, std::string("cannot memory-map: ") + std::strerror(map_errno),
                                "check that the file is readable and the address space not full");

  shard s;
  s.path_ = path;
  s.map_ = map;
  s.map_bytes_ = file_bytes;
  std::int32_t header[3];
  std::memcpy(header, map, sizeof header);
  if (header[0] != shard_magic && header[0] != shard32_magic) {
    const char* kind = llmc_kind(header[0]);
    std::string found = kind ? std::string(kind) + " (magic " + std::to_string(header[0]) + ")"
                             : "magic " + std::to_string(header[0]) + ", " +
                                   preview(static_cast<const unsigned char*>(map), 16);
    return core::error::at_file(path,
                                "not an llm.c token shard: expected magic " +
                                    std::to_string(shard_magic) + " (uint16 tokens) or " +
                                    std::to_string(shard32_magic) +
                                    " (uint32 tokens) in the first 4 bytes, found " + found,
                                kPrepareHint);
  }
  const bool wide = header[0] == shard32_magic;
  const std::int32_t version = wide ? shard32_version : shard_version;
  if (header[1] != version)
    return core::error::at_file(path,
                                "unsupported shard version: magic " + std::to_string(header[0]) +
                                    " expects version " + std::to_string(version) +
                                    (wide ? " (uint32 tokens)" : " (uint16 tokens)") +
                                    ", found " + std::to_string(header[1]),
                                "re-create the shard with `troupe data prepare`");
  if (header[2] < 0)
    return core::error::at_file(path,
                                "corrupt header: token count " + std::to_string(header[2]) +
                                    " is negative",
                                "re-create the shard with `troupe data prepare`");
  const auto count = static_cast<std::size_t>(header[2]);
  s.width_ = wide ? 4 : 2;
  const std::size_t expected = shard_header_bytes + count * static_cast<std::size_t>(s.width_);
  if (file_bytes != expected) {
    bool truncated = file_bytes < expected;
    return core::error::at_file(
        path,
        std::string(truncated ? "truncated" : "has trailing bytes") + ": the header promises " +
            std::to_string(count) + (wide ? " uint32" : " uint16") + " tokens, so expected " + std::to_string(expected) +
            " bytes, found " + std::to_string(file_bytes),
        truncated ? "the copy or write was cut short; re-create the shard with `troupe data prepare`"
                  : "the file was appended to or is not a single shard; re-create it with "
                    "`troupe data prepare`");
  }
  s.tokens_ = static_cast<const char*>(map) + shard_header_bytes;
  s.count_ = count;
  return s;
}

std::span<const std::uint16_t> shard::tokens16() const {
  TROUPE_CHECK(width_ == 2, path_ + " holds uint32 tokens, not uint16");
  return {static_cast<const std::uint16_t*>(tokens_), count_};
}

std::span<const std::uint32_t> shard::tokens32() const {
  TROUPE_CHECK(width_ == 4, path_ + " holds uint16 tokens, not uint32");
  return {static_cast<const std::uint32_t*>(tokens_), count_};
}

shard::shard(shard&& o) noexcept { *this = std::move(o); }

shard& shard::operator=(shard&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = o.map_;
    map_bytes_ = o.map_bytes_;
    tokens_ = o.tokens_;
    width_ = o.width_;
    count_ = o.count_;
    o.map_ = nullptr;
    o.map_bytes_ = 0;
    o.tokens_ = nullptr;
    o.count_ = 0;
  }
  return *this;
}

shard::~shard() { unmap(); }

void shard::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
}

}  // namespace troupe::model
