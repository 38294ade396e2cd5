// The vocabulary-parallel cross-entropy on the GPU (kernels/backend.hpp; the host reference is
// kernels/vocab_parallel.cpp). A rank's block of logits z [n, cols] holds vocabulary columns
// [first, first + valid) of every row; the row statistics cross the group between the ops
// (model/tensor_parallel.cpp):
//   vp_row_max       this rank's row maxima            (all-gathered: maxima [tp·n])
//   vp_row_stats     Σ exp(z − m) and the target logit (summed over the group: sums [2n])
//   vp_losses        log Σ + m − z_target
//   vp_softmax_grad  (softmax − onehot) · grad_scale written over z
// with m the largest of every rank's maxima. One block per row; each thread takes a fixed set of
// columns and the block reduces in warp order, so the results are the same bits run to run.
// Exponentials and the sums are in fp64, as the host reference computes them.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {
namespace {

constexpr int vp_threads = 256;

/// The largest of v over the block, in every thread (shared: 32 floats).
__device__ __forceinline__ float block_max_of(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float m = shared[0];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, shared[w]);
  return m;
}

/// m_i: the largest of the tp ranks' maxima of row i (rank after rank).
__device__ __forceinline__ float global_max(const float* maxima, int tp, std::int64_t n,
                                            std::int64_t row) {
  float m = -INFINITY;
  for (int k = 0; k < tp; ++k) m = fmaxf(m, maxima[k * n + row]);
  return m;
}

__global__ void __launch_bounds__(vp_threads)
    vp_row_max_kernel(const float* z, std::int64_t cols, std::int64_t valid, float* row_max) {
  __shared__ float shared[32];
  const std::int64_t row = blockIdx.x;
  const float* x = z + row * cols;
  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, x[j]);
  m = block_max_of(m, shared);
  if (threadIdx.x == 0) row_max[row] = m;
}

__global__ void __launch_bounds__(vp_threads)
    vp_row_stats_kernel(const float* z, std::int64_t cols, std::int64_t valid, const float* maxima,
                        int tp, const int* targets, std::int64_t first, std::int64_t vocab,
                        std::int64_t n, float* stats) {
  __shared__ double shared[32];
  const std::int64_t row = blockIdx.x;
  const int t = targets[row];
  if (t < 0) {
    if (threadIdx.x == 0) stats[row] = stats[n + row] = 0.0f;
    return;
  }
  const float* x = z + row * cols;
  const double m = global_max(maxima, tp, n, row);
  double s = 0;
  for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += exp(static_cast<double>(x[j]) - m);
  s = block_sum(s, shared);
  if (threadIdx.x == 0) {
    const std::int64_t local = t - first;
    // A target outside the vocabulary (the CPU refuses it) turns the loss into NaN.
    stats[row] = t >= vocab ? __int_as_float(0x7fc00000) : static_cast<float>(s);
    stats[n + row] = local >= 0 && local < valid ? x[local] : 0.0f;
  }
}

__global__ void vp_losses_kernel(const float* maxima, int tp, const float* sums, const int* targets,
                                 std::int64_t n, float* losses) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const double m = global_max(maxima, tp, n, i);
    losses[i] = targets[i] < 0
                    ? 0.0f
                    : static_cast<float>(log(static_cast<double>(sums[i])) + (m - sums[n + i]));
  }
}

__global__ void __launch_bounds__(vp_threads)
    vp_softmax_grad_kernel(float* z, std::int64_t cols, std::int64_t valid, const float* maxima,
                           int tp, const float* sums, const int* targets, std::int64_t first,
                           std::int64_t n, float grad_scale) {
  const std::int64_t row = blockIdx.x;
  float* x = z + row * cols;
  const int t = targets[row];
  if (t < 0) {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) x[j] = 0.0f;
    return;
  }
  const double m = global_max(maxima, tp, n, row);
  const double f = grad_scale / static_cast<double>(sums[row]);
  const std::int64_t local = t - first;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float g = j < valid ? static_cast<float>(exp(static_cast<double>(x[j]) - m) * f) : 0.0f;
    if (j == local && local < valid) g -= grad_scale;
    x[j] = g;
  }
}

