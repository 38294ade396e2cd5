// Counter-based random streams. A stream is named by a key derived from (seed, purpose, step,
// micro-batch, layer, ...) and draws the i-th number as a pure function of (key, i), so results
// never depend on which rank or thread asks, or in which order (docs/design.md, Determinism
// contract). Distributions are written here rather than taken from <random>, whose outputs are
// implementation-defined.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace troupe::core {

/// SplitMix64 finaliser: a bijective 64-bit mixer.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// FNV-1a of a string, for keying streams by parameter name.
constexpr std::uint64_t hash_name(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

/// A stream key from a seed and any number of integer coordinates.
template <class... Ts>
constexpr std::uint64_t stream_key(std::uint64_t seed, Ts... coords) {
  std::uint64_t k = mix64(seed);
  ((k = mix64(k ^ static_cast<std::uint64_t>(coords))), ...);
  return k;
}

/// Draws from one keyed stream; `counter` is the position, which checkpoints may save.
class rng_stream {
 public:
  explicit rng_stream(std::uint64_t key, std::uint64_t counter = 0) : key_(key), counter_(counter) {}
  std::uint64_t next_u64() { return mix64(key_ ^ mix64(counter_++)); }
  /// Uniform in [0, 1) with 24 random bits.
  float uniform() { return static_cast<float>(next_u64() >> 40) * (1.0f / 16777216.0f); }
  /// Uniform integer in [0, n). REQUIRES: n > 0.
  std::uint64_t below(std::uint64_t n) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }
  /// Standard normal (Box-Muller, double precision inside).
  float normal() {
    double u1 = (static_cast<double>(next_u64() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0);
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  std::uint64_t key() const { return key_; }
  std::uint64_t counter() const { return counter_; }

 private:
  std::uint64_t key_;
  std::uint64_t counter_;
};

}  // namespace troupe::core
