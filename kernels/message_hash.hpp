// The message hash: the 64-bit digest of a tensor's bytes that message logs hold (docs/replay.md),
// defined so that a GPU computes it in parallel where the tensor lives and the CPU gets the same
// bits.
//
// Definition, for a byte string x of n bytes and a leaf hash H(bytes, seed):
//   level 0: data = x, seed = 0
//   while len(data) > message_hash_block:
//     digests = H(block_i, seed) for the consecutive message_hash_block-byte blocks of data
//               (the last one may be shorter), each as 8 little-endian bytes
//     seed = len(data); data = the digests, concatenated
//   hash = H(data, seed)
// so a tensor of at most 4096 bytes hashes to its plain H with seed 0, and every block of a level
// is independent work. Two leaf hashes exist, named by the message log's format: XXH3-64 (the
// current one, message_hash_def::xxh3: logs of format 3) and XXH64 (message_hash_def::xxh64: logs
// of format 2, which still replay). Both are the published xxHash algorithms; on the CPU XXH3
// (libxxhash's, with the processor's widest vectors) hashes two to three times as fast as XXH64
// on tensors that fit the caches (bench/message_hash_bench), which keeps recording cheap there.
//
// This header holds XXH3-64 as host-and-device code over a byte reader, written from the xxHash
// specification (the CUDA kernel in kernels/cuda/message_hash.cu runs it); message_hash() is the
// CPU twin, built on libxxhash for the leaves, so each side checks the other (tests/kernels).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define TROUPE_HASH_HD __host__ __device__ __forceinline__
#else
#define TROUPE_HASH_HD inline
#endif

