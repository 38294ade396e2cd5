// The one launch helper of the elementwise ops (GELU, SwiGLU, add, scale and their backwards):
// a grid-stride kernel over n elements of same-typed arrays that loads element i of every input,
// hands their fp32 values to an op and stores its fp32 results, rounded, into the outputs. When n
// is a multiple of V = 16 / sizeof(T) and every array is 16-byte aligned, each thread moves 16
// bytes per array and access (8 bf16 or 4 fp32), which is what saturates HBM; otherwise one
// element at a time. An output may also be an input (dx += ..., x *= s): each element is read
// before the same thread writes it.
//
// An op is a struct with `__device__ void operator()(const float* in, float* out) const`.
#pragma once

#include "kernels/cuda/cuda_common.cuh"

namespace troupe::kernels::cuda {

template <class P, int N>
struct pointers {
  P* p[N];
};

template <class T, int V, int NI, int NO, class F>
__global__ void elementwise_kernel(pointers<const T, NI> in, pointers<T, NO> out, std::int64_t n,
                                   F f) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<T, V> pin[NI];
#pragma unroll
    for (int j = 0; j < NI; ++j) pin[j] = *reinterpret_cast<const pack<T, V>*>(in.p[j] + i);
    pack<T, V> pout[NO];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float a[NI], r[NO];
#pragma unroll
      for (int j = 0; j < NI; ++j) a[j] = to_f(pin[j].v[k]);
      f(a, r);
#pragma unroll
      for (int j = 0; j < NO; ++j) pout[j].v[k] = from_f<T>(r[j]);
    }
#pragma unroll
    for (int j = 0; j < NO; ++j) *reinterpret_cast<pack<T, V>*>(out.p[j] + i) = pout[j];
  }
}

/// out_j[i] = f(in_0[i], ..., in_{NI-1}[i])_j for i < n, on stream s; checks the launch.
template <class T, int NI, int NO, class F>
void launch_elementwise(std::int64_t n, const T* const (&in)[NI], T* const (&out)[NO], F f,
                        cudaStream_t s) {
  if (n == 0) return;
  constexpr int V = 16 / sizeof(T);
  pointers<const T, NI> pin;
  pointers<T, NO> pout;
  bool vec = n % V == 0;
  for (int j = 0; j < NI; ++j) {
    pin.p[j] = in[j];
    vec = vec && aligned16(in[j]);
  }
  for (int j = 0; j < NO; ++j) {
    pout.p[j] = out[j];
    vec = vec && aligned16(out[j]);
  }
  if (vec)
    elementwise_kernel<T, V, NI, NO><<<grid_for(n / V, 256), 256, 0, s>>>(pin, pout, n, f);
  else
    elementwise_kernel<T, 1, NI, NO><<<grid_for(n, 256), 256, 0, s>>>(pin, pout, n, f);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
