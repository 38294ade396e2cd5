// Element type conversion between fp32, bf16 and fp16 host tensors of equal shape (round to
// nearest even; the twin of kernels/cuda/convert.cu).
#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

namespace {

float load_as_f32(const void* p, std::int64_t i, core::dtype t) {
  switch (t) {
    case core::dtype::bf16:
      return core::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case core::dtype::f16:
      return core::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

void store_from_f32(void* p, std::int64_t i, core::dtype t, float v) {
  switch (t) {
    case core::dtype::bf16:
      static_cast<std::uint16_t*>(p)[i] = core::f32_to_bf16(v);
      break;
    case core::dtype::f16:
      static_cast<std::uint16_t*>(p)[i] = core::f32_to_f16(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

}  // namespace

void cpu_backend::convert(const tensor& src, tensor& dst) {
  op_check c("convert", {{"src", &src}, {"dst", &dst}});
  c.require(src.defined() && dst.defined() && src.dev().is_cpu() && dst.dev().is_cpu(),
            "src and dst must be defined host tensors");
  c.require(is_float(src.type()) && is_float(dst.type()),
            "src and dst must be fp32, bf16 or fp16");
  c.require(src.shape() == dst.shape(), "src and dst must have the same shape");
  if (src.type() == dst.type()) {
    copy(src, dst);
    return;
  }
  const void* s = src.raw();
  void* d = dst.raw();
  const core::dtype st = src.type(), dt = dst.type();
  parallel_for(src.numel(), 1 << 16, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) store_from_f32(d, i, dt, load_as_f32(s, i, st));
  });
}

}  // namespace troupe::kernels::cpu
