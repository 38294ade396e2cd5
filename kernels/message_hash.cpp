#include "kernels/message_hash.hpp"

#include <xxhash.h>

#include <algorithm>
#include <vector>

namespace troupe::kernels {

std::uint64_t message_hash(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t seed = 0;
  std::vector<std::uint64_t> digests;  // the next level (little-endian words on every host we build for)
  std::vector<std::uint64_t> held;     // the level being read, once it is made of digests
  while (n > message_hash_block) {
    const std::size_t count = (n + message_hash_block - 1) / message_hash_block;
    digests.resize(count);
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t off = i * message_hash_block;
      digests[i] = XXH64(p + off, std::min(message_hash_block, n - off), seed);
    }
    seed = n;
    held.swap(digests);
    p = reinterpret_cast<const unsigned char*>(held.data());
    n = count * sizeof(std::uint64_t);
  }
  return XXH64(p, n, seed);
}

}  // namespace troupe::kernels
