// The exact sum of fp64 values into a superaccumulator (core/exact_sum.hpp), and the clip factor of
// the global gradient norm computed from it on the device.
//
// exact_sum_add: each thread splits its values into three 32-bit pieces of the fixed-point digits
// (core::exact_sum_split_of) and adds them to its CUDA block's accumulator in shared memory, which
// the block then adds to the output. The additions are 64-bit integer atomics: integer addition is
// exact and associative, so the order the atomics land in cannot change a bit of the result — the
// determinism the backend promises holds, unlike with floating-point atomics. A GPT-2 124M step
// adds 121k norm blocks (0.97 MB) with it.
//
// clip_factor: one thread rounds the accumulator (exact_sum_value, the host's code), takes the
// square root and the clip scale (kernels/clip.hpp), in IEEE double like the host, so the factor
// AdamW reads on the device has the bits the coordinator would have decided.
#include <cmath>

#include "core/exact_sum.hpp"
#include "kernels/clip.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

constexpr int exact_sum_threads = 256;

__global__ void __launch_bounds__(exact_sum_threads)
    exact_sum_kernel(const double* x, std::int64_t n, unsigned long long* acc) {
  __shared__ unsigned long long part[core::exact_sum_words];
  for (int i = threadIdx.x; i < core::exact_sum_words; i += blockDim.x) part[i] = 0;
  __syncthreads();
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const core::exact_sum_split s = core::exact_sum_split_of(x[i]);
    if (s.counter >= 0) {
      atomicAdd(&part[s.counter], 1ull);
    } else if (s.digit >= 0) {
      // two's complement: adding the unsigned image of a negative piece subtracts it
#pragma unroll
      for (int j = 0; j < 3; ++j)
        if (s.piece[j] != 0)
          atomicAdd(&part[s.digit + j], static_cast<unsigned long long>(s.piece[j]));
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < core::exact_sum_words; i += blockDim.x)
    if (part[i] != 0) atomicAdd(&acc[i], part[i]);
}

__global__ void clip_factor_kernel(const std::int64_t* sumsq, const std::int64_t* guard,
                                   double grad_clip, double* out) {
  const double norm = sqrt(core::exact_sum_value(sumsq));
  const bool ok = isfinite(norm) && (guard == nullptr || isfinite(core::exact_sum_value(guard)));
  out[0] = norm;
  out[1] = ok ? static_cast<double>(clip_scale_of(norm, grad_clip)) : nan("");
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

void cuda_backend::exact_sum_add(const tensor& values, tensor& acc) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda exact_sum_add";
  require_type(values, dtype::f64, op, "values");
  require_type(acc, dtype::i64, op, "acc");
  require_numel(acc, core::exact_sum_words, op, "acc (core::exact_sum_words)");
  const std::int64_t n = values.numel();
  if (n == 0) return;
  // About 8 values per thread: enough blocks to spread the atomics, few enough that the blocks'
  // final adds stay negligible.
  const unsigned grid = std::min<unsigned>(grid_for((n + 7) / 8, exact_sum_threads), 1024);
  exact_sum_kernel<<<grid, exact_sum_threads, 0, s>>>(
      values.data<double>(), n, reinterpret_cast<unsigned long long*>(acc.data<std::int64_t>()));
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip,
                               tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda clip_factor";
  require_type(sumsq, dtype::i64, op, "sumsq");
  require_numel(sumsq, core::exact_sum_words, op, "sumsq (core::exact_sum_words)");
  if (guard.defined()) {
    require_type(guard, dtype::i64, op, "guard");
    require_numel(guard, core::exact_sum_words, op, "guard (core::exact_sum_words)");
  }
  require_type(out, dtype::f64, op, "out");
  require_numel(out, 2, op, "out ({norm, factor})");
  clip_factor_kernel<<<1, 1, 0, s>>>(sumsq.data<std::int64_t>(),
                                     guard.defined() ? guard.data<std::int64_t>() : nullptr,
                                     grad_clip, out.data<double>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