/// Checks z [n, cols] fp32 with valid <= cols; returns n.
std::int64_t check_block(const tensor& z, std::int64_t valid, const char* op) {
  require_type(z, dtype::f32, op, "z");
  require(z.rank() == 2, op, "z must be [n, cols], got " + core::shape_string(z.shape()));
  require(valid >= 0 && valid <= z.dim(1), op,
          std::to_string(valid) + " real columns of " + std::to_string(z.dim(1)));
  return z.dim(0);
}

/// The group size tp of maxima [tp·n].
int group_of(const tensor& maxima, std::int64_t n, const char* op) {
  require_type(maxima, dtype::f32, op, "maxima");
  require(n > 0 && maxima.numel() % n == 0 && maxima.numel() / n >= 1, op,
          std::to_string(maxima.numel()) + " maxima for " + std::to_string(n) + " rows");
  return static_cast<int>(maxima.numel() / n);
}

}  // namespace

void cuda_backend::vp_row_max(const tensor& z, std::int64_t valid, tensor& row_max) {
  activate();
  const char* op = "cuda vp_row_max";
  const std::int64_t n = check_block(z, valid, op);
  require_type(row_max, dtype::f32, op, "row_max");
  require_numel(row_max, n, op, "row_max");
  if (n == 0) return;
  vp_row_max_kernel<<<static_cast<unsigned>(n), vp_threads, 0, ctx_->stream>>>(
      z.data<float>(), z.dim(1), valid, row_max.data<float>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::vp_row_stats(const tensor& z, std::int64_t valid, const tensor& maxima,
                                const tensor& targets, std::int64_t first, std::int64_t vocab,
                                tensor& stats) {
  activate();
  const char* op = "cuda vp_row_stats";
  const std::int64_t n = check_block(z, valid, op);
  if (n == 0) return;
  const int tp = group_of(maxima, n, op);
  require_type(targets, dtype::i32, op, "targets");
  require_numel(targets, n, op, "targets");
  require_type(stats, dtype::f32, op, "stats");
  require_numel(stats, 2 * n, op, "stats");
  vp_row_stats_kernel<<<static_cast<unsigned>(n), vp_threads, 0, ctx_->stream>>>(
      z.data<float>(), z.dim(1), valid, maxima.data<float>(), tp, targets.data<int>(), first,
      vocab, n, stats.data<float>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::vp_losses(const tensor& maxima, const tensor& sums, const tensor& targets,
                             tensor& losses) {
  activate();
  const char* op = "cuda vp_losses";
  require_type(targets, dtype::i32, op, "targets");
  const std::int64_t n = targets.numel();
  if (n == 0) return;
  const int tp = group_of(maxima, n, op);
  require_type(sums, dtype::f32, op, "sums");
  require_numel(sums, 2 * n, op, "sums");
  require_type(losses, dtype::f32, op, "losses");
  require_numel(losses, n, op, "losses");
  vp_losses_kernel<<<grid_for(n, 256), 256, 0, ctx_->stream>>>(
      maxima.data<float>(), tp, sums.data<float>(), targets.data<int>(), n, losses.data<float>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::vp_softmax_grad(tensor& z, std::int64_t valid, const tensor& maxima,
                                   const tensor& sums, const tensor& targets, std::int64_t first,
                                   float grad_scale) {
  activate();
  const char* op = "cuda vp_softmax_grad";
  const std::int64_t n = check_block(z, valid, op);
  if (n == 0) return;
  const int tp = group_of(maxima, n, op);
  require_type(targets, dtype::i32, op, "targets");
  require_numel(targets, n, op, "targets");
  require_type(sums, dtype::f32, op, "sums");
  require_numel(sums, 2 * n, op, "sums");
  vp_softmax_grad_kernel<<<static_cast<unsigned>(n), vp_threads, 0, ctx_->stream>>>(
      z.data<float>(), z.dim(1), valid, maxima.data<float>(), tp, sums.data<float>(),
      targets.data<int>(), first, n, grad_scale);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
