// safetensors I/O (the Hugging Face format, byte for byte): an 8-byte little-endian header length
// N, N bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the start of the data, which follows the header) plus an optional
// "__metadata__" map of strings, then the tensor bytes, contiguous and without holes.
//
// Checkpoints, `troupe export` and fine-tuning from saved weights all go through this file, so the
// reader trusts nothing: every offset, size and dtype is checked against the file before a byte is
// read, and an error names the file and the tensor. Files are read through a read-only mmap, so
// loading a tensor by name touches only its pages.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace troupe::model::safetensors {

/// One tensor's header entry. Offsets are bytes relative to the start of the data section.
struct entry {
  std::string name;
  std::string dtype;  // safetensors spelling: "F32", "BF16", "F16", "F64", "I32", "U16", ...
  core::shape_t shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// The safetensors spelling of a core dtype ("F32", "BF16", ...).
const char* dtype_code(core::dtype t);
/// Bytes per element of a safetensors dtype; 0 when the spelling is unknown.
std::size_t dtype_code_size(std::string_view code);

/// A named host tensor to write.
struct named_tensor {
  std::string name;
  core::tensor value;  // REQUIRES: host storage
};

/// What `write` produced: the file size, the xxhash64 of the whole file and of each tensor's bytes
/// (in the order given), so callers can record hashes without reading the file back.
struct write_info {
  std::uint64_t bytes = 0;
  std::uint64_t file_xxh64 = 0;
  std::vector<std::uint64_t> tensor_xxh64;
};

/// Writes `tensors` in the given order to `path` (created or truncated) and fsyncs it. Names must
/// be unique and must not be "__metadata__". `full_after` is for tests only (TROUPE_FAULT=enospc,
/// core/fault.hpp): once that many bytes of the file are written the next write fails with ENOSPC,
/// as on a full disk.
core::result<write_info> write(const std::string& path, const std::vector<named_tensor>& tensors,
                               const std::map<std::string, std::string>& metadata = {},
                               std::uint64_t full_after = UINT64_MAX);

/// xxhash64 (seed 0) of a byte range; the hash used in checkpoint manifests.
std::uint64_t xxh64(const void* data, std::size_t bytes);
/// 16 lowercase hex digits.
std::string hex64(std::uint64_t v);

/// A validated, memory-mapped safetensors file. Move-only; views returned by `bytes` live as long
/// as the file object.
class file {
 public:
  /// Maps and validates `path`: header length, JSON syntax, dtypes, shapes against byte sizes,
  /// offsets inside the data, no overlaps or holes. Errors name the file and the tensor.
  static core::result<file> open(const std::string& path);

  file(file&&) noexcept;
  file& operator=(file&&) noexcept;
  ~file();

  const std::string& path() const { return path_; }
  /// Entries in data order.
  const std::vector<entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The entry named `name`, or null.
  const entry* find(const std::string& name) const;
  /// The raw bytes of an entry.
  std::pair<const std::byte*, std::size_t> bytes(const entry& e) const;
  /// The whole file.
  std::pair<const std::byte*, std::size_t> file_bytes() const { return {base_, size_}; }
  /// A host copy of tensor `name` with its stored dtype. Errors for unknown names and dtypes that
  /// have no core equivalent.
  core::result<core::tensor> load(const std::string& name) const;

 private:
  file() = default;
  void unmap();

  std::string path_;
  const std::byte* base_ = nullptr;
  std::size_t size_ = 0;
  std::size_t data_start_ = 0;
  std::vector<entry> entries_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace troupe::model::safetensors
