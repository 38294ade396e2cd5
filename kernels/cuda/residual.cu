// Residual and gradient arithmetic: y = a + b, y += x, x *= s. Memory-bound maps: when every operand
// has the same dtype and is 16-byte aligned, each thread moves 16 bytes per access (8 bf16 or 4
// fp32), which is what saturates HBM; mixed dtypes (an fp32 gradient accumulated from a bf16 one)
// take a scalar path with run-time dtype access. Outputs may alias inputs: each element is read
// before it is written by the same thread.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

template <class T, int V>
__global__ void add_kernel(const T* a, const T* b, T* y, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> pa = *reinterpret_cast<const pack<T, V>*>(a + i);
    pack<T, V> pb = *reinterpret_cast<const pack<T, V>*>(b + i);
    pack<T, V> py;
#pragma unroll
    for (int k = 0; k < V; ++k) py.v[k] = from_f<T>(to_f(pa.v[k]) + to_f(pb.v[k]));
    *reinterpret_cast<pack<T, V>*>(y + i) = py;
  }
}

__global__ void add_mixed_kernel(const void* a, int ca, const void* b, int cb, void* y, int cy,
                                 std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    store_f(y, cy, i, load_f(a, ca, i) + load_f(b, cb, i));
}

template <class T, int V>
__global__ void scale_kernel(T* x, float s, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(x + i);
#pragma unroll
    for (int k = 0; k < V; ++k) p.v[k] = from_f<T>(to_f(p.v[k]) * s);
    *reinterpret_cast<pack<T, V>*>(x + i) = p;
  }
}

// ------------------------------------------------------------------------------------------------
// launchers

namespace {

void check_same_size(const tensor& a, const tensor& b, const char* op, const char* an,
                     const char* bn) {
  require(a.numel() == b.numel(), op,
          std::string(an) + " " + core::shape_string(a.shape()) + " and " + bn + " " +
              core::shape_string(b.shape()) + " differ in size");
}

}  // namespace

void launch_add(const tensor& a, const tensor& b, tensor& y, cudaStream_t s) {
  require_float(a, "add", "a");
  require_float(b, "add", "b");
  require_float(y, "add", "y");
  check_same_size(a, b, "add", "a", "b");
  check_same_size(a, y, "add", "a", "y");
  const std::int64_t n = a.numel();
  if (n == 0) return;
  if (a.type() == b.type() && a.type() == y.type()) {
    dispatch_float(a.type(), "add", [&](auto tag) {
      using T = decltype(tag);
      constexpr int V = 16 / sizeof(T);
      if (n % V == 0 && aligned16(a.raw()) && aligned16(b.raw()) && aligned16(y.raw()))
        add_kernel<T, V><<<grid_for(n / V, 256), 256, 0, s>>>(a.data<T>(), b.data<T>(),
                                                               y.data<T>(), n);
      else
        add_kernel<T, 1><<<grid_for(n, 256), 256, 0, s>>>(a.data<T>(), b.data<T>(), y.data<T>(),
                                                           n);
    });
  } else {
    add_mixed_kernel<<<grid_for(n, 256), 256, 0, s>>>(a.raw(), code_of(a.type()), b.raw(),
                                                      code_of(b.type()), y.raw(),
                                                      code_of(y.type()), n);
  }
  TROUPE_CUDA_CHECK_LAUNCH();
}

void launch_accumulate(const tensor& x, tensor& y, cudaStream_t s) {
  require_float(x, "accumulate", "x");
  require_float(y, "accumulate", "y");
  check_same_size(x, y, "accumulate", "x", "y");
  launch_add(y, x, y, s);
}

void launch_scale(tensor& x, float factor, cudaStream_t s) {
  require_float(x, "scale", "x");
  const std::int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float(x.type(), "scale", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && aligned16(x.raw()))
      scale_kernel<T, V><<<grid_for(n / V, 256), 256, 0, s>>>(x.data<T>(), factor, n);
    else
      scale_kernel<T, 1><<<grid_for(n, 256), 256, 0, s>>>(x.data<T>(), factor, n);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
