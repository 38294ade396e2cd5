// Vectorisable exp and sigmoid for the CPU ops, and fixed-order sums.
//
// std::exp cannot be vectorised by the compiler and costs ~10 ns a call; cross-entropy over the
// GPT-2 vocabulary evaluates 50 M exponentials per micro-batch, GELU a few million. fast_exp is
// branch-free straight-line float code (Cody-Waite reduction to |r| <= ln2/2, the Cephes expf
// polynomial, exponent added in the integer bits), so loops over it vectorise, and it is a pure
// function of its input: the same bits on every call, lane and thread. Relative error < 3e-7
// (tests/kernels/fast_math_test.cpp sweeps it against the double exp).
//
// Sums in a fixed lane order: lane j adds the elements i with i % lanes == j, in index order, and
// the lanes are combined pairwise at the end. The order depends only on n, not on alignment or
// on the thread, and the compiler can keep the lanes in SIMD registers.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

// Marks a function whose loops are worth compiling twice: for AVX2 and for the x86-64 baseline
// (GCC function multi-versioning; the loader picks one per process). With FMA contraction off
// (kernels/CMakeLists.txt) both versions perform the same IEEE operations on each element, and
// the lane order of the sums is fixed by the index, so both give the same bits (checked once by
// comparing every op's output with a build defining TROUPE_NO_SIMD_CLONES; docs/kernels.md).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(TROUPE_NO_SIMD_CLONES)
#define TROUPE_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TROUPE_SIMD_CLONES
#endif

namespace troupe::kernels::cpu {

/// e^x, relative error < 3e-7; 0 for x < -87 (true value < 1.7e-38), inf for x > 88.72,
/// NaN for NaN.
inline float fast_exp(float x) {
  constexpr float hi = 88.72f;
  constexpr float lo = -87.0f;
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693359375f;  // few mantissa bits: n * ln2_hi is exact
  constexpr float ln2_lo = -2.12194440e-4f;
  constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  const float t = xc * log2e + round_magic;
  const float n = t - round_magic;
  const std::uint32_t n_bits =
      std::bit_cast<std::uint32_t>(t) - std::bit_cast<std::uint32_t>(round_magic);
  const float r = (xc - n * ln2_hi) - n * ln2_lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * (r * r) + r + 1.0f;
  float y = std::bit_cast<float>(std::bit_cast<std::uint32_t>(e_r) + (n_bits << 23));
  y = x > hi ? std::numeric_limits<float>::infinity() : y;
  y = x < lo ? 0.0f : y;
  return x != x ? x : y;
}

/// 1 / (1 + e^{-x}).
inline float fast_sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

/// Lanes of the fixed-order sums.
inline constexpr int sum_lanes = 8;

/// Combines lane accumulators pairwise: ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
template <class T>
inline T combine_lanes(const T (&l)[sum_lanes]) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/// Σ a[i] * b[i] in the fixed lane order.
inline float dot(const float* a, const float* b, std::int64_t n) {
  float l[sum_lanes] = {};
  std::int64_t i = 0;
  for (; i + sum_lanes <= n; i += sum_lanes)
    for (int j = 0; j < sum_lanes; ++j) l[j] += a[i + j] * b[i + j];
  for (int j = 0; i + j < n; ++j) l[j] += a[i + j] * b[i + j];
  return combine_lanes(l);
}

/// Σ a[i] in the fixed lane order.
inline float sum(const float* a, std::int64_t n) {
  float l[sum_lanes] = {};
  std::int64_t i = 0;
  for (; i + sum_lanes <= n; i += sum_lanes)
    for (int j = 0; j < sum_lanes; ++j) l[j] += a[i + j];
  for (int j = 0; i + j < n; ++j) l[j] += a[i + j];
  return combine_lanes(l);
}

/// Σ (a[i] - c)² in the fixed lane order.
inline float sum_sq_dev(const float* a, float c, std::int64_t n) {
  float l[sum_lanes] = {};
  std::int64_t i = 0;
  for (; i + sum_lanes <= n; i += sum_lanes)
    for (int j = 0; j < sum_lanes; ++j) {
      const float d = a[i + j] - c;
      l[j] += d * d;
    }
  for (int j = 0; i + j < n; ++j) {
    const float d = a[i + j] - c;
    l[j] += d * d;
  }
  return combine_lanes(l);
}

}  // namespace troupe::kernels::cpu
