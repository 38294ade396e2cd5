// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) and the
// dropout mask drawn from it. A counter-based generator: the bits at a counter are a pure function
// of (key, counter), so any element's random number is computed where it is needed, by any thread
// of any backend, in any order, with nothing carried from one draw to the next. That is what lets
// recompute, replay, pipeline splits and data-parallel layouts draw the same dropout masks
// (docs/design.md, Determinism contract). Host and device share this header: the CPU kernels and
// the CUDA kernels evaluate the same integer arithmetic, so their masks agree bit for bit.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TROUPE_HOST_DEVICE __host__ __device__
#else
#define TROUPE_HOST_DEVICE
#endif

namespace troupe::core {

/// Philox-4x32 with 10 rounds: the four 32-bit words at counter `c` under the 64-bit key `key`.
TROUPE_HOST_DEVICE inline void philox4x32(std::uint32_t c[4], std::uint64_t key) {
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(0xD2511F53u) * c[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(0xCD9E8D57u) * c[2];
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    const std::uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

/// The 32 random bits of element `within` of global sample `sample` in the stream `key`: word
/// within % 4 of the Philox block at counter (within / 4, sample).
TROUPE_HOST_DEVICE inline std::uint32_t dropout_bits(std::uint64_t key, std::uint64_t sample,
                                                     std::uint64_t within) {
  const std::uint64_t block = within >> 2;
  std::uint32_t c[4] = {static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                        static_cast<std::uint32_t>(sample),
                        static_cast<std::uint32_t>(sample >> 32)};
  philox4x32(c, key);
  return c[within & 3];
}

/// An element is dropped when its bits are below this: round(p · 2³²), so it is dropped with
/// probability p to within 2⁻³². REQUIRES: 0 <= p < 1.
inline std::uint32_t dropout_threshold(float p) {
  const double t = static_cast<double>(p) * 4294967296.0 + 0.5;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<std::uint32_t>(t);
}

/// The factor kept elements are multiplied by (inverted dropout): 1 / (1 − p) in fp32.
inline float dropout_scale(float p) { return 1.0f / (1.0f - p); }

}  // namespace troupe::core
