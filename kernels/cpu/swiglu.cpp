// SwiGLU (LLaMA MLP): y = silu(gate) * up, silu(g) = g * sigmoid(g).
//   dgate = dy * up * s (1 + g (1 - s)),  dup = dy * g * s,  s = sigmoid(g)  (written)
#include "kernels/check.hpp"
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
    dgate[i] = dy[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
    dup[i] = dy[i] * (g * s);
  }
}

}  // namespace

void cpu_backend::swiglu_forward(const tensor& gate, const tensor& up, tensor& y) {
  op_check c("swiglu_forward", {{"gate", &gate}, {"up", &up}, {"y", &y}});
  c.elementwise(gate, "gate");
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
  c.elementwise(gate, "gate");
  const std::int64_t n = gate.numel();
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
