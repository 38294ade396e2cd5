#include "model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/files.hpp"

namespace troupe::model::safetensors {

namespace {

using core::error;

// The Rust reference refuses headers above 100 MB; a larger length is a corrupt file, not a model.
constexpr std::uint64_t max_header_bytes = 100'000'000;

struct code_info {
  const char* code;
  std::size_t size;
};

constexpr code_info known_codes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},
    {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},     {"U32", 4},     {"F32", 4},
    {"F64", 8},  {"I64", 8}, {"U64", 8}};

bool code_to_dtype(std::string_view code, core::dtype& out) {
  static constexpr std::pair<std::string_view, core::dtype> table[] = {
      {"F32", core::dtype::f32}, {"BF16", core::dtype::bf16}, {"F16", core::dtype::f16},
      {"F64", core::dtype::f64}, {"I32", core::dtype::i32},   {"U16", core::dtype::u16},
      {"I64", core::dtype::i64}};
  for (auto& [c, t] : table)
    if (c == code) {
      out = t;
      return true;
    }
  return false;
}

std::string errno_text() { return std::strerror(errno); }

error tensor_error(const std::string& path, const std::string& name, std::string message,
                   std::string hint = {}) {
  error e = error::at_file(path, std::move(message), std::move(hint));
  e.where.key = "tensor '" + name + "'";
  return e;
}

// Writes all of [data, data + n) or reports why not. `room`: bytes the file may still take before
// writes fail with ENOSPC (a test's full disk; UINT64_MAX = no limit).
bool write_all(int fd, const void* data, std::size_t n, std::uint64_t& room) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (room == 0) {
      errno = ENOSPC;
      return false;
    }
    ssize_t w = ::write(fd, p, static_cast<std::size_t>(std::min<std::uint64_t>(n, room)));
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<std::size_t>(w);
    if (room != UINT64_MAX) room -= static_cast<std::uint64_t>(w);
  }
  return true;
}

}  // namespace

const char* dtype_code(core::dtype t) {
  switch (t) {
    case core::dtype::f32: return "F32";
    case core::dtype::bf16: return "BF16";
    case core::dtype::f16: return "F16";
    case core::dtype::f64: return "F64";
    case core::dtype::i32: return "I32";
    case core::dtype::u16: return "U16";
    case core::dtype::i64: return "I64";
  }
  return "?";
}

std::size_t dtype_code_size(std::string_view code) {
  for (auto& c : known_codes)
    if (code == c.code) return c.size;
  return 0;
}

std::uint64_t xxh64(const void* data, std::size_t bytes) { return XXH64(data, bytes, 0); }

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

