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

/// V consecutive elements per thread and access (V = 4: 16-byte loads of the fp32 buffers).
template <class L, int V>
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, L* low,
                             adamw_consts k, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<float, V> pp = *reinterpret_cast<const pack<float, V>*>(param + i);
    const pack<float, V> pg = *reinterpret_cast<const pack<float, V>*>(grad + i);
    pack<float, V> pm = *reinterpret_cast<const pack<float, V>*>(m + i);
    pack<float, V> pv = *reinterpret_cast<const pack<float, V>*>(v + i);
    pack<L, V> pl;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float g = pg.v[e] * k.grad_scale;
      const float mi = k.beta1 * pm.v[e] + k.one_minus_b1 * g;
      const float vi = k.beta2 * pv.v[e] + k.one_minus_b2 * (g * g);
      pm.v[e] = mi;
      pv.v[e] = vi;
      const float p = pp.v[e];
      pp.v[e] = p - k.lr * ((mi / k.bc1) / (sqrtf(vi / k.bc2) + k.eps) + k.wd * p);
      pl.v[e] = from_f<L>(pp.v[e]);
    }
    *reinterpret_cast<pack<float, V>*>(param + i) = pp;
    *reinterpret_cast<pack<float, V>*>(m + i) = pm;
    *reinterpret_cast<pack<float, V>*>(v + i) = pv;
    if (low) *reinterpret_cast<pack<L, V>*>(low + i) = pl;
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
  const bool vec = n % 4 == 0 && aligned16(param.raw()) && aligned16(grad.raw()) &&
                   aligned16(m.raw()) && aligned16(v.raw()) &&
                   (!low.defined() || reinterpret_cast<std::uintptr_t>(low.raw()) % 8 == 0);
  auto run = [&](auto low_tag) {
    using L = decltype(low_tag);
    L* lp = low.defined() ? low.data<L>() : nullptr;
    if (vec)
      adamw_kernel<L, 4><<<grid_for(n / 4, 256), 256, 0, s>>>(
          param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), lp, k, n);
    else
      adamw_kernel<L, 1><<<grid_for(n, 256), 256, 0, s>>>(
          param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), lp, k, n);
  };
  if (low.defined() && low.type() == dtype::f16)
    run(f16{});
  else
    run(bf16{});
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
