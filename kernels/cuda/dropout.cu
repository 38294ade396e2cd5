// Inverted dropout, y = x ⊙ mask / (1 − p): the CUDA twin of kernels/cpu/dropout.cpp. Each thread
// redraws its element's bits from the keyed Philox stream (core/philox.hpp, the same integer
// arithmetic as the CPU), so the mask is nowhere stored and agrees with the CPU's bit for bit;
// the kept value is one fp32 multiply rounded to the tensor's dtype. One Philox block yields four
// words, of which an element uses one: the generator's arithmetic is far below the cost of moving
// the element through HBM.
#include "core/philox.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

namespace {

template <class T>
__global__ void dropout_kernel(const T* x, T* y, std::int64_t n, std::uint64_t key,
                               std::int64_t first_sample, std::int64_t sample_elems,
                               std::uint32_t threshold, float scale) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const auto sample = static_cast<std::uint64_t>(first_sample + i / sample_elems);
    const auto within = static_cast<std::uint64_t>(i % sample_elems);
    const bool keep = core::dropout_bits(key, sample, within) >= threshold;
    y[i] = from_f<T>(keep ? to_f(x[i]) * scale : 0.0f);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// launchers

void cuda_backend::dropout(const tensor& x, const dropout_spec& s, std::int64_t sample_elems,
                           tensor& y) {
  const char* op = "cuda dropout";
  activate();
  require_float(x, op, "x");
  require_type(y, x.type(), op, "y");
  require_numel(y, x.numel(), op, "y");
  require(s.p >= 0 && s.p < 1, op, "p must be in [0, 1), got " + std::to_string(s.p));
  require(sample_elems > 0 && x.numel() % sample_elems == 0, op,
          "x must hold whole samples of sample_elems = " + std::to_string(sample_elems) +
              " elements, got " + std::to_string(x.numel()));
  const std::int64_t n = x.numel();
  if (n == 0) return;
  const std::uint32_t threshold = core::dropout_threshold(s.p);
  const float scale = core::dropout_scale(s.p);
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    dropout_kernel<T><<<grid_for(n, 256), 256, 0, ctx_->stream>>>(
        x.data<T>(), y.data<T>(), n, s.key, s.first_sample, sample_elems, threshold, scale);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
