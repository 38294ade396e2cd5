// AdamW with decoupled weight decay, element-wise in fp32 (the bias corrections in double):
//   g = grad * grad_scale
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p)
// with bc1 = (float)(1 - beta1^step), bc2 = (float)(1 - beta2^step) computed in double, and
// (1 - beta) rounded to float once. When `low` is given it receives the new p rounded to its type.
// A defined grad_factor replaces grad_scale, and skips the update when it is not finite; a defined
// schedule replaces lr, bc1 and bc2.
#include <cmath>
#include <string>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

// The update's constants, passed by value so the compiler knows no tensor store changes them.
struct adamw_coeffs {
  float b1, b2, one_minus_b1, one_minus_b2, bc1, bc2, lr, eps, wd, grad_scale;
};

TROUPE_SIMD_CLONES void adamw_range(float* p, const float* grad, float* m, float* v, adamw_coeffs k,
                                    std::int64_t i0, std::int64_t i1) {
  for (std::int64_t i = i0; i < i1; ++i) {
    const float g = grad[i] * k.grad_scale;
    const float mi = k.b1 * m[i] + k.one_minus_b1 * g;
    const float vi = k.b2 * v[i] + k.one_minus_b2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    p[i] -= k.lr * ((mi / k.bc1) / (std::sqrt(vi / k.bc2) + k.eps) + k.wd * p[i]);
  }
}

}  // namespace

void cpu_backend::adamw(tensor& param, const tensor& grad, tensor& m, tensor& v,
                        const adamw_params& p, tensor& low) {
  op_check c("adamw", {{"param", &param}, {"grad", &grad}, {"m", &m}, {"v", &v}, {"low", &low}});
  c.host(param, "param", core::dtype::f32);
  c.host(grad, "grad", core::dtype::f32);
  c.host(m, "m", core::dtype::f32);
  c.host(v, "v", core::dtype::f32);
  const std::int64_t n = param.numel();
  c.numel(grad, "grad", n, "as many elements as param");
  c.numel(m, "m", n, "as many elements as param");
  c.numel(v, "v", n, "as many elements as param");
  if (low.defined()) {
    c.require(
        low.dev().is_cpu() && (low.type() == core::dtype::bf16 || low.type() == core::dtype::f16),
        "low must be a bf16 or fp16 host tensor");
    c.numel(low, "low", n, "as many elements as param");
  }
  c.require(p.step >= 1, "step must be >= 1 (1-based), got " + std::to_string(p.step));
  float grad_scale = p.grad_scale;
  if (p.grad_factor.defined()) {
    c.require(p.grad_factor.dev().is_cpu() && p.grad_factor.type() == core::dtype::f64 &&
                  p.grad_factor.numel() == 1,
              "grad_factor must be an f64 [1] host tensor");
    const double f = *p.grad_factor.data<double>();
    if (!std::isfinite(f)) return;  // the clip decision skipped the step
    grad_scale = static_cast<float>(f);
  }
  adamw_coeffs k{};
  k.b1 = p.beta1;
  k.b2 = p.beta2;
  k.one_minus_b1 = 1.0f - p.beta1;
  k.one_minus_b2 = 1.0f - p.beta2;
  k.bc1 = adamw_bias_correction(p.beta1, p.step);
  k.bc2 = adamw_bias_correction(p.beta2, p.step);
  k.lr = p.lr;
  if (p.schedule.defined()) {
    c.require(p.schedule.dev().is_cpu() && p.schedule.type() == core::dtype::f32 &&
                  p.schedule.numel() == 3,
              "schedule must be an f32 [3] host tensor {lr, bc1, bc2}");
    k.lr = p.schedule.data<float>()[0];
    k.bc1 = p.schedule.data<float>()[1];
    k.bc2 = p.schedule.data<float>()[2];
  }
  k.eps = p.eps;
  k.wd = p.weight_decay;
  k.grad_scale = grad_scale;
  float* pp = param.data<float>();
  const float* gp = grad.data<float>();
  float* mp = m.data<float>();
  float* vp = v.data<float>();
  parallel_for(n, 1 << 15, [&](std::int64_t i0, std::int64_t i1) {
    adamw_range(pp, gp, mp, vp, k, i0, i1);
    if (low.defined()) {
      auto* lo = low.data<std::uint16_t>();
      const bool bf16 = low.type() == core::dtype::bf16;
      for (std::int64_t i = i0; i < i1; ++i)
        lo[i] = bf16 ? core::f32_to_bf16(pp[i]) : core::f32_to_f16(pp[i]);
    }
  });
}

}  // namespace troupe::kernels::cpu
