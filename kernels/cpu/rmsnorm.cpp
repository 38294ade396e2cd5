// RMSNorm over the last dimension (LLaMA): y = x * rstd * w, rstd = 1/sqrt(mean(x²) + eps);
// rstd is saved for the backward.
// The backward is norm_backward.hpp's, shared with LayerNorm.
#include <algorithm>
#include <cmath>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/norm_backward.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

void cpu_backend::rmsnorm_forward(const tensor& x, const tensor& w, float eps, tensor& y,
                                  tensor& rstd) {
  op_check c("rmsnorm_forward", {{"x", &x}, {"w", &w}, {"y", &y}, {"rstd", &rstd}});
  c.host(x, "x", core::dtype::f32);
  c.host(w, "w", core::dtype::f32);
  c.host(y, "y", core::dtype::f32);
  c.host(rstd, "rstd", core::dtype::f32);
  c.require(x.rank() >= 1 && x.dim(-1) > 0, "x must be [N, C] with C > 0");
  const std::int64_t ch = x.dim(-1), n = rows_of(x);
  c.shape(w, "w", {ch}, "C = last dim of x");
  c.matrix(y, "y", n, ch, "the shape of x");
  c.numel(rstd, "rstd", n, "one per row of x");
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* yp = y.data<float>();
  float* rp = rstd.data<float>();
  const float inv_c = 1.0f / static_cast<float>(ch);
  parallel_for(n, std::max<std::int64_t>(1, (1 << 15) / ch), [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * ch;
      float* yr = yp + r * ch;
      const float s = 1.0f / std::sqrt(dot(xr, xr, ch) * inv_c + eps);
      for (std::int64_t j = 0; j < ch; ++j) yr[j] = (xr[j] * s) * wp[j];
      rp[r] = s;
    }
  });
}

void cpu_backend::rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                   const tensor& rstd, tensor& dx, tensor& dw) {
  op_check c("rmsnorm_backward",
             {{"dy", &dy}, {"x", &x}, {"w", &w}, {"rstd", &rstd}, {"dx", &dx}, {"dw", &dw}});
  c.host(dy, "dy", core::dtype::f32);
  c.host(x, "x", core::dtype::f32);
  c.host(w, "w", core::dtype::f32);
  c.host(rstd, "rstd", core::dtype::f32);
  c.host(dx, "dx", core::dtype::f32);
  c.host(dw, "dw", core::dtype::f32);
  c.require(x.rank() >= 1 && x.dim(-1) > 0, "x must be [N, C] with C > 0");
  const std::int64_t ch = x.dim(-1), n = rows_of(x);
  c.matrix(dy, "dy", n, ch, "the shape of x");
  c.matrix(dx, "dx", n, ch, "the shape of x");
  c.shape(w, "w", {ch}, "C = last dim of x");
  c.shape(dw, "dw", {ch}, "C = last dim of x");
  c.numel(rstd, "rstd", n, "one per row of x");
  norm_backward(dy.data<float>(), x.data<float>(), w.data<float>(), nullptr, rstd.data<float>(),
                dx.data<float>(), dw.data<float>(), nullptr, n, ch);
}

}  // namespace troupe::kernels::cpu
