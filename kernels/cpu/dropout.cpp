// Inverted dropout, y = x ⊙ mask / (1 − p), with the mask drawn per element from the keyed Philox
// stream (core/philox.hpp; kernels/backend.hpp, dropout_spec): nothing is stored, the backward
// redraws the same mask. Each element's bits depend only on its sample and position, so threads
// may split the range anywhere.
#include "core/philox.hpp"
#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

void cpu_backend::dropout(const tensor& x, const dropout_spec& s, std::int64_t sample_elems,
                          tensor& y) {
  op_check c("dropout", {{"x", &x}, {"y", &y}});
  c.host(x, "x", core::dtype::f32);
  c.host(y, "y", core::dtype::f32);
  c.elementwise(x, "x");
  c.require(s.p >= 0 && s.p < 1, "p must be in [0, 1), got " + std::to_string(s.p));
  c.require(sample_elems > 0 && x.numel() % sample_elems == 0,
            "x must hold whole samples of sample_elems = " + std::to_string(sample_elems) +
                " elements");
  const std::uint32_t threshold = core::dropout_threshold(s.p);
  const float scale = core::dropout_scale(s.p);
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_for(x.numel(), 1 << 14, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const auto sample = static_cast<std::uint64_t>(s.first_sample + i / sample_elems);
      const auto within = static_cast<std::uint64_t>(i % sample_elems);
      const bool keep = core::dropout_bits(s.key, sample, within) >= threshold;
      yp[i] = keep ? xp[i] * scale : 0.0f;
    }
  });
}

}  // namespace troupe::kernels::cpu
