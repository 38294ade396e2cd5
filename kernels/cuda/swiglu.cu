// SwiGLU (LLaMA MLP): y = silu(gate) · up with silu(g) = g·σ(g); backward
// dgate += dy·up·σ(g)·(1 + g·(1 − σ(g))), dup += dy·silu(g). Memory-bound maps, 16-byte accesses when
// aligned, fp32 math with the accurate expf.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

__device__ __forceinline__ float sigmoid_f(float g) { return 1.0f / (1.0f + expf(-g)); }

template <class T, int V>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* y, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> pg = *reinterpret_cast<const pack<T, V>*>(gate + i);
    pack<T, V> pu = *reinterpret_cast<const pack<T, V>*>(up + i);
    pack<T, V> py;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = to_f(pg.v[k]);
      py.v[k] = from_f<T>(g * sigmoid_f(g) * to_f(pu.v[k]));
    }
    *reinterpret_cast<pack<T, V>*>(y + i) = py;
  }
}

template <class T, int V>
__global__ void swiglu_backward_kernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup,
                                       std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> pdy = *reinterpret_cast<const pack<T, V>*>(dy + i);
    pack<T, V> pg = *reinterpret_cast<const pack<T, V>*>(gate + i);
    pack<T, V> pu = *reinterpret_cast<const pack<T, V>*>(up + i);
    pack<T, V> pdg = *reinterpret_cast<const pack<T, V>*>(dgate + i);
    pack<T, V> pdu = *reinterpret_cast<const pack<T, V>*>(dup + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = to_f(pg.v[k]), u = to_f(pu.v[k]), d = to_f(pdy.v[k]);
      const float sg = sigmoid_f(g);
      pdg.v[k] = from_f<T>(to_f(pdg.v[k]) + d * u * sg * (1.0f + g * (1.0f - sg)));
      pdu.v[k] = from_f<T>(to_f(pdu.v[k]) + d * g * sg);
    }
    *reinterpret_cast<pack<T, V>*>(dgate + i) = pdg;
    *reinterpret_cast<pack<T, V>*>(dup + i) = pdu;
  }
}

// ------------------------------------------------------------------------------------------------
// launchers

void launch_swiglu_forward(const tensor& gate, const tensor& up, tensor& y, cudaStream_t s) {
  require_float(gate, "swiglu_forward", "gate");
  require_type(up, gate.type(), "swiglu_forward", "up");
  require_type(y, gate.type(), "swiglu_forward", "y");
  require_numel(up, gate.numel(), "swiglu_forward", "up");
  require_numel(y, gate.numel(), "swiglu_forward", "y");
  const std::int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_float(gate.type(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && aligned16(gate.raw()) && aligned16(up.raw()) && aligned16(y.raw()))
      swiglu_forward_kernel<T, V><<<grid_for(n / V, 256), 256, 0, s>>>(
          gate.data<T>(), up.data<T>(), y.data<T>(), n);
    else
      swiglu_forward_kernel<T, 1><<<grid_for(n, 256), 256, 0, s>>>(gate.data<T>(), up.data<T>(),
                                                                   y.data<T>(), n);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

void launch_swiglu_backward(const tensor& dy, const tensor& gate, const tensor& up, tensor& dgate,
                            tensor& dup, cudaStream_t s) {
  const char* op = "swiglu_backward";
  require_float(gate, op, "gate");
  require_type(dy, gate.type(), op, "dy");
  require_type(up, gate.type(), op, "up");
  require_type(dgate, gate.type(), op, "dgate");
  require_type(dup, gate.type(), op, "dup");
  const std::int64_t n = gate.numel();
  for (const tensor* t : std::initializer_list<const tensor*>{&dy, &up, &dgate, &dup})
    require_numel(*t, n, op, "operand");
  if (n == 0) return;
  dispatch_float(gate.type(), op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const bool vec = n % V == 0 && aligned16(dy.raw()) && aligned16(gate.raw()) &&
                     aligned16(up.raw()) && aligned16(dgate.raw()) && aligned16(dup.raw());
    if (vec)
      swiglu_backward_kernel<T, V><<<grid_for(n / V, 256), 256, 0, s>>>(
          dy.data<T>(), gate.data<T>(), up.data<T>(), dgate.data<T>(), dup.data<T>(), n);
    else
      swiglu_backward_kernel<T, 1><<<grid_for(n, 256), 256, 0, s>>>(
          dy.data<T>(), gate.data<T>(), up.data<T>(), dgate.data<T>(), dup.data<T>(), n);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
