// The message hash: the 64-bit digest of a tensor's bytes that message logs hold (docs/replay.md),
// defined so that a GPU computes it in parallel where the tensor lives and the CPU gets the same
// bits.
//
// Definition, for a byte string x of n bytes:
//   level 0: data = x, seed = 0
//   while len(data) > message_hash_block:
//     digests = XXH64(block_i, seed) for the consecutive message_hash_block-byte blocks of data
//               (the last one may be shorter), each as 8 little-endian bytes
//     seed = len(data); data = the digests, concatenated
//   hash = XXH64(data, seed)
// so a tensor of at most 4096 bytes hashes to its plain XXH64 (seed 0), and every block of a
// level is independent work. XXH64 is the published xxHash64 algorithm.
//
// This header holds the XXH64 core as host-and-device code over a byte reader (the CUDA kernel in
// kernels/cuda/message_hash.cu runs it); message_hash() below is the CPU twin, built on
// libxxhash's XXH64 for the blocks, so each side checks the other (tests/kernels).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define TROUPE_HD __host__ __device__ __forceinline__
#else
#define TROUPE_HD inline
#endif

namespace troupe::kernels {

/// Bytes per block of every level of the message hash.
inline constexpr std::size_t message_hash_block = 4096;

/// The message hash of n bytes (the CPU twin of the CUDA kernel).
std::uint64_t message_hash(const void* data, std::size_t n);

namespace xxh {

inline constexpr std::uint64_t p1 = 0x9E3779B185EBCA87ull;
inline constexpr std::uint64_t p2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr std::uint64_t p3 = 0x165667B19E3779F9ull;
inline constexpr std::uint64_t p4 = 0x85EBCA77C2B2AE63ull;
inline constexpr std::uint64_t p5 = 0x27D4EB2F165667C5ull;

TROUPE_HD std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
TROUPE_HD std::uint64_t round(std::uint64_t acc, std::uint64_t in) {
  acc += in * p2;
  return rotl(acc, 31) * p1;
}
TROUPE_HD std::uint64_t merge(std::uint64_t h, std::uint64_t v) {
  h ^= round(0, v);
  return h * p1 + p4;
}

/// XXH64 of n bytes read through `r`, which gives `stripe(off, v)` (the four little-endian 64-bit
/// words at byte offset off), `u64(off)`, `u32(off)` and `u8(off)`.
template <class Reader>
TROUPE_HD std::uint64_t xxh64(const Reader& r, std::uint64_t n, std::uint64_t seed) {
  std::uint64_t off = 0, h;
  if (n >= 32) {
    std::uint64_t v1 = seed + p1 + p2, v2 = seed + p2, v3 = seed, v4 = seed - p1;
    const std::uint64_t stripes_end = n - n % 32;
#ifdef __CUDA_ARCH__
#pragma unroll 4  // four stripes' loads in flight per thread
#endif
    for (; off < stripes_end; off += 32) {
      std::uint64_t w[4];
      r.stripe(off, w);
      v1 = round(v1, w[0]);
      v2 = round(v2, w[1]);
      v3 = round(v3, w[2]);
      v4 = round(v4, w[3]);
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(h, v1);
    h = merge(h, v2);
    h = merge(h, v3);
    h = merge(h, v4);
  } else {
    h = seed + p5;
  }
  h += n;
  for (; off + 8 <= n; off += 8) {
    h ^= round(0, r.u64(off));
    h = rotl(h, 27) * p1 + p4;
  }
  if (off + 4 <= n) {
    h ^= static_cast<std::uint64_t>(r.u32(off)) * p1;
    h = rotl(h, 23) * p2 + p3;
    off += 4;
  }
  for (; off < n; ++off) {
    h ^= static_cast<std::uint64_t>(r.u8(off)) * p5;
    h = rotl(h, 11) * p1;
  }
  h ^= h >> 33;
  h *= p2;
  h ^= h >> 29;
  h *= p3;
  h ^= h >> 32;
  return h;
}

/// A reader of bytes at any alignment, one byte at a time (little-endian assembly).
struct byte_reader {
  const unsigned char* p;
  TROUPE_HD std::uint64_t u64(std::uint64_t off) const {
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[off + i];
    return v;
  }
  TROUPE_HD std::uint32_t u32(std::uint64_t off) const {
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | p[off + i];
    return v;
  }
  TROUPE_HD std::uint8_t u8(std::uint64_t off) const { return p[off]; }
  TROUPE_HD void stripe(std::uint64_t off, std::uint64_t* w) const {
    for (int i = 0; i < 4; ++i) w[i] = u64(off + 8 * i);
  }
};

}  // namespace xxh
}  // namespace troupe::kernels
