// IEEE binary16 conversions (core/tensor.hpp) against the compiler's _Float16, where it has one:
// every half value to float, and floats at and around every rounding boundary to half.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "core/tensor.hpp"

using troupe::core::f16_to_f32;
using troupe::core::f32_to_f16;

TEST_CASE("half to float and back is exact for every half value; NaN stays NaN") {
  int nans = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      ++nans;
      CHECK(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    INFO("half 0x", std::hex, h);
    REQUIRE(f32_to_f16(f) == h);
  }
  CHECK(nans == 2 * 1023);
  CHECK(f16_to_f32(0x3c00) == 1.0f);
  CHECK(f16_to_f32(0x7bff) == 65504.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f32_to_f16(65519.0f) == 0x7bff);   // below the midpoint to 65536: the largest half
  CHECK(f32_to_f16(65520.0f) == 0x7c00);   // the midpoint rounds to even: infinity
  CHECK(f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);  // half the smallest subnormal: to even 0
  CHECK(f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(f32_to_f16(-std::numeric_limits<float>::infinity()) == 0xfc00);
}

#if defined(__FLT16_MAX__) && !defined(__clang__)
namespace {

std::uint32_t bits(float x) { return std::bit_cast<std::uint32_t>(x); }

}  // namespace

TEST_CASE("the conversions give _Float16's bits: every half, every midpoint and its neighbours") {
  auto same = [](float x) {
    const auto want = std::bit_cast<std::uint16_t>(static_cast<_Float16>(x));
    INFO("float 0x", std::hex, bits(x));
    REQUIRE(f32_to_f16(x) == want);
  };
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    const float f = f16_to_f32(h16);
    REQUIRE(bits(f) == bits(static_cast<float>(std::bit_cast<_Float16>(h16))));
    const float next = f16_to_f32(static_cast<std::uint16_t>(h + 1));
    const float mid = f + (next - f) / 2;  // exact: one more bit than a half has
    for (float s : {1.0f, -1.0f})
      for (float x : {f, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) same(s * x);
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    if (!std::isnan(x)) same(x);
  }
}
#endif
