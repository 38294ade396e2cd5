// The exact sum of doubles, rounded once: a fixed-point superaccumulator that spans the whole
// double range. The global gradient norm is defined with it (model/optimizer.hpp, step 4): the sum
// of the fp64 sumsq blocks is their exact sum, rounded to nearest-even once. Exact addition is
// associative, so the result does not depend on the order the blocks are added in, on how they are
// split between optimizer shards, or on whether a CPU loop or a GPU kernel with integer atomics
// adds them — which is what lets the GPU compute the norm and decide the clip without a host round
// trip and still give the bits of the CPU reference and of the actor runtime.
//
// Representation: `exact_sum_digits` signed 64-bit digits, digit i weighing 2^(32·i + base) with
// base = -1088 (below the smallest subnormal, 2^-1074), and three counters (NaN, +inf, -inf). A
// finite double m·2^k (m < 2^53) adds three 32-bit pieces of m·2^(k - base) to three adjacent
// digits; each piece is below 2^32, so a digit cannot overflow before 2^31 values have been added
// to an accumulator (sums of sumsq blocks of 1024 elements: 2·10^12 parameters). Digits are only
// normalised (carries propagated) when the value is read, so adding is three integer additions.
//
// The functions are plain inline code, compiled for the host and, in .cu files, for the device.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TROUPE_HD __host__ __device__
#else
#define TROUPE_HD
#endif

