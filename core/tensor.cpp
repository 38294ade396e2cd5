#include "core/tensor.hpp"

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.hpp"

namespace troupe::core {

std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::f32: return 4;
    case dtype::bf16: return 2;
    case dtype::f16: return 2;
    case dtype::f64: return 8;
    case dtype::i32: return 4;
    case dtype::u16: return 2;
    case dtype::i64: return 8;
  }
  return 0;
}

const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::f32: return "fp32";
    case dtype::bf16: return "bf16";
    case dtype::f16: return "fp16";
    case dtype::f64: return "fp64";
    case dtype::i32: return "int32";
    case dtype::u16: return "uint16";
    case dtype::i64: return "int64";
  }
  return "?";
}

std::string device::to_string() const {
  return kind == device_kind::cpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

std::int64_t numel_of(const shape_t& s) {
  // Zero first: a shape read from a file or a peer may be [2^40, 2^40, 0], an empty tensor whose
  // running product would overflow before reaching the 0 (the readers bound only the true count).
  for (auto d : s)
    if (d == 0) return 0;
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string shape_string(const shape_t& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

tensor tensor::zeros(shape_t shape, dtype t) {
  for (auto d : shape) TROUPE_CHECK(d >= 0, "negative dimension in " + shape_string(shape));
  auto st = std::make_shared<storage>();
  st->bytes = static_cast<std::size_t>(numel_of(shape)) * dtype_size(t);
  std::size_t alloc = (st->bytes + 63) / 64 * 64;
  if (alloc == 0) alloc = 64;
  st->data = std::aligned_alloc(64, alloc);
  if (!st->data) throw failure("host allocation of " + std::to_string(alloc) + " bytes failed");
  std::memset(st->data, 0, alloc);
  st->release = [](void* p) { std::free(p); };
  return over(std::move(st), 0, std::move(shape), t);
}

tensor tensor::over(std::shared_ptr<storage> st, std::size_t byte_offset, shape_t shape, dtype t) {
  TROUPE_CHECK(st != nullptr, "null storage");
  TROUPE_CHECK(byte_offset + static_cast<std::size_t>(numel_of(shape)) * dtype_size(t) <= st->bytes,
               "view " + shape_string(shape) + " at byte " + std::to_string(byte_offset) +
                   " exceeds storage of " + std::to_string(st->bytes) + " bytes");
  tensor out;
  out.st_ = std::move(st);
  out.offset_ = byte_offset;
  out.shape_ = std::move(shape);
  out.type_ = t;
  return out;
}

tensor tensor::reshape(shape_t shape) const {
  TROUPE_CHECK(numel_of(shape) == numel(),
               "reshape " + shape_string(shape_) + " to " + shape_string(shape));
  return over(st_, offset_, std::move(shape), type_);
}

tensor tensor::slice(std::int64_t begin_elem, shape_t shape) const {
  TROUPE_CHECK(begin_elem >= 0 && begin_elem + numel_of(shape) <= numel(),
               "slice at " + std::to_string(begin_elem) + " of " + shape_string(shape) +
                   " outside " + shape_string(shape_));
  return over(st_, offset_ + static_cast<std::size_t>(begin_elem) * dtype_size(type_),
              std::move(shape), type_);
}

tensor tensor::rows(std::int64_t begin, std::int64_t end) const {
  TROUPE_CHECK(rank() >= 1 && begin >= 0 && begin <= end && end <= shape_[0],
               "rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " +
                   shape_string(shape_));
  shape_t s = shape_;
  s[0] = end - begin;
  return slice(begin * (numel() / std::max<std::int64_t>(shape_[0], 1)), s);
}

tensor tensor::clone() const {
  TROUPE_CHECK(dev().is_cpu(), "clone() of a device tensor; copy it through its backend");
  tensor out = zeros(shape_, type_);
  if (bytes()) std::memcpy(out.raw(), raw(), bytes());
  return out;
}

std::uint16_t f32_to_bf16(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<std::uint16_t>(u >> 16);
}

float bf16_to_f32(std::uint16_t x) { return std::bit_cast<float>(static_cast<std::uint32_t>(x) << 16); }

// IEEE binary16 by bit manipulation rather than through _Float16, which not every compiler has on
// x86-64 (clang before 15); tests/core/tensor_test.cpp compares both ways with _Float16 where the
// compiler has it: every half value, and float values around every rounding boundary.
std::uint16_t f32_to_f16(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u)  // NaN: quiet, the payload's top bits kept
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
  if (u >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: infinity
  if (u < 0x38800000u) {
    // Below 2^-14: a subnormal half, its mantissa |x| / 2^-24 rounded to nearest even (scaling
    // by a power of two is exact; 1024 is the smallest normal, which the encoding continues into).
    const float m = std::nearbyint(std::bit_cast<float>(u) * 16777216.0f);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(m));
  }
  u += 0xfffu + ((u >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return static_cast<std::uint16_t>(sign | ((u - (112u << 23)) >> 13));
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant · 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) | sign);
  }
  if (exp == 31)  // infinity, or NaN kept quiet with its payload
    return std::bit_cast<float>(sign | 0x7f800000u | (mant ? (0x400000u | (mant << 13)) : 0u));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace troupe::core
