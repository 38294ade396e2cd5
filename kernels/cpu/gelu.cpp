// GELU, tanh approximation (GPT-2): y = 0.5 x (1 + tanh(u)), u = sqrt(2/π) (x + 0.044715 x³).
//   dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh² u) sqrt(2/π) (1 + 3·0.044715 x²)
// tanh goes through fast_tanh so the loops vectorise (fast_math.hpp).
#include "kernels/cpu/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

constexpr float sqrt_2_over_pi = 0.7978845608028654f;
constexpr float gelu_k = 0.044715f;
constexpr std::int64_t grain = 1 << 15;

}  // namespace

void cpu_backend::gelu_forward(const tensor& x, tensor& y) {
  op_check c("gelu_forward", {{"x", &x}, {"y", &y}});
  c.host(x, "x", core::dtype::f32);
  c.host(y, "y", core::dtype::f32);
  c.numel(y, "y", x.numel(), "as many elements as x");
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_for(x.numel(), grain, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const float v = xp[i];
      const float u = sqrt_2_over_pi * (v + gelu_k * v * v * v);
      yp[i] = 0.5f * v * (1.0f + fast_tanh(u));
    }
  });
}

void cpu_backend::gelu_backward(const tensor& dy, const tensor& x, tensor& dx) {
  op_check c("gelu_backward", {{"dy", &dy}, {"x", &x}, {"dx", &dx}});
  c.host(dy, "dy", core::dtype::f32);
  c.host(x, "x", core::dtype::f32);
  c.host(dx, "dx", core::dtype::f32);
  c.numel(dy, "dy", x.numel(), "as many elements as x");
  c.numel(dx, "dx", x.numel(), "as many elements as x");
  const float* dyp = dy.data<float>();
  const float* xp = x.data<float>();
  float* dxp = dx.data<float>();
  parallel_for(x.numel(), grain, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const float v = xp[i];
      const float u = sqrt_2_over_pi * (v + gelu_k * v * v * v);
      const float t = fast_tanh(u);
      const float du = sqrt_2_over_pi * (1.0f + 3.0f * gelu_k * v * v);
      const float grad = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
      dxp[i] += dyp[i] * grad;
    }
  });
}

}  // namespace troupe::kernels::cpu
