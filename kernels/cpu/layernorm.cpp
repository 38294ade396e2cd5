// LayerNorm over the last dimension: y = (x - mean) * rstd * w + b, rstd = 1/sqrt(var + eps),
// with the population variance computed in a second pass over (x - mean) for accuracy. mean and
// rstd are saved for the backward.
// The backward is norm_backward.hpp's, shared with RMSNorm.
#include <algorithm>
#include <cmath>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/norm_backward.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

void cpu_backend::layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps,
                                    tensor& y, tensor& mean, tensor& rstd) {
  op_check c("layernorm_forward",
             {{"x", &x}, {"w", &w}, {"b", &b}, {"y", &y}, {"mean", &mean}, {"rstd", &rstd}});
  c.host(x, "x", core::dtype::f32);
  c.host(w, "w", core::dtype::f32);
  c.optional(b, "b", core::dtype::f32);
  c.host(y, "y", core::dtype::f32);
  c.host(mean, "mean", core::dtype::f32);
  c.host(rstd, "rstd", core::dtype::f32);
  c.require(x.rank() >= 1 && x.dim(-1) > 0, "x must be [N, C] with C > 0");
  const std::int64_t ch = x.dim(-1), n = rows_of(x);
  c.shape(w, "w", {ch}, "C = last dim of x");
  if (b.defined()) c.shape(b, "b", {ch}, "C = last dim of x");
  c.matrix(y, "y", n, ch, "the shape of x");
  c.numel(mean, "mean", n, "one per row of x");
  c.numel(rstd, "rstd", n, "one per row of x");
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  const float* bp = b.defined() ? b.data<float>() : nullptr;
  float* yp = y.data<float>();
  float* mp = mean.data<float>();
  float* rp = rstd.data<float>();
  const float inv_c = 1.0f / static_cast<float>(ch);
  parallel_for(n, std::max<std::int64_t>(1, (1 << 15) / ch), [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * ch;
      float* yr = yp + r * ch;
      const float m = sum(xr, ch) * inv_c;
      const float s = 1.0f / std::sqrt(sum_sq_dev(xr, m, ch) * inv_c + eps);
      for (std::int64_t j = 0; j < ch; ++j) yr[j] = (xr[j] - m) * s * wp[j];
      if (bp)
        for (std::int64_t j = 0; j < ch; ++j) yr[j] += bp[j];
      mp[r] = m;
      rp[r] = s;
    }
  });
}

void cpu_backend::layernorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                     const tensor& mean, const tensor& rstd, tensor& dx, tensor& dw,
                                     tensor& db) {
  op_check c("layernorm_backward", {{"dy", &dy},
                                    {"x", &x},
                                    {"w", &w},
                                    {"mean", &mean},
                                    {"rstd", &rstd},
                                    {"dx", &dx},
                                    {"dw", &dw},
                                    {"db", &db}});
  c.host(dy, "dy", core::dtype::f32);
  c.host(x, "x", core::dtype::f32);
  c.host(w, "w", core::dtype::f32);
  c.host(mean, "mean", core::dtype::f32);
  c.host(rstd, "rstd", core::dtype::f32);
  c.host(dx, "dx", core::dtype::f32);
  c.host(dw, "dw", core::dtype::f32);
  c.optional(db, "db", core::dtype::f32);
  c.require(x.rank() >= 1 && x.dim(-1) > 0, "x must be [N, C] with C > 0");
  const std::int64_t ch = x.dim(-1), n = rows_of(x);
  c.matrix(dy, "dy", n, ch, "the shape of x");
  c.matrix(dx, "dx", n, ch, "the shape of x");
  c.shape(w, "w", {ch}, "C = last dim of x");
  c.shape(dw, "dw", {ch}, "C = last dim of x");
  if (db.defined()) c.shape(db, "db", {ch}, "C = last dim of x");
  c.numel(mean, "mean", n, "one per row of x");
  c.numel(rstd, "rstd", n, "one per row of x");
  norm_backward(dy.data<float>(), x.data<float>(), w.data<float>(), mean.data<float>(),
                rstd.data<float>(), dx.data<float>(), dw.data<float>(),
                db.defined() ? db.data<float>() : nullptr, n, ch);
}

}  // namespace troupe::kernels::cpu
