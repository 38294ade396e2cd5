// GELU with the tanh approximation (GPT-2): y = x/2 · (1 + tanh(√(2/π)(x + 0.044715x³))), and its
// backward dx += dy · GELU'(x), and d = d · GELU'(x) in place (the second half of a GELU backward
// whose GEMM wrote dy into d: linear.cu's unfused fallback). Memory-bound maps with 16-byte accesses when aligned; the math is
// fp32 with the accurate tanhf (the fast approximation would break the 1e-5 agreement with the CPU
// reference in fp32).
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

namespace {
constexpr float gelu_scale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float gelu_cubic = 0.044715f;
}  // namespace

__device__ __forceinline__ float gelu_f(float x) {
  const float u = gelu_scale * (x + gelu_cubic * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

__device__ __forceinline__ float gelu_grad_f(float x) {
  const float u = gelu_scale * (x + gelu_cubic * x * x * x);
  const float t = tanhf(u);
  const float du = gelu_scale * (1.0f + 3.0f * gelu_cubic * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

template <class T, int V>
__global__ void gelu_forward_kernel(const T* x, T* y, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(x + i);
    pack<T, V> py;
#pragma unroll
    for (int k = 0; k < V; ++k) py.v[k] = from_f<T>(gelu_f(to_f(px.v[k])));
    *reinterpret_cast<pack<T, V>*>(y + i) = py;
  }
}

template <class T, int V>
__global__ void gelu_backward_kernel(const T* dy, const T* x, T* dx, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> pdy = *reinterpret_cast<const pack<T, V>*>(dy + i);
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(x + i);
    pack<T, V> pdx = *reinterpret_cast<const pack<T, V>*>(dx + i);
#pragma unroll
    for (int k = 0; k < V; ++k)
      pdx.v[k] = from_f<T>(to_f(pdx.v[k]) + to_f(pdy.v[k]) * gelu_grad_f(to_f(px.v[k])));
    *reinterpret_cast<pack<T, V>*>(dx + i) = pdx;
  }
}

/// d[i] = d[i] · GELU'(x[i]): each element read before the same thread writes it.
template <class T, int V>
__global__ void gelu_backward_scale_kernel(const T* x, T* d, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(x + i);
    pack<T, V> pd = *reinterpret_cast<const pack<T, V>*>(d + i);
#pragma unroll
    for (int k = 0; k < V; ++k) pd.v[k] = from_f<T>(to_f(pd.v[k]) * gelu_grad_f(to_f(px.v[k])));
    *reinterpret_cast<pack<T, V>*>(d + i) = pd;
  }
}

// ------------------------------------------------------------------------------------------------
// launchers

void launch_gelu_forward(const tensor& x, tensor& y, cudaStream_t s) {
  require_float(x, "gelu_forward", "x");
  require_type(y, x.type(), "gelu_forward", "y");
  require_numel(y, x.numel(), "gelu_forward", "y");
  const std::int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float(x.type(), "gelu_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && aligned16(x.raw()) && aligned16(y.raw()))
      gelu_forward_kernel<T, V><<<grid_for(n / V, 256), 256, 0, s>>>(x.data<T>(), y.data<T>(), n);
    else
      gelu_forward_kernel<T, 1><<<grid_for(n, 256), 256, 0, s>>>(x.data<T>(), y.data<T>(), n);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

void launch_gelu_backward(const tensor& dy, const tensor& x, tensor& dx, cudaStream_t s) {
  require_float(x, "gelu_backward", "x");
  require_type(dy, x.type(), "gelu_backward", "dy");
  require_type(dx, x.type(), "gelu_backward", "dx");
  require_numel(dy, x.numel(), "gelu_backward", "dy");
  require_numel(dx, x.numel(), "gelu_backward", "dx");
  const std::int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float(x.type(), "gelu_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && aligned16(x.raw()) && aligned16(dy.raw()) && aligned16(dx.raw()))
      gelu_backward_kernel<T, V><<<grid_for(n / V, 256), 256, 0, s>>>(dy.data<T>(), x.data<T>(),
                                                                      dx.data<T>(), n);
    else
      gelu_backward_kernel<T, 1><<<grid_for(n, 256), 256, 0, s>>>(dy.data<T>(), x.data<T>(),
                                                                  dx.data<T>(), n);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

void launch_gelu_backward_scale(const tensor& x, tensor& d, cudaStream_t s) {
  require_float(x, "gelu_backward_scale", "x");
  require_type(d, x.type(), "gelu_backward_scale", "d");
  require_numel(d, x.numel(), "gelu_backward_scale", "d");
  const std::int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float(x.type(), "gelu_backward_scale", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && aligned16(x.raw()) && aligned16(d.raw()))
      gelu_backward_scale_kernel<T, V>
          <<<grid_for(n / V, 256), 256, 0, s>>>(x.data<T>(), d.data<T>(), n);
    else
      gelu_backward_scale_kernel<T, 1><<<grid_for(n, 256), 256, 0, s>>>(x.data<T>(), d.data<T>(), n);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
