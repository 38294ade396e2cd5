#include "kernels/message_hash.hpp"

#include <xxhash.h>
#if defined(__x86_64__)
// libxxhash's XXH3 with the widest vectors the processor has (AVX-512, AVX2 or SSE2), chosen once
// at run time; the plain entry points use SSE2 only.
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#define TROUPE_XXH3_SEEDED XXH3_64bits_withSeed_dispatch
#else
#define TROUPE_XXH3_SEEDED XXH3_64bits_withSeed
#endif

#include <algorithm>
#include <vector>

namespace troupe::kernels {

namespace {

/// libxxhash's dispatched AVX2 / AVX-512 code returns with the upper halves of the vector
/// registers still in use (no vzeroupper), and then every legacy-SSE instruction of this thread
/// pays a transition penalty until something clears them: glibc's exp, which the CPU's
/// vocabulary-parallel loss calls per logit, ran 25 times slower after a hash. Clearing them
/// costs a cycle per 4 KiB block.
inline void clear_upper_vector_state() {
#if defined(__x86_64__)
  static const bool avx = __builtin_cpu_supports("avx");
  if (avx) __asm__ volatile("vzeroupper");
#endif
}

/// One level of the message hash (kernels/message_hash.hpp): out[i] = leaf(block i, seed).
template <class Leaf>
void level(const unsigned char* p, std::size_t n, std::uint64_t seed, std::uint64_t* out,
           Leaf leaf) {
  const std::size_t count = message_hash_blocks_of(n);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t off = i * message_hash_block;
    // The hardware prefetchers stop at page (4 KiB) boundaries, and a large tensor sent comes
    // from memory: ask for the block after next while this one is hashed.
    if (i + 2 < count) {
      const std::size_t ahead = off + 2 * message_hash_block;
      const std::size_t len = std::min(message_hash_block, n - ahead);
      for (std::size_t l = 0; l < len; l += 64) __builtin_prefetch(p + ahead + l);
    }
    out[i] = leaf(p + off, std::min(message_hash_block, n - off), seed);
  }
}

/// The message hash's levels from level `seed`'s data p[0, n) (seed 0: the tensor's own bytes)
/// over the leaf hash `leaf(p, n, seed)`.
template <class Leaf>
std::uint64_t levels(const unsigned char* p, std::size_t n, std::uint64_t seed, Leaf leaf) {
  std::vector<std::uint64_t> digests;  // the next level (little-endian words on every host we build for)
  std::vector<std::uint64_t> held;     // the level being read, once it is made of digests
  while (n > message_hash_block) {
    const std::size_t count = message_hash_blocks_of(n);
    digests.resize(count);
    level(p, n, seed, digests.data(), leaf);
    seed = n;
    held.swap(digests);
    p = reinterpret_cast<const unsigned char*>(held.data());
    n = count * sizeof(std::uint64_t);
  }
  return leaf(p, n, seed);
}

std::uint64_t xxh3_leaf(const void* q, std::size_t m, std::uint64_t s) {
  const std::uint64_t h = TROUPE_XXH3_SEEDED(q, m, s);
  clear_upper_vector_state();
  return h;
}

}  // namespace

std::uint64_t message_hash(const void* data, std::size_t n, message_hash_def def) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (def == message_hash_def::xxh64)
    return levels(p, n, 0, [](const void* q, std::size_t m, std::uint64_t s) { return XXH64(q, m, s); });
  return levels(p, n, 0, xxh3_leaf);
}

void message_hash_blocks(const void* data, std::size_t n, std::uint64_t* out) {
  level(static_cast<const unsigned char*>(data), n, 0, out, xxh3_leaf);
}

std::uint64_t message_hash_of_blocks(const std::uint64_t* blocks, std::size_t n) {
  // A tensor of one block hashes to that block's digest (seed 0); the empty one has no block.
  if (n <= message_hash_block) return n == 0 ? xxh3_leaf(nullptr, 0, 0) : blocks[0];
  return levels(reinterpret_cast<const unsigned char*>(blocks),
                message_hash_blocks_of(n) * sizeof(std::uint64_t), n, xxh3_leaf);
}

}  // namespace troupe::kernels
