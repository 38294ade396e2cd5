// Device helpers shared by the op files: element conversions (all arithmetic in fp32), run-time
// dtype access for small or mixed-type operands (norm weights, fp32 gradients of bf16 weights),
// fixed-order reductions (deterministic: the same inputs give the same bits) and dtype dispatch.
// Argument checks are kernels/check.hpp's, shared with the CPU ops (op names here start "cuda ").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/check.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda {

using core::dtype;
using core::tensor;
using bf16 = __nv_bfloat16;
using f16 = __half;

// ---- element conversions -----------------------------------------------------------------------

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(f16 x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ f16 from_f<f16>(float x) { return __float2half_rn(x); }

/// `V` elements moved as one aligned load/store (16 bytes for V = 16 / sizeof(T)).
template <class T, int V>
struct alignas(sizeof(T) * V) pack {
  T v[V];
};

// ---- run-time dtype access (codes are core::dtype's values) ----------------------------------------

constexpr int code_f32 = static_cast<int>(dtype::f32);
constexpr int code_bf16 = static_cast<int>(dtype::bf16);
constexpr int code_f16 = static_cast<int>(dtype::f16);

__device__ __forceinline__ float load_f(const void* p, int code, std::int64_t i) {
  if (code == code_bf16) return __bfloat162float(static_cast<const bf16*>(p)[i]);
  if (code == code_f16) return __half2float(static_cast<const f16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_f(void* p, int code, std::int64_t i, float v) {
  if (code == code_bf16)
    static_cast<bf16*>(p)[i] = __float2bfloat16_rn(v);
  else if (code == code_f16)
    static_cast<f16*>(p)[i] = __float2half_rn(v);
  else
    static_cast<float*>(p)[i] = v;
}

// ---- fixed-order reductions ------------------------------------------------------------------------
// The xor butterfly leaves the same bits in every lane (each pairwise sum is commutative), and the
// block reduction always adds warp results in warp order, so reductions are run-to-run identical.

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Sum over the block, returned to every thread. REQUIRES: blockDim.x a multiple of 32, <= 1024;
/// `shared` holds 32 values; all threads call it.
template <class F>
__device__ __forceinline__ F block_sum(F v, F* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  F total = 0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

// ---- host helpers ----------------------------------------------------------------------------------

inline int code_of(dtype t) { return static_cast<int>(t); }

/// Calls f(T{}) with T = float, bf16 or f16 for `t`.
template <class F>
void dispatch_float(dtype t, const char* op, F&& f) {
  switch (t) {
    case dtype::f32: f(float{}); return;
    case dtype::bf16: f(bf16{}); return;
    case dtype::f16: f(f16{}); return;
    default: break;
  }
  throw core::failure(std::string(op) + ": unsupported dtype " + core::dtype_name(t));
}

/// Blocks for a grid-stride loop over n items: enough to fill the GPU, capped to a legal grid.
inline unsigned grid_for(std::int64_t n, int threads) {
  std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(b, 1, 65535LL * 32));
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// Calls f(std::integral_constant<int, V>) with V = 16 / sizeof(T) when rows of C elements of every
/// tensor can be moved in 16-byte packs, else with V = 1.
template <class T, class F>
void with_row_vector(std::initializer_list<const tensor*> ts, std::int64_t C, F&& f) {
  constexpr int V = 16 / sizeof(T);
  bool vec = C % V == 0;
  for (const tensor* t : ts) vec = vec && aligned16(t->raw());
  if (vec)
    f(std::integral_constant<int, V>{});
  else
    f(std::integral_constant<int, 1>{});
}

}  // namespace troupe::kernels::cuda
