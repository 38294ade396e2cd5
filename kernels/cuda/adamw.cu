// AdamW with decoupled weight decay on fp32 master weights, fused with the write of the bf16/fp16
// working copy, element-wise:
//   g = grad·grad_scale;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²
//   p = p − lr·((m/bc1)/(√(v/bc2) + eps) + wd·p);  low = round(p)
// with the bias corrections bc1 = 1 − β1^step, bc2 = 1 − β2^step computed in double on the host and
// rounded to float, exactly as the CPU reference does, so both agree to rounding. One pass over the
// five (or six) buffers is the whole optimizer step: no separate cast kernel for the low copy.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

struct adamw_consts {
  float lr, beta1, beta2, one_minus_b1, one_minus_b2, bc1, bc2, eps, wd, grad_scale;
};

template <class L>
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, L* low,
                             adamw_consts k, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float g = grad[i] * k.grad_scale;
    const float mi = k.beta1 * m[i] + k.one_minus_b1 * g;
    const float vi = k.beta2 * v[i] + k.one_minus_b2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    const float p = param[i];
    const float np = p - k.lr * ((mi / k.bc1) / (sqrtf(vi / k.bc2) + k.eps) + k.wd * p);
    param[i] = np;
    if (low) low[i] = from_f<L>(np);
  }
}

// ------------------------------------------------------------------------------------------------
// launchers

void launch_adamw(tensor& param, const tensor& grad, tensor& m, tensor& v, const adamw_params& p,
                  tensor& low, cudaStream_t s) {
  const char* op = "adamw";
  require_type(param, dtype::f32, op, "param");
  require_type(grad, dtype::f32, op, "grad");
  require_type(m, dtype::f32, op, "m");
  require_type(v, dtype::f32, op, "v");
  const std::int64_t n = param.numel();
  require_numel(grad, n, op, "grad");
  require_numel(m, n, op, "m");
  require_numel(v, n, op, "v");
  if (low.defined()) {
    require(low.type() == dtype::bf16 || low.type() == dtype::f16, op,
            std::string("low must be bf16 or fp16, got ") + core::dtype_name(low.type()));
    require_numel(low, n, op, "low");
  }
  require(p.step >= 1, op, "step must be >= 1 (1-based), got " + std::to_string(p.step));
  if (n == 0) return;
  adamw_consts k{};
  k.lr = p.lr;
  k.beta1 = p.beta1;
  k.beta2 = p.beta2;
  k.one_minus_b1 = 1.0f - p.beta1;
  k.one_minus_b2 = 1.0f - p.beta2;
  k.bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta1), p.step));
  k.bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta2), p.step));
  k.eps = p.eps;
  k.wd = p.weight_decay;
  k.grad_scale = p.grad_scale;
  const unsigned grid = grid_for(n, 256);
  if (low.defined() && low.type() == dtype::f16)
    adamw_kernel<f16><<<grid, 256, 0, s>>>(param.data<float>(), grad.data<float>(),
                                           m.data<float>(), v.data<float>(), low.data<f16>(), k, n);
  else
    adamw_kernel<bf16><<<grid, 256, 0, s>>>(param.data<float>(), grad.data<float>(),
                                            m.data<float>(), v.data<float>(),
                                            low.defined() ? low.data<bf16>() : nullptr, k, n);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