namespace troupe::core {

inline constexpr int exact_sum_digits = 68;   // 2^-1088 .. 2^1088: 2^1024 · 2^31 values fit
inline constexpr int exact_sum_base = -1088;  // weight of digit 0 is 2^base
inline constexpr int exact_sum_nan = exact_sum_digits;  // counter words after the digits
inline constexpr int exact_sum_pinf = exact_sum_digits + 1;
inline constexpr int exact_sum_ninf = exact_sum_digits + 2;
/// Words of an accumulator: the digits and the three counters.
inline constexpr int exact_sum_words = exact_sum_digits + 3;

TROUPE_HD inline std::uint64_t double_bits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

TROUPE_HD inline double bits_double(std::uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

/// Number of significant bits of v > 0.
TROUPE_HD inline int bit_length(std::uint64_t v) {
#if defined(__CUDA_ARCH__)
  return 64 - __clzll(static_cast<long long>(v));
#else
  return 64 - __builtin_clzll(v);
#endif
}

/// What adding x does to an accumulator: `counter` >= 0 names the counter word to increment (x is
/// NaN or infinite); otherwise, unless x is zero (`digit` < 0), piece[j] is added to digit + j.
struct exact_sum_split {
  int counter = -1;
  int digit = -1;
  std::int64_t piece[3] = {0, 0, 0};
};

TROUPE_HD inline exact_sum_split exact_sum_split_of(double x) {
  exact_sum_split s;
  const std::uint64_t u = double_bits(x);
  const int field = static_cast<int>((u >> 52) & 0x7ff);
  const std::uint64_t frac = u & ((std::uint64_t{1} << 52) - 1);
  const bool neg = (u >> 63) != 0;
  if (field == 0x7ff) {
    s.counter = frac != 0 ? exact_sum_nan : (neg ? exact_sum_ninf : exact_sum_pinf);
    return s;
  }
  if (field == 0 && frac == 0) return s;
  // x = m · 2^k: subnormals have no implicit bit and the exponent of the smallest normal.
  const std::uint64_t m = field == 0 ? frac : (frac | (std::uint64_t{1} << 52));
  const int k = (field == 0 ? 1 : field) - 1075;
  const int p = k - exact_sum_base;  // >= 14
  const int sh = p % 32;
  s.digit = p / 32;
  const std::uint64_t lo = m << sh;                       // bits 0..63 of m·2^sh
  const std::uint64_t hi = sh == 0 ? 0 : m >> (64 - sh);  // bits 64..84
  const std::int64_t sign = neg ? -1 : 1;
  s.piece[0] = sign * static_cast<std::int64_t>(lo & 0xffffffffu);
  s.piece[1] = sign * static_cast<std::int64_t>(lo >> 32);
  s.piece[2] = sign * static_cast<std::int64_t>(hi);
  return s;
}

/// words[] += x, exactly (words: exact_sum_words).
TROUPE_HD inline void exact_sum_add(std::int64_t* words, double x) {
  const exact_sum_split s = exact_sum_split_of(x);
  if (s.counter >= 0) {
    ++words[s.counter];
    return;
  }
  if (s.digit < 0) return;
  for (int j = 0; j < 3; ++j) words[s.digit + j] += s.piece[j];
}

/// Propagates carries: digits 0 .. D-2 end in [0, 2^32), the top digit keeps the sign.
TROUPE_HD inline void exact_sum_normalise(std::int64_t* d) {
  for (int i = 0; i + 1 < exact_sum_digits; ++i) {
    const std::int64_t carry = d[i] >> 32;  // floor division: arithmetic shift
    d[i] -= carry * (std::int64_t{1} << 32);
    d[i + 1] += carry;
  }
}

/// The accumulated sum rounded to the nearest double (ties to even); NaN when a NaN was added or
/// both infinities were, ±inf when one infinity was or the sum is beyond the double range.
TROUPE_HD inline double exact_sum_value(const std::int64_t* words) {
  const std::uint64_t inf_bits = std::uint64_t{0x7ff} << 52;
  if (words[exact_sum_nan] > 0 || (words[exact_sum_pinf] > 0 && words[exact_sum_ninf] > 0))
    return bits_double(inf_bits | (std::uint64_t{1} << 51));
  if (words[exact_sum_pinf] > 0) return bits_double(inf_bits);
  if (words[exact_sum_ninf] > 0) return bits_double(inf_bits | (std::uint64_t{1} << 63));
  std::int64_t d[exact_sum_digits];
  for (int i = 0; i < exact_sum_digits; ++i) d[i] = words[i];
  exact_sum_normalise(d);
  const bool neg = d[exact_sum_digits - 1] < 0;
  if (neg) {
    for (int i = 0; i < exact_sum_digits; ++i) d[i] = -d[i];
    exact_sum_normalise(d);
  }
  const std::uint64_t sign = neg ? std::uint64_t{1} << 63 : 0;
  int h = exact_sum_digits - 1;
  while (h >= 0 && d[h] == 0) --h;
  if (h < 0) return 0.0;
  // Digit 66 weighs 2^(66·32 - 1088) = 2^1024: beyond the largest double.
  if (h >= (1024 - exact_sum_base) / 32) return bits_double(sign | inf_bits);
  // The top three digits as a 96-bit window hi:lo (hi is digit h, nonzero, so the window holds
  // 65..96 significant bits), the digits below it only as a sticky bit.
  const std::uint64_t hi = static_cast<std::uint64_t>(d[h]);
  const std::uint64_t mid = h >= 1 ? static_cast<std::uint64_t>(d[h - 1]) : 0;
  const std::uint64_t low = h >= 2 ? static_cast<std::uint64_t>(d[h - 2]) : 0;
  bool sticky = false;
  for (int i = 0; i < h - 2; ++i) sticky = sticky || d[i] != 0;
  const std::uint64_t lo = (mid << 32) | low;
  int shift = 64 + bit_length(hi) - 53;  // 12 .. 43: drops all but 53 bits
  std::uint64_t m = (hi << (64 - shift)) | (lo >> shift);
  const std::uint64_t rem = lo & ((std::uint64_t{1} << shift) - 1);
  const std::uint64_t half = std::uint64_t{1} << (shift - 1);
  if (rem > half || (rem == half && (sticky || (m & 1) != 0))) {
    ++m;
    if ((m >> 53) != 0) {
      m >>= 1;
      ++shift;
    }
  }
  // value = m · 2^e with 2^52 <= m < 2^53
  const int e = shift + 32 * (h - 2) + exact_sum_base;
  const int biased = e + 52 + 1023;
  if (biased >= 0x7ff) return bits_double(sign | inf_bits);
  if (biased >= 1)
    return bits_double(sign | (static_cast<std::uint64_t>(biased) << 52) |
                       (m & ((std::uint64_t{1} << 52) - 1)));
  // Below 2^-1022 the sum is a multiple of 2^-1074 with fewer than 53 bits (every input is such a
  // multiple), so it is exact and the shift below drops only zeros.
  return bits_double(sign | (m >> (1 - biased)));
}

/// A host-side accumulator: what optimizer shards send to the coordinator.
struct exact_sum {
  std::int64_t words[exact_sum_words] = {};

  void add(double x) { exact_sum_add(words, x); }
  /// Adds another accumulator's words (as exact as adding its values one by one).
  void merge(const std::int64_t* other) {
    for (int i = 0; i < exact_sum_words; ++i) words[i] += other[i];
  }
  void merge(const exact_sum& other) { merge(other.words); }
  double value() const { return exact_sum_value(words); }
};

}  // namespace troupe::core
