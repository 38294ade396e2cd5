// GELU, tanh approximation (GPT-2): y = 0.5 x (1 + tanh(u)), u = sqrt(2/π) (x + 0.044715 x³).
//
// Evaluated through the identity 0.5 (1 + tanh u) = s = 1 / (1 + e), e = exp(-2u), because
// 1 + tanh u cancels for negative x (with a float tanh, about three digits of it survive at x = -4,
// none at x = -5); s and 1 - s = e·s keep full relative precision everywhere:
//   y = x s,   dy/dx = s + 2 x s (e s) u',   u' = sqrt(2/π) (1 + 3·0.044715 x²)
// The exponent is capped at 80 so that e·s stays finite for very negative x (where y is below
// 1e-33 anyway). fast_exp keeps the loops vectorised (fast_math.hpp).
#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

constexpr float sqrt_2_over_pi = 0.7978845608028654f;
constexpr float gelu_k = 0.044715f;
constexpr std::int64_t grain = 1 << 15;
constexpr float max_exponent = 80.0f;

// exp(-2u) for GELU's u at x.
inline float gelu_e(float x) {
  const float u = sqrt_2_over_pi * (x + gelu_k * x * x * x);
  const float a = -2.0f * u;
  return fast_exp(a < max_exponent ? a : max_exponent);
}

TROUPE_SIMD_CLONES void gelu_forward_range(const float* x, float* y, std::int64_t i0,
                                           std::int64_t i1) {
  for (std::int64_t i = i0; i < i1; ++i) {
    const float v = x[i];
    y[i] = v / (1.0f + gelu_e(v));
  }
}

TROUPE_SIMD_CLONES void gelu_backward_range(const float* dy, const float* x, float* dx,
                                            std::int64_t i0, std::int64_t i1) {
  for (std::int64_t i = i0; i < i1; ++i) {
    const float v = x[i];
    const float e = gelu_e(v);
    const float s = 1.0f / (1.0f + e);
    const float du = sqrt_2_over_pi * (1.0f + 3.0f * gelu_k * v * v);
    dx[i] += dy[i] * (s + 2.0f * v * (e * s) * s * du);
  }
}

}  // namespace

void cpu_backend::gelu_forward(const tensor& x, tensor& y) {
  op_check c("gelu_forward", {{"x", &x}, {"y", &y}});
  c.elementwise(x, "x");
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_for(x.numel(), grain,
               [&](std::int64_t i0, std::int64_t i1) { gelu_forward_range(xp, yp, i0, i1); });
}

void cpu_backend::gelu_backward(const tensor& dy, const tensor& x, tensor& dx) {
  op_check c("gelu_backward", {{"dy", &dy}, {"x", &x}, {"dx", &dx}});
  c.elementwise(x, "x");
  const float* dyp = dy.data<float>();
  const float* xp = x.data<float>();
  float* dxp = dx.data<float>();
  parallel_for(x.numel(), grain, [&](std::int64_t i0, std::int64_t i1) {
    gelu_backward_range(dyp, xp, dxp, i0, i1);
  });
}

}  // namespace troupe::kernels::cpu
