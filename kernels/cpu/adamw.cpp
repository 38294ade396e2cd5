// AdamW with decoupled weight decay, element-wise in fp32 (the bias corrections in double):
//   g = grad * grad_scale
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p)
// with bc1 = (float)(1 - beta1^step), bc2 = (float)(1 - beta2^step) computed in double, and
// (1 - beta) rounded to float once. When `low` is given it receives the new p rounded to its type.
#include <cmath>
#include <string>

#include "kernels/cpu/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

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
    c.require(low.dev().is_cpu() && (low.type() == core::dtype::bf16 || low.type() == core::dtype::f16),
              "low must be a bf16 or fp16 host tensor");
    c.numel(low, "low", n, "as many elements as param");
  }
  c.require(p.step >= 1, "step must be >= 1 (1-based), got " + std::to_string(p.step));
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta1), p.step));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta2), p.step));
  // Locals captured by value: the compiler cannot prove that the tensors do not alias p or
  // captured references, so with those it would reload them every iteration and not vectorise.
  const float b1 = p.beta1, b2 = p.beta2, one_minus_b1 = 1.0f - b1, one_minus_b2 = 1.0f - b2;
  const float lr = p.lr, eps = p.eps, wd = p.weight_decay, gscale = p.grad_scale;
  float* pp = param.data<float>();
  const float* gp = grad.data<float>();
  float* mp = m.data<float>();
  float* vp = v.data<float>();
  parallel_for(n, 1 << 15, [=](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const float g = gp[i] * gscale;
      const float mi = b1 * mp[i] + one_minus_b1 * g;
      const float vi = b2 * vp[i] + one_minus_b2 * (g * g);
      mp[i] = mi;
      vp[i] = vi;
      pp[i] -= lr * ((mi / bc1) / (std::sqrt(vi / bc2) + eps) + wd * pp[i]);
    }
    if (low.defined()) {
      auto* lo = low.data<std::uint16_t>();
      const bool bf16 = low.type() == core::dtype::bf16;
      for (std::int64_t i = i0; i < i1; ++i)
        lo[i] = bf16 ? core::f32_to_bf16(pp[i]) : core::f32_to_f16(pp[i]);
    }
  });
}

}  // namespace troupe::kernels::cpu
