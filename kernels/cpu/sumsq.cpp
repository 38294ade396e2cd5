// Per-block sums of squares for the global gradient norm: out[i] = Σ x² over elements
// [i*norm_block, (i+1)*norm_block), in fp64. Squares of floats are exact in double, so only the
// additions round; each block adds its elements in eight lanes (lane j takes the elements whose
// index within the block is j mod 8) combined pairwise (fast_math.hpp). A block's sum depends only
// on its own elements, so any partition of a buffer on block boundaries gives the same sums.
#include <algorithm>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

// Blocks [b0, b1) of the n elements at x.
TROUPE_SIMD_CLONES void sumsq_range(const float* x, std::int64_t n, double* out, std::int64_t b0,
                                    std::int64_t b1) {
  for (std::int64_t b = b0; b < b1; ++b) {
    const float* blk = x + b * norm_block;
    const std::int64_t len = std::min(norm_block, n - b * norm_block);
    double l[sum_lanes] = {};
    std::int64_t i = 0;
    for (; i + sum_lanes <= len; i += sum_lanes)
      for (int j = 0; j < sum_lanes; ++j) {
        const double v = blk[i + j];
        l[j] += v * v;
      }
    for (int j = 0; i + j < len; ++j) {
      const double v = blk[i + j];
      l[j] += v * v;
    }
    out[b] = combine_lanes(l);
  }
}

}  // namespace

void cpu_backend::sumsq_blocks(const tensor& x, tensor& out) {
  op_check c("sumsq_blocks", {{"x", &x}, {"out", &out}});
  c.host(x, "x", core::dtype::f32);
  c.host(out, "out", core::dtype::f64);
  const std::int64_t n = x.numel(), blocks = (n + norm_block - 1) / norm_block;
  c.numel(out, "out", blocks,
          "ceil(x.numel() / norm_block), norm_block = " + std::to_string(norm_block));
  const float* xp = x.data<float>();
  double* op = out.data<double>();
  parallel_for(blocks, 64,
               [&](std::int64_t b0, std::int64_t b1) { sumsq_range(xp, n, op, b0, b1); });
}

}  // namespace troupe::kernels::cpu
