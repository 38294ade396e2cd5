// SwiGLU (LLaMA MLP): y = silu(gate) * up, silu(g) = g * sigmoid(g).
//   dgate += dy * up * s (1 + g (1 - s)),  dup += dy * g * s,  s = sigmoid(g)
#include "kernels/cpu/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

constexpr std::int64_t grain = 1 << 15;

TROUPE_SIMD_CLONES void swiglu_forward_range(const float* gate, const float* up, float* y,
                                             std::int64_t i0, std::int64_t i1) {
  for (std::int64_t i = i0; i < i1; ++i) {
    const float g = gate[i];
    y[i] = g * fast_sigmoid(g) * up[i];
  }
}

TROUPE_SIMD_CLONES void swiglu_backward_range(const float* dy, const float* gate, const float* up,
                                              float* dgate, float* dup, std::int64_t i0,
                                              std::int64_t i1) {
  for (std::int64_t i = i0; i < i1; ++i) {
    const float g = gate[i];
    const float s = fast_sigmoid(g);
    dgate[i] += dy[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
    dup[i] += dy[i] * (g * s);
  }
}

}  // namespace

void cpu_backend::swiglu_forward(const tensor& gate, const tensor& up, tensor& y) {
  op_check c("swiglu_forward", {{"gate", &gate}, {"up", &up}, {"y", &y}});
  c.host(gate, "gate", core::dtype::f32);
  c.host(up, "up", core::dtype::f32);
  c.host(y, "y", core::dtype::f32);
  c.numel(up, "up", gate.numel(), "as many elements as gate");
  c.numel(y, "y", gate.numel(), "as many elements as gate");
  const float* gp = gate.data<float>();
  const float* up_p = up.data<float>();
  float* yp = y.data<float>();
  parallel_for(gate.numel(), grain, [&](std::int64_t i0, std::int64_t i1) {
    swiglu_forward_range(gp, up_p, yp, i0, i1);
  });
}

void cpu_backend::swiglu_backward(const tensor& dy, const tensor& gate, const tensor& up,
                                  tensor& dgate, tensor& dup) {
  op_check c("swiglu_backward",
             {{"dy", &dy}, {"gate", &gate}, {"up", &up}, {"dgate", &dgate}, {"dup", &dup}});
  c.host(dy, "dy", core::dtype::f32);
  c.host(gate, "gate", core::dtype::f32);
  c.host(up, "up", core::dtype::f32);
  c.host(dgate, "dgate", core::dtype::f32);
  c.host(dup, "dup", core::dtype::f32);
  const std::int64_t n = gate.numel();
  c.numel(dy, "dy", n, "as many elements as gate");
  c.numel(up, "up", n, "as many elements as gate");
  c.numel(dgate, "dgate", n, "as many elements as gate");
  c.numel(dup, "dup", n, "as many elements as gate");
  const float* dyp = dy.data<float>();
  const float* gp = gate.data<float>();
  const float* up_p = up.data<float>();
  float* dgp = dgate.data<float>();
  float* dup_p = dup.data<float>();
  parallel_for(n, grain, [&](std::int64_t i0, std::int64_t i1) {
    swiglu_backward_range(dyp, gp, up_p, dgp, dup_p, i0, i1);
  });
}

}  // namespace troupe::kernels::cpu
