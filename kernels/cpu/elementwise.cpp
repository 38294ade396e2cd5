// Element-wise arithmetic on fp32 tensors of equal size: add (residual), accumulate, scale.
#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

constexpr std::int64_t grain = 1 << 16;

}  // namespace

void cpu_backend::add(const tensor& a, const tensor& b, tensor& y) {
  op_check c("add", {{"a", &a}, {"b", &b}, {"y", &y}});
  c.elementwise(a, "a");
  const float* ap = a.data<float>();
  const float* bp = b.data<float>();
  float* yp = y.data<float>();
  parallel_for(a.numel(), grain, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) yp[i] = ap[i] + bp[i];
  });
}

void cpu_backend::accumulate(const tensor& x, tensor& y) {
  op_check c("accumulate", {{"x", &x}, {"y", &y}});
  c.elementwise(x, "x");
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_for(x.numel(), grain, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) yp[i] += xp[i];
  });
}

void cpu_backend::scale(tensor& x, float s) {
  op_check c("scale", {{"x", &x}});
  c.elementwise(x, "x");
  float* xp = x.data<float>();
  parallel_for(x.numel(), grain, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) xp[i] *= s;
  });
}

}  // namespace troupe::kernels::cpu
