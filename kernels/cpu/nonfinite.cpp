// NaN / infinity detection (loss-scale overflow, divergence checks): an element is non-finite when
// its exponent bits are all ones, which is one mask-and-compare per element for fp32, bf16 and
// fp16 alike.
#include <atomic>
#include <cstring>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

template <class U>
bool any_exponent_all_ones(const U* p, std::int64_t begin, std::int64_t end, U mask) {
  U hit = 0;
  for (std::int64_t i = begin; i < end; ++i) hit |= static_cast<U>((p[i] & mask) == mask);
  return hit != 0;
}

}  // namespace

bool cpu_backend::has_nonfinite(const tensor& x) {
  op_check c("has_nonfinite", {{"x", &x}});
  c.require(x.defined() && x.dev().is_cpu(), "x must be a defined host tensor");
  const core::dtype t = x.type();
  c.require(t == core::dtype::f32 || t == core::dtype::bf16 || t == core::dtype::f16,
            "x must be fp32, bf16 or fp16");
  std::atomic<bool> found{false};
  parallel_for(x.numel(), 1 << 18, [&](std::int64_t i0, std::int64_t i1) {
    bool hit;
    if (t == core::dtype::f32)
      hit = any_exponent_all_ones<std::uint32_t>(x.data<std::uint32_t>(), i0, i1, 0x7f800000u);
    else
      hit = any_exponent_all_ones<std::uint16_t>(
          x.data<std::uint16_t>(), i0, i1,
          static_cast<std::uint16_t>(t == core::dtype::bf16 ? 0x7f80u : 0x7c00u));
    if (hit) found.store(true);
  });
  return found.load();
}

}  // namespace troupe::kernels::cpu
