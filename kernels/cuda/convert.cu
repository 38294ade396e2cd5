// Element type conversion between fp32, bf16 and fp16 tensors of equal shape (round to nearest
// even, as core::f32_to_bf16 does on the host). A plain grid-stride map: it runs once per step at
// most (low-precision weight copies are written by the AdamW kernel itself), so it is not tuned.
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

namespace {

template <class S, class D>
__global__ void convert_kernel(const S* src, D* dst, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    dst[i] = from_f<D>(to_f(src[i]));
}

}  // namespace

void cuda_backend::convert(const tensor& src, tensor& dst) {
  activate();
  if (src.type() == dst.type() && src.shape() == dst.shape()) {
    copy(src, dst);
    return;
  }
  const char* op = "cuda convert";
  require_float(src, op, "src");
  require_float(dst, op, "dst");
  require(src.numel() == dst.numel(), op,
          "src " + core::shape_string(src.shape()) + " and dst " + core::shape_string(dst.shape()) +
              " differ in size");
  const std::int64_t n = src.numel();
  if (n == 0) return;
  dispatch_float(src.type(), op, [&](auto s_tag) {
    using S = decltype(s_tag);
    dispatch_float(dst.type(), op, [&](auto d_tag) {
      using D = decltype(d_tag);
      convert_kernel<S, D><<<grid_for(n, 256), 256, 0, ctx_->stream>>>(src.data<S>(),
                                                                       dst.data<D>(), n);
    });
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
