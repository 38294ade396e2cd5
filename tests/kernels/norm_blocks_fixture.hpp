// A gradient buffer laid out as a chunk's flat buffer is (each tensor at a multiple of norm_block
// elements, padded after it), for the tests of backend::message_hash_sumsq_blocks: the counts of
// each message-hash block that a norm takes, and the tensors those blocks belong to.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "kernels/message_hash.hpp"

namespace troupe::kernels::testing {

struct norm_layout {
  struct piece {
    std::int64_t offset, numel;
    bool counted;  // in the norm (a tied copy, or another tensor-parallel rank's, is not)
  };
  std::vector<piece> pieces;
  std::int64_t numel = 0;  // the buffer's elements (may end in a short block)
};

/// `count` tensors of assorted lengths (whole blocks, one element, a block less one, several
/// blocks and a bit), every fifth left out of the norm, then `tail` elements of padding.
inline norm_layout assorted_layout(int count, std::int64_t tail) {
  norm_layout l;
  std::int64_t at = 0;
  for (int k = 0; k < count; ++k) {
    const std::int64_t n = k % 4 == 0   ? norm_block * (1 + k % 3)
                           : k % 4 == 1 ? 1 + (k * 389) % (norm_block - 1)
                           : k % 4 == 2 ? norm_block - 1
                                        : 2 * norm_block + 5 + k;
    l.pieces.push_back({at, n, k % 5 != 3});
    at += (n + norm_block - 1) / norm_block * norm_block;
  }
  l.numel = at + tail;
  return l;
}

/// message_hash_sumsq_blocks' counts for `l`: int32, one per block.
inline core::tensor counts_of(const norm_layout& l) {
  const auto nb = static_cast<std::int64_t>(message_hash_blocks_of(l.numel * sizeof(float)));
  core::tensor c = core::tensor::zeros({nb}, core::dtype::i32);
  for (const auto& p : l.pieces) {
    if (!p.counted) continue;
    for (std::int64_t e = 0; e < p.numel; e += norm_block)
      c.data<std::int32_t>()[(p.offset + e) / norm_block] =
          static_cast<std::int32_t>(std::min(norm_block, p.numel - e));
  }
  return c;
}

/// The counted tensors of `l` as views of `x`, and the first block of each.
inline std::vector<core::tensor> counted_views(const norm_layout& l, const core::tensor& x,
                                               std::vector<std::int64_t>* first = nullptr) {
  std::vector<core::tensor> v;
  for (const auto& p : l.pieces)
    if (p.counted) {
      v.push_back(x.slice(p.offset, {p.numel}));
      if (first) first->push_back(p.offset / norm_block);
    }
  return v;
}

}  // namespace troupe::kernels::testing
