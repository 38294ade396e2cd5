// Per-block sums of squares for the global gradient norm: out[i] = Σ x² over elements
// [i·norm_block, (i+1)·norm_block) of an fp32 buffer, in fp64. One warp per norm block (eight per
// CUDA block), so a block's sum depends only on its own elements (the split-invariance backend.hpp
// promises), and its fixed-order reduction (each lane's elements in order, then the lanes'
// butterfly) gives the same bits every run. A whole CUDA block per norm block, as before, spent the
// kernel on launching 160k tiny blocks (0.26 ms for 124M parameters on the H200, half the DRAM
// rate). Squares of floats are exact in fp64; only the additions round, so the CPU's differently
// ordered sum agrees to ~1e-16 relative. sumsq_blocks_list does many tensors per launch with the
// same per-block code, hence the same bits.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

constexpr int sumsq_warps = 8;

/// Sum of squares of norm block `blk` of x[0, n) by one warp; the result is in every lane. `vec`:
/// x is 16-byte aligned, so a full norm block is read as float4 (norm_block is a multiple of 128
/// elements).
__device__ __forceinline__ double sumsq_one_block(const float* x, std::int64_t n, std::int64_t blk,
                                                  int lane, bool vec) {
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
  return warp_sum(s);
}

__global__ void sumsq_blocks_kernel(const float* x, std::int64_t n, double* out,
                                    std::int64_t blocks, bool vec) {
  const std::int64_t blk = static_cast<std::int64_t>(blockIdx.x) * sumsq_warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= blocks) return;
  const double s = sumsq_one_block(x, n, blk, lane, vec);
  if (lane == 0) out[blk] = s;
}

/// Tensors per launch of sumsq_list_kernel: the table is a kernel parameter (3.2 KB, under the
/// classic 4 KB limit).
constexpr int sumsq_list_max = 128;

struct sumsq_list_table {
  const float* x[sumsq_list_max];
  std::int64_t n[sumsq_list_max];
  std::int64_t first[sumsq_list_max];  // first output block of each tensor, ascending
  unsigned char vec[sumsq_list_max];
  int count;
};

/// One warp per output block, over the blocks of up to 128 tensors: the tensor is found by binary
/// search over the first blocks, and its block summed exactly as sumsq_blocks_kernel does.
__global__ void sumsq_list_kernel(const __grid_constant__ sumsq_list_table t, double* out,
                                  std::int64_t blocks) {
  const std::int64_t blk = static_cast<std::int64_t>(blockIdx.x) * sumsq_warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= blocks) return;
  int lo = 0, hi = t.count - 1;  // the last tensor whose first block is <= blk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first[mid] <= blk)
      lo = mid;
    else
      hi = mid - 1;
  }
  const double s = sumsq_one_block(t.x[lo], t.n[lo], blk - t.first[lo], lane, t.vec[lo] != 0);
  if (lane == 0) out[blk] = s;
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

void cuda_backend::sumsq_blocks(const tensor& x, tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda sumsq_blocks";
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

void cuda_backend::sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda sumsq_blocks_list";
  require_type(out, dtype::f64, op, "out");
  std::int64_t total = 0;
  for (const tensor& x : xs) {
    require_type(x, dtype::f32, op, "xs[]");
    total += (x.numel() + norm_block - 1) / norm_block;
  }
  require_numel(out, total, op, "out (the blocks of every tensor)");
  std::int64_t at = 0;  // first output block of the next launch
  std::size_t i = 0;
  while (i < xs.size()) {
    sumsq_list_table t{};
    std::int64_t blocks = 0;
    for (; i < xs.size() && t.count < sumsq_list_max; ++i) {
      const std::int64_t nb = (xs[i].numel() + norm_block - 1) / norm_block;
      if (nb == 0) continue;
      t.x[t.count] = xs[i].data<float>();
      t.n[t.count] = xs[i].numel();
      t.first[t.count] = blocks;
      t.vec[t.count] = aligned16(xs[i].raw()) ? 1 : 0;
      ++t.count;
      blocks += nb;
    }
    if (blocks == 0) continue;
    const unsigned grid = static_cast<unsigned>((blocks + sumsq_warps - 1) / sumsq_warps);
    sumsq_list_kernel<<<grid, sumsq_warps * 32, 0, s>>>(t, out.data<double>() + at, blocks);
    TROUPE_CUDA_CHECK_LAUNCH();
    at += blocks;
  }
}

}  // namespace troupe::kernels::cuda
