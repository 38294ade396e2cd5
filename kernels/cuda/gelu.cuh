// GELU with the tanh approximation (GPT-2) as elementwise ops (elementwise.cuh), shared by gelu.cu
// and linear.cu's unfused GELU paths. The math is fp32 with the accurate tanhf (the fast
// approximation would break the 1e-5 agreement with the CPU reference in fp32).
#pragma once

#include "kernels/cuda/elementwise.cuh"

namespace troupe::kernels::cuda {

constexpr float gelu_scale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float gelu_cubic = 0.044715f;

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

/// y = GELU(x): in {x}, out {y}.
struct gelu_forward_op {
  __device__ void operator()(const float* in, float* out) const { out[0] = gelu_f(in[0]); }
};

/// dx += dy · GELU'(x): in {dy, x, dx}, out {dx}.
struct gelu_backward_op {
  __device__ void operator()(const float* in, float* out) const {
    out[0] = in[2] + in[0] * gelu_grad_f(in[1]);
  }
};

/// d = d · GELU'(x): in {x, d}, out {d}.
struct gelu_backward_scale_op {
  __device__ void operator()(const float* in, float* out) const {
    out[0] = in[1] * gelu_grad_f(in[0]);
  }
};

}  // namespace troupe::kernels::cuda
