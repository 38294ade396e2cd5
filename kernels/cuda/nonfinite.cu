// has_nonfinite: true when any element is NaN or ±inf (the coordinator's NaN check and the fp16
// loss scaler's overflow test). Every thread that finds one stores 1 into a device flag; racing
// stores of the same value need no atomics and leave the same result. The flag comes back with
// one small device-to-host copy, the only synchronisation this op needs.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

template <class T>
__global__ void nonfinite_kernel(const T* x, std::int64_t n, int* flag) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    bad |= !isfinite(to_f(x[i]));
  if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) *flag = 1;
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

bool cuda_backend::has_nonfinite(const tensor& x) {
  activate();
  if (ctx_->capturing)
    throw core::failure("cuda has_nonfinite: cannot read a result back while recording a graph");
  context& ctx = *ctx_;
  require_float(x, "cuda has_nonfinite", "x");
  const std::int64_t n = x.numel();
  if (n == 0) return false;
  scratch flag(ctx, sizeof(int));
  TROUPE_CUDA_CHECK(cudaMemsetAsync(flag.as<int>(), 0, sizeof(int), ctx.stream));
  // Enough blocks to fill the GPU; each thread strides over the rest.
  const unsigned grid = std::min<unsigned>(grid_for(n, 256), static_cast<unsigned>(ctx.sm_count) * 8);
  dispatch_float(x.type(), "cuda has_nonfinite", [&](auto tag) {
    using T = decltype(tag);
    nonfinite_kernel<T><<<grid, 256, 0, ctx.stream>>>(x.data<T>(), n, flag.as<int>());
  });
  TROUPE_CUDA_CHECK_LAUNCH();
  int host = 0;
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(&host, flag.as<int>(), sizeof(int), cudaMemcpyDeviceToHost,
                                    ctx.stream));
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  return host != 0;
}

}  // namespace troupe::kernels::cuda
