// XXH3-64 (seed 0) of one 4096-byte message-hash block of fp32 values that a warp holds in
// registers, for kernels that hash what they read or write anyway (adamw_block_kernel in adamw.cu,
// hash_sumsq_kernel in sumsq.cu). The layout is sumsq's norm blocks': lane l holds float4 32j + l
// of the block for j = 0..7, taken two j at a time (a 1 KiB round: j = 2r and 2r + 1). As 16-byte
// pieces of XXH3's 64-byte stripes, float4 32j + l is quarter l % 4 of stripe 8j + l / 4, so lane
// l feeds accumulators 2(l % 4) and 2(l % 4) + 1 (hash_blocks_kernel in message_hash.cu). The
// accumulation is addition modulo 2^64, so the 16 stripes of a round are summed in any order:
// across the eight lanes of a quarter by shuffles, before the round's scramble. The round ends, the
// last stripe and the merge are XXH3's for 4096 bytes (kernels/message_hash.hpp).
#pragma once

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/message_hash.hpp"

namespace troupe::kernels::cuda {

/// The 64-bit key word at byte offset o of a secret held as 24 words (xxh3::key::u64, seed 0).
__device__ __forceinline__ std::uint64_t secret_u64(const std::uint64_t* kw, unsigned o) {
  const unsigned i = o >> 3, b = o & 7;
  return b == 0 ? kw[i] : (kw[i] >> (8 * b)) | (kw[i + 1] << (64 - 8 * b));
}

/// One warp's XXH3 state for one full block. `kw`: XXH3's default secret as words (shared memory).
struct warp_block_xxh3 {
  unsigned q;  // the quarter of each stripe this lane holds
  std::uint64_t a0, a1;

  __device__ __forceinline__ explicit warp_block_xxh3(int lane)
      : q(static_cast<unsigned>(lane % 4)),
        a0(q == 0 ? xxh3::p32_3 : q == 1 ? xxh3::p64_2 : q == 2 ? xxh3::p64_4 : xxh3::p64_5),
        a1(q == 0 ? xxh3::p64_1 : q == 1 ? xxh3::p64_3 : q == 2 ? xxh3::p32_2 : xxh3::p32_1) {}

  /// Round r (0..3): v[h] is float4 32(2r + h) + lane of the block. Every lane of the warp calls
  /// it.
  __device__ __forceinline__ void round(const pack<float, 4> (&v)[2], int r, int lane,
                                        const std::uint64_t* kw) {
    std::uint64_t s0 = 0, s1 = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Stripe 8h + lane / 4 of the round, quarter q; the block's last stripe takes the secret at
      // byte 121 (XXH3's last 64 bytes) in place of its round key.
      const unsigned stripe = 8 * h + static_cast<unsigned>(lane / 4);
      const bool tail = r == 3 && stripe == 15;
      const std::uint64_t k0 = tail ? secret_u64(kw, 121 + 16 * q) : kw[stripe + 2 * q];
      const std::uint64_t k1 = tail ? secret_u64(kw, 129 + 16 * q) : kw[stripe + 2 * q + 1];
      const std::uint64_t w0 = static_cast<std::uint64_t>(__float_as_uint(v[h].v[0])) |
                               (static_cast<std::uint64_t>(__float_as_uint(v[h].v[1])) << 32);
      const std::uint64_t w1 = static_cast<std::uint64_t>(__float_as_uint(v[h].v[2])) |
                               (static_cast<std::uint64_t>(__float_as_uint(v[h].v[3])) << 32);
      const std::uint64_t v0 = w0 ^ k0, v1 = w1 ^ k1;
      s0 += w1 + (v0 & 0xFFFFFFFFull) * (v0 >> 32);
      s1 += w0 + (v1 & 0xFFFFFFFFull) * (v1 >> 32);
    }
    // The round's sum over the eight lanes of quarter q.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, off);
      s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, off);
    }
    a0 += s0;
    a1 += s1;
    if (r < 3) {
      a0 = xxh3::scramble(a0, kw[16 + 2 * q]);
      a1 = xxh3::scramble(a1, kw[17 + 2 * q]);
    }
  }

  /// The merge of the accumulators after the four rounds, in every lane: every lane of the warp
  /// calls it, and digest() of it gives the block's digest.
  __device__ __forceinline__ std::uint64_t merged(const std::uint64_t* kw) const {
    std::uint64_t hq =
        xxh3::mul_fold(a0 ^ secret_u64(kw, 11 + 16 * q), a1 ^ secret_u64(kw, 19 + 16 * q));
    hq += __shfl_xor_sync(0xFFFFFFFFu, hq, 1);
    hq += __shfl_xor_sync(0xFFFFFFFFu, hq, 2);
    return hq;
  }
  /// The block's digest from merged().
  __device__ __forceinline__ static std::uint64_t digest(std::uint64_t merged) {
    return xxh3::avalanche(static_cast<std::uint64_t>(message_hash_block) * xxh3::p64_1 + merged);
  }
};

}  // namespace troupe::kernels::cuda