core::result<write_info> write(const std::string& path, const std::vector<named_tensor>& tensors,
                               const std::map<std::string, std::string>& metadata,
                               std::uint64_t full_after) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (auto& t : tensors) {
    if (t.name == "__metadata__" || header.contains(t.name))
      return tensor_error(path, t.name, "duplicate or reserved tensor name");
    if (!t.value.defined() || !t.value.dev().is_cpu())
      return tensor_error(path, t.name, "only defined host tensors can be written",
                          "copy device tensors to the host first (backend::to_host)");
    std::uint64_t n = t.value.bytes();
    header[t.name] = {{"dtype", dtype_code(t.value.type())},
                      {"shape", t.value.shape()},
                      {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return error::at_file(path, "cannot create: " + errno_text());
  write_info info;
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  std::uint64_t room = full_after;
  bool ok = write_all(fd, len_le, 8, room) && write_all(fd, text.data(), text.size(), room);
  XXH64_update(state, len_le, 8);
  XXH64_update(state, text.data(), text.size());
  for (std::size_t i = 0; ok && i < tensors.size(); ++i) {
    const auto& t = tensors[i].value;
    ok = write_all(fd, t.raw(), t.bytes(), room);
    XXH64_update(state, t.raw(), t.bytes());
    info.tensor_xxh64.push_back(xxh64(t.raw(), t.bytes()));
  }
  info.file_xxh64 = XXH64_digest(state);
  XXH64_freeState(state);
  if (!ok) {
    std::string why = errno_text();
    ::close(fd);
    return error::at_file(path, "write failed: " + why, "check free disk space");
  }
  if (::fsync(fd) != 0) {
    std::string why = errno_text();
    ::close(fd);
    return error::at_file(path, "fsync failed: " + why);
  }
  if (::close(fd) != 0) return error::at_file(path, "close failed: " + errno_text());
  info.bytes = 8 + text.size() + offset;
  return info;
}

file::file(file&& o) noexcept { *this = std::move(o); }

file& file::operator=(file&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
    data_start_ = o.data_start_;
    entries_ = std::move(o.entries_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

file::~file() { unmap(); }

void file::unmap() {
  if (base_) ::munmap(const_cast<std::byte*>(base_), size_);
  base_ = nullptr;
  size_ = 0;
}

core::result<file> file::open(const std::string& path) {
  file f;
  f.path_ = path;
  core::input_spec spec;
  spec.what = "safetensors file";
  spec.hint = "pass a checkpoint written by troupe (its manifest.json lists the files)";
  auto in = core::open_input(path, spec);
  if (!in) return in.err();
  const std::size_t size = static_cast<std::size_t>(in->size());
  const int fd = in->release();
  if (size < 8) {
    ::close(fd);
    return error::at_file(path, "file of " + std::to_string(size) +
                                    " bytes is too short for a safetensors header",
                          "the file is truncated or not a safetensors file");
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return error::at_file(path, "cannot map: " + errno_text());
  f.base_ = static_cast<const std::byte*>(m);
  f.size_ = size;

  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i)
    header_len |= static_cast<std::uint64_t>(std::to_integer<unsigned char>(f.base_[i])) << (8 * i);
  if (header_len > max_header_bytes || header_len > size - 8)
    return error::at_file(path,
                          "header length " + std::to_string(header_len) + " exceeds the file (" +
                              std::to_string(size) + " bytes)",
                          "the file is truncated or not a safetensors file");
  f.data_start_ = 8 + header_len;
  const std::uint64_t data_size = size - f.data_start_;
  std::string_view text(reinterpret_cast<const char*>(f.base_ + 8), header_len);
  if (text.empty() || text.front() != '{')
    return error::at_file(path, "header does not start with '{'", "not a safetensors file");

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return error::at_file(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) return error::at_file(path, "header is not a JSON object");

  for (auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object())
        return error::at_file(path, "__metadata__ is not an object of strings");
      for (auto& [k, v] : value.items()) {
        if (!v.is_string())
          return error::at_file(path, "__metadata__ value '" + k + "' is not a string");
        f.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets"))
      return tensor_error(path, name, "entry lacks dtype, shape or data_offsets");
    const auto& jd = value["dtype"];
    const auto& js = value["shape"];
    const auto& jo = value["data_offsets"];
    if (!jd.is_string()) return tensor_error(path, name, "dtype is not a string");
    entry e;
    e.name = name;
    e.dtype = jd.get<std::string>();
    std::size_t elem = dtype_code_size(e.dtype);
    if (elem == 0) return tensor_error(path, name, "unknown dtype '" + e.dtype + "'");
    if (!js.is_array()) return tensor_error(path, name, "shape is not an array");
    unsigned __int128 numel = 1;
    for (auto& d : js) {
      if (!d.is_number_unsigned())
        return tensor_error(path, name, "shape has a dimension that is not a non-negative integer");
      std::uint64_t dim = d.get<std::uint64_t>();
      if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        return tensor_error(path, name, "shape dimension too large");
      e.shape.push_back(static_cast<std::int64_t>(dim));
      numel *= dim;
      if (numel > size) numel = static_cast<unsigned __int128>(size) + 1;  // saturate: cannot fit
    }
    if (!jo.is_array() || jo.size() != 2 || !jo[0].is_number_unsigned() ||
        !jo[1].is_number_unsigned())
      return tensor_error(path, name, "data_offsets is not a pair of non-negative integers");
    e.begin = jo[0].get<std::uint64_t>();
    e.end = jo[1].get<std::uint64_t>();
    if (e.end < e.begin)
      return tensor_error(path, name, "data_offsets end before they begin");
    if (numel * elem != e.end - e.begin)
      return tensor_error(path, name,
                          "shape " + core::shape_string(e.shape) + " of " + e.dtype + " needs " +
                              std::to_string(static_cast<std::uint64_t>(numel * elem)) +
                              " bytes but data_offsets span " + std::to_string(e.end - e.begin));
    if (e.end > data_size)
      return tensor_error(path, name,
                          "data [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                              ") runs past the end of the data section (" +
                              std::to_string(data_size) + " bytes)",
                          "the file is truncated");
    f.entries_.push_back(std::move(e));
  }

  std::sort(f.entries_.begin(), f.entries_.end(), [](const entry& a, const entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < f.entries_.size(); ++i) {
    const entry& e = f.entries_[i];
    if (e.begin < at)
      return tensor_error(path, e.name, "data overlaps tensor '" + f.entries_[i - 1].name + "'");
    if (e.begin > at)
      return tensor_error(path, e.name,
                          "data starts at " + std::to_string(e.begin) + ", leaving a hole after " +
                              std::to_string(at));
    at = e.end;
    f.index_[e.name] = i;
  }
  if (at != data_size)
    return error::at_file(path, std::to_string(data_size - at) +
                                    " bytes follow the last tensor's data",
                          "the file was appended to or its header was altered");
  return f;
}

const entry* file::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

std::pair<const std::byte*, std::size_t> file::bytes(const entry& e) const {
  return {base_ + data_start_ + e.begin, static_cast<std::size_t>(e.end - e.begin)};
}

core::result<core::tensor> file::load(const std::string& name) const {
  const entry* e = find(name);
  if (!e) return tensor_error(path_, name, "no such tensor in the file");
  core::dtype t;
  if (!code_to_dtype(e->dtype, t))
    return tensor_error(path_, name, "dtype " + e->dtype + " has no troupe equivalent");
  core::tensor out = core::tensor::zeros(e->shape, t);
  auto [p, n] = bytes(*e);
  if (n) std::memcpy(out.raw(), p, n);
  return out;
}

}  // namespace troupe::model::safetensors
