// Per-block sums of squares for the global gradient norm: out[i] = Σ x² over elements
// [i·norm_block, (i+1)·norm_block) of an fp32 buffer, in fp64. One CUDA block per norm block, so a
// block's sum depends only on its own elements (the split-invariance backend.hpp promises) and the
// fixed-order reduction gives the same bits every run. Squares of floats are exact in fp64; only the
// additions round, so the CPU's differently ordered sum agrees to ~1e-16 relative.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

__global__ void sumsq_blocks_kernel(const float* x, std::int64_t n, double* out) {
  __shared__ double red[32];
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * norm_block;
  const std::int64_t end = begin + norm_block < n ? begin + norm_block : n;
  double s = 0.0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const double v = x[i];
    s += v * v;
  }
  s = block_sum(s, red);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
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
  sumsq_blocks_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(x.data<float>(), n,
                                                                    out.data<double>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
