// Per-block sums of squares for the global gradient norm: out[i] = Σ x² over elements
// [i·norm_block, (i+1)·norm_block) of an fp32 buffer, in fp64. One warp per norm block (eight per
// CUDA block), so a block's sum depends only on its own elements (the split-invariance backend.hpp
// promises), and its fixed-order reduction (each lane's elements in order, then the lanes'
// butterfly) gives the same bits every run. A whole CUDA block per norm block, as before, spent the
// kernel on launching 160k tiny blocks (0.26 ms for 124M parameters on the H200, half the DRAM
// rate). Squares of floats are exact in fp64; only the additions round, so the CPU's differently
// ordered sum agrees to ~1e-16 relative.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

constexpr int sumsq_warps = 8;

/// `vec`: x is 16-byte aligned, so full norm blocks are read as float4 (norm_block is a multiple
/// of 128 elements).
__global__ void sumsq_blocks_kernel(const float* x, std::int64_t n, double* out,
                                    std::int64_t blocks, bool vec) {
  const std::int64_t blk = static_cast<std::int64_t>(blockIdx.x) * sumsq_warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= blocks) return;
  const std::int64_t begin = blk * norm_block;
  const std::int64_t end = begin + norm_block < n ? begin + norm_block : n;
  double s = 0.0;
  if (vec && end - begin == norm_block) {
    const float4* x4 = reinterpret_cast<const float4*>(x + begin);
    float4 v[norm_block / 128];
#pragma unroll
    for (int j = 0; j < norm_block / 128; ++j) v[j] = x4[j * 32 + lane];
#pragma unroll
    for (int j = 0; j < norm_block / 128; ++j) {
      const double a = v[j].x, b = v[j].y, c = v[j].z, d = v[j].w;
      s += a * a;
      s += b * b;
      s += c * c;
      s += d * d;
    }
  } else {
    for (std::int64_t i = begin + lane; i < end; i += 32) {
      const double v = x[i];
      s += v * v;
    }
  }
  s = warp_sum(s);
  if (lane == 0) out[blk] = s;
}

// ------------------------------------------------------------------------------------------------
// launchers

void launch_sumsq_blocks(const tensor& x, tensor& out, cudaStream_t s) {
  const char* op = "sumsq_blocks";
  require_type(x, dtype::f32, op, "x");
  require_type(out, dtype::f64, op, "out");
  const std::int64_t n = x.numel(), blocks = (n + norm_block - 1) / norm_block;
  require_numel(out, blocks, op, "out (ceil(x.numel() / norm_block))");
  if (blocks == 0) return;
  static_assert(norm_block % 128 == 0, "the float4 path reads 128 elements per warp and step");
  const unsigned grid = static_cast<unsigned>((blocks + sumsq_warps - 1) / sumsq_warps);
  sumsq_blocks_kernel<<<grid, sumsq_warps * 32, 0, s>>>(x.data<float>(), n, out.data<double>(),
                                                        blocks, aligned16(x.raw()));
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
