// The exact sum of fp64 values into a superaccumulator (core/exact_sum.hpp), and the clip factor
// read from one: the host's half of deciding the clip on the device. Both are the plain core
// functions, so the CUDA kernels that run the same code give the same bits.
#include <cmath>

#include "kernels/clip.hpp"
#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"

namespace troupe::kernels::cpu {

void cpu_backend::exact_sum_add(const tensor& values, tensor& acc) {
  op_check c("exact_sum_add", {{"values", &values}, {"acc", &acc}});
  c.host(values, "values", core::dtype::f64);
  c.host(acc, "acc", core::dtype::i64);
  c.numel(acc, "acc", core::exact_sum_words, "core::exact_sum_words");
  const double* v = values.data<double>();
  std::int64_t* w = acc.data<std::int64_t>();
  for (std::int64_t i = 0; i < values.numel(); ++i) core::exact_sum_add(w, v[i]);
}

void cpu_backend::clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip,
                              tensor& out) {
  op_check c("clip_factor", {{"sumsq", &sumsq}, {"guard", &guard}, {"out", &out}});
  c.host(sumsq, "sumsq", core::dtype::i64);
  c.numel(sumsq, "sumsq", core::exact_sum_words, "core::exact_sum_words");
  if (guard.defined()) {
    c.host(guard, "guard", core::dtype::i64);
    c.numel(guard, "guard", core::exact_sum_words, "core::exact_sum_words");
  }
  c.host(out, "out", core::dtype::f64);
  c.numel(out, "out", 2, "{norm, factor}");
  const double norm = std::sqrt(core::exact_sum_value(sumsq.data<std::int64_t>()));
  const bool ok = std::isfinite(norm) && (!guard.defined() || std::isfinite(core::exact_sum_value(
                                                                   guard.data<std::int64_t>())));
  double* o = out.data<double>();
  o[0] = norm;
  o[1] = ok ? static_cast<double>(clip_scale_of(norm, grad_clip)) : std::nan("");
}

}  // namespace troupe::kernels::cpu