namespace troupe::kernels {

/// Bytes per block of every level of the message hash.
inline constexpr std::size_t message_hash_block = 4096;

/// The leaf hash of a message hash; a message log's format says which one its hashes use.
enum class message_hash_def {
  xxh64,  // XXH64 leaves: message logs of format 2
  xxh3,   // XXH3-64 leaves: message logs of format 3, the ones written now
};
/// The definition recording uses (the backends' message_hash_async computes it).
inline constexpr message_hash_def message_hash_current = message_hash_def::xxh3;

/// The message hash of n bytes under `def` (the CPU twin of the CUDA kernel, which computes the
/// current definition).
std::uint64_t message_hash(const void* data, std::size_t n,
                           message_hash_def def = message_hash_current);

/// Blocks of the first level of a message hash of n bytes: ceil(n / message_hash_block).
inline constexpr std::size_t message_hash_blocks_of(std::size_t n) {
  return (n + message_hash_block - 1) / message_hash_block;
}
/// The first level of the current definition: out[i] = H(block i of the n bytes, seed 0), for the
/// message_hash_blocks_of(n) blocks. What a kernel that reads a tensor anyway can compute on the
/// way (the CUDA backend's adamw_runs_hashed), leaving the rest to message_hash_of_blocks.
void message_hash_blocks(const void* data, std::size_t n, std::uint64_t* out);
/// The message hash (current definition) of n bytes whose first level is `blocks`
/// (message_hash_blocks_of(n) digests): equal to message_hash(data, n).
std::uint64_t message_hash_of_blocks(const std::uint64_t* blocks, std::size_t n);

namespace xxh3 {

inline constexpr std::uint64_t p32_1 = 0x9E3779B1ull;
inline constexpr std::uint64_t p32_2 = 0x85EBCA77ull;
inline constexpr std::uint64_t p32_3 = 0xC2B2AE3Dull;
inline constexpr std::uint64_t p64_1 = 0x9E3779B185EBCA87ull;
inline constexpr std::uint64_t p64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr std::uint64_t p64_3 = 0x165667B19E3779F9ull;
inline constexpr std::uint64_t p64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr std::uint64_t p64_5 = 0x27D4EB2F165667C5ull;
inline constexpr std::uint64_t mx1 = 0x165667919E3779F9ull;
inline constexpr std::uint64_t mx2 = 0x9FB21C651E98DF25ull;

/// XXH3's 192-byte secret as 24 little-endian 64-bit words.
struct secret {
  std::uint64_t w[24];
};
/// The default secret of the specification (its bytes b8 fe 6c 39 ... 4b 40 7e, read as words).
inline constexpr secret default_secret = {{
    0xBE4BA423396CFEB8ull, 0x1CAD21F72C81017Cull, 0xDB979083E96DD4DEull, 0x1F67B3B7A4A44072ull,
    0x78E5C0CC4EE679CBull, 0x2172FFCC7DD05A82ull, 0x8E2443F7744608B8ull, 0x4C263A81E69035E0ull,
    0xCB00C391BB52283Cull, 0xA32E531B8B65D088ull, 0x4EF90DA297486471ull, 0xD8ACDEA946EF1938ull,
    0x3F349CE33F76FAA8ull, 0x1D4F0BC7C7BBDCF9ull, 0x3159B4CD4BE0518Aull, 0x647378D9C97E9FC8ull,
    0xC3EBD33483ACC5EAull, 0xEB6313FAFFA081C5ull, 0x49DAF0B751DD0D17ull, 0x9E68D429265516D3ull,
    0xFCA1477D58BE162Bull, 0xCE31D07AD1B8F88Full, 0x280416958F3ACB45ull, 0x7E404BBBCAFBD7AFull,
}};

TROUPE_HASH_HD std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
TROUPE_HASH_HD std::uint32_t bswap32(std::uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0xFF00u) | ((x << 8) & 0xFF0000u) | (x << 24);
}
TROUPE_HASH_HD std::uint64_t bswap64(std::uint64_t x) {
  return (static_cast<std::uint64_t>(bswap32(static_cast<std::uint32_t>(x))) << 32) |
         bswap32(static_cast<std::uint32_t>(x >> 32));
}
/// The 128-bit product of a and b, its halves xor-ed.
TROUPE_HASH_HD std::uint64_t mul_fold(std::uint64_t a, std::uint64_t b) {
#ifdef __CUDA_ARCH__
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<std::uint64_t>(p) ^ static_cast<std::uint64_t>(p >> 64);
#endif
}
TROUPE_HASH_HD std::uint64_t avalanche(std::uint64_t h) {
  h ^= h >> 37;
  h *= mx1;
  return h ^ (h >> 32);
}
TROUPE_HASH_HD std::uint64_t avalanche_xxh64(std::uint64_t h) {
  h ^= h >> 33;
  h *= p64_2;
  h ^= h >> 29;
  h *= p64_3;
  return h ^ (h >> 32);
}

/// XXH3's scramble of one accumulator after each full 1024-byte block, with its secret word.
TROUPE_HASH_HD std::uint64_t scramble(std::uint64_t acc, std::uint64_t key_word) {
  acc ^= acc >> 47;
  acc ^= key_word;
  return acc * p32_1;
}

/// The secret's bytes read as little-endian words at any byte offset. Long inputs with a seed
/// use the secret derived from it: word 2i plus the seed, word 2i+1 minus it.
struct key {
  const secret& s;
  std::uint64_t seed;  // 0 for the default secret itself
  TROUPE_HASH_HD std::uint64_t word(unsigned i) const { return s.w[i] + ((i & 1) ? 0 - seed : seed); }
  TROUPE_HASH_HD std::uint64_t u64(unsigned off) const {
    const unsigned i = off >> 3, b = off & 7;
    if (b == 0) return word(i);
    return (word(i) >> (8 * b)) | (word(i + 1) << (64 - 8 * b));
  }
  TROUPE_HASH_HD std::uint32_t u32(unsigned off) const { return static_cast<std::uint32_t>(u64(off)); }
};

/// The 16 bytes of data at `off` mixed with the secret's 16 bytes at `koff`.
template <class Reader>
TROUPE_HASH_HD std::uint64_t mix16(const Reader& r, std::uint64_t off, const key& k, unsigned koff,
                              std::uint64_t seed) {
  return mul_fold(r.u64(off) ^ (k.u64(koff) + seed), r.u64(off + 8) ^ (k.u64(koff + 8) - seed));
}

/// One 64-byte stripe (w, 8 words) into the 8 accumulators, with the secret's 64 bytes at koff.
TROUPE_HASH_HD void accumulate(std::uint64_t* acc, const std::uint64_t* w, const key& k, unsigned koff) {
  for (int i = 0; i < 8; ++i) {
    const std::uint64_t v = w[i] ^ k.u64(koff + 8 * i);
    acc[i ^ 1] += w[i];
    acc[i] += (v & 0xFFFFFFFFull) * (v >> 32);
  }
}

/// XXH3-64 of n bytes read through `r` (as xxh64's readers: `stripe(off, v)` gives the four
/// little-endian words at off, called at multiples of 32; `u64`, `u32`, `u8` at any offset),
/// with `seed` and the secret `s` (default_secret for the published XXH3_64bits_withSeed).
template <class Reader>
TROUPE_HASH_HD std::uint64_t xxh3_64(const Reader& r, std::uint64_t n, std::uint64_t seed,
                                const secret& s) {
  const key k{s, 0};
  if (n <= 16) {
    if (n > 8) {
      const std::uint64_t lo = ((k.u64(24) ^ k.u64(32)) + seed) ^ r.u64(0);
      const std::uint64_t hi = ((k.u64(40) ^ k.u64(48)) - seed) ^ r.u64(n - 8);
      return avalanche(n + bswap64(lo) + hi + mul_fold(lo, hi));
    }
    if (n >= 4) {
      const std::uint64_t s2 =
          seed ^ (static_cast<std::uint64_t>(bswap32(static_cast<std::uint32_t>(seed))) << 32);
      const std::uint64_t in = r.u32(n - 4) | (static_cast<std::uint64_t>(r.u32(0)) << 32);
      std::uint64_t v = ((k.u64(8) ^ k.u64(16)) - s2) ^ in;
      v ^= rotl(v, 49) ^ rotl(v, 24);
      v *= mx2;
      v ^= (v >> 35) + n;
      v *= mx2;
      return v ^ (v >> 28);
    }
    if (n > 0) {
      const std::uint32_t c = static_cast<std::uint32_t>(r.u8(n - 1)) |
                              (static_cast<std::uint32_t>(n) << 8) |
                              (static_cast<std::uint32_t>(r.u8(0)) << 16) |
                              (static_cast<std::uint32_t>(r.u8(n >> 1)) << 24);
      return avalanche_xxh64((static_cast<std::uint64_t>(k.u32(0) ^ k.u32(4)) + seed) ^ c);
    }
    return avalanche_xxh64(seed ^ k.u64(56) ^ k.u64(64));
  }
  if (n <= 128) {
    std::uint64_t acc = n * p64_1;
    const std::uint64_t rounds = ((n - 1) >> 5) + 1;
    for (std::uint64_t i = 0; i < rounds; ++i) {
      acc += mix16(r, 16 * i, k, static_cast<unsigned>(32 * i), seed);
      acc += mix16(r, n - 16 * i - 16, k, static_cast<unsigned>(32 * i + 16), seed);
    }
    return avalanche(acc);
  }
  if (n <= 240) {
    std::uint64_t acc = n * p64_1;
    for (unsigned i = 0; i < 8; ++i) acc += mix16(r, 16 * i, k, 16 * i, seed);
    acc = avalanche(acc);
    const std::uint64_t chunks = n >> 4;
    for (std::uint64_t i = 8; i < chunks; ++i)
      acc += mix16(r, 16 * i, k, static_cast<unsigned>(16 * (i - 8) + 3), seed);
    acc += mix16(r, n - 16, k, 119, seed);
    return avalanche(acc);
  }
  // Long input: 8 accumulators over 64-byte stripes, 16 stripes per 1024-byte block, the
  // accumulators scrambled after each full block; the last block (1 to 1024 bytes) is left for the
  // end, whose last 64 bytes are one more stripe.
  const key lk{s, seed};
  std::uint64_t acc[8] = {p32_3, p64_1, p64_2, p64_3, p64_4, p32_2, p64_5, p32_1};
  std::uint64_t w[8];
  const std::uint64_t blocks = (n - 1) / 1024;
  for (std::uint64_t b = 0; b < blocks; ++b) {
#ifdef __CUDA_ARCH__
#pragma unroll 4
#endif
    for (unsigned i = 0; i < 16; ++i) {
      r.stripe(1024 * b + 64 * i, w);
      r.stripe(1024 * b + 64 * i + 32, w + 4);
      accumulate(acc, w, lk, 8 * i);
    }
    for (unsigned i = 0; i < 8; ++i) acc[i] = scramble(acc[i], lk.u64(128 + 8 * i));
  }
  const std::uint64_t last = 1024 * blocks;
  const unsigned stripes = static_cast<unsigned>((n - last - 1) / 64);
  for (unsigned i = 0; i < stripes; ++i) {
    r.stripe(last + 64 * i, w);
    r.stripe(last + 64 * i + 32, w + 4);
    accumulate(acc, w, lk, 8 * i);
  }
  for (int i = 0; i < 8; ++i) w[i] = r.u64(n - 64 + 8 * i);
  accumulate(acc, w, lk, 121);
  std::uint64_t h = n * p64_1;
  for (unsigned i = 0; i < 4; ++i)
    h += mul_fold(acc[2 * i] ^ lk.u64(11 + 16 * i), acc[2 * i + 1] ^ lk.u64(19 + 16 * i));
  return avalanche(h);
}

/// A reader of bytes at any alignment, one byte at a time (little-endian assembly).
struct byte_reader {
  const unsigned char* p;
  TROUPE_HASH_HD std::uint64_t u64(std::uint64_t off) const {
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[off + i];
    return v;
  }
  TROUPE_HASH_HD std::uint32_t u32(std::uint64_t off) const {
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | p[off + i];
    return v;
  }
  TROUPE_HASH_HD std::uint8_t u8(std::uint64_t off) const { return p[off]; }
  TROUPE_HASH_HD void stripe(std::uint64_t off, std::uint64_t* w) const {
    for (int i = 0; i < 4; ++i) w[i] = u64(off + 8 * i);
  }
};

}  // namespace xxh3
}  // namespace troupe::kernels

#undef TROUPE_HASH_HD
