// A tensor is a typed, shaped view into reference-counted storage on one device. Storage knows how
// to release itself, so core/ needs no CUDA: the CUDA backend allocates device storage with its own
// allocator and hands a release function. Tensors are always contiguous (row-major); a view is an
// offset into the same storage. Copying a tensor copies the handle, not the bytes; actors move
// tensors through messages (docs/design.md, rule 4).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace troupe::core {

enum class dtype : std::uint8_t { f32, bf16, f16, f64, i32, u16, i64 };

/// Bytes per element.
std::size_t dtype_size(dtype t);
/// "fp32", "bf16", "fp16", "fp64", "int32", "uint16", "int64".
const char* dtype_name(dtype t);

enum class device_kind : std::uint8_t { cpu, cuda };

struct device {
  device_kind kind = device_kind::cpu;
  int index = 0;
  bool operator==(const device&) const = default;
  bool is_cpu() const { return kind == device_kind::cpu; }
  std::string to_string() const;
};

/// Owned memory on a device; `release` frees it (null for borrowed memory).
struct storage {
  void* data = nullptr;
  std::size_t bytes = 0;
  device dev;
  std::function<void(void*)> release;
  /// A device backend's hand-off state for this memory (CUDA: the event that marks the bytes
  /// ready, the streams that used them); null on the host and until a tensor is handed over.
  std::shared_ptr<void> sync;
  storage() = default;
  storage(const storage&) = delete;
  storage& operator=(const storage&) = delete;
  ~storage() {
    if (release && data) release(data);
  }
};

using shape_t = std::vector<std::int64_t>;

/// Number of elements of a shape (1 for a scalar shape {}; 0 when any dimension is 0).
std::int64_t numel_of(const shape_t& s);
/// "[2, 3, 4]".
std::string shape_string(const shape_t& s);

class tensor {
 public:
  tensor() = default;

  /// Zero-filled, 64-byte aligned host tensor.
  static tensor zeros(shape_t shape, dtype t = dtype::f32);
  /// A tensor over existing storage at a byte offset. REQUIRES: offset + bytes fit in storage.
  static tensor over(std::shared_ptr<storage> st, std::size_t byte_offset, shape_t shape, dtype t);

  bool defined() const { return st_ != nullptr; }
  dtype type() const { return type_; }
  const shape_t& shape() const { return shape_; }
  std::int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int rank() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const { return numel_of(shape_); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(type_); }
  device dev() const { return st_ ? st_->dev : device{}; }
  std::size_t byte_offset() const { return offset_; }
  const std::shared_ptr<storage>& store() const { return st_; }

  void* raw() const { return st_ ? static_cast<char*>(st_->data) + offset_ : nullptr; }
  template <class T>
  T* data() const { return static_cast<T*>(raw()); }

  /// Same bytes, new shape. REQUIRES: same element count.
  tensor reshape(shape_t shape) const;
  /// Elements [begin, begin + numel(shape)) of this tensor, flattened, seen with `shape`.
  tensor slice(std::int64_t begin_elem, shape_t shape) const;
  /// Rows [begin, end) along the first dimension.
  tensor rows(std::int64_t begin, std::int64_t end) const;

  /// Deep copy to a new host tensor. REQUIRES: host storage.
  tensor clone() const;

 private:
  std::shared_ptr<storage> st_;
  std::size_t offset_ = 0;
  shape_t shape_;
  dtype type_ = dtype::f32;
};

/// bf16/fp16 <-> fp32 conversions on the host (round to nearest even).
std::uint16_t f32_to_bf16(float x);
float bf16_to_f32(std::uint16_t x);
std::uint16_t f32_to_f16(float x);
float f16_to_f32(std::uint16_t x);

}  // namespace troupe::core
