// GELU with the tanh approximation (GPT-2): y = x/2 · (1 + tanh(√(2/π)(x + 0.044715x³))), and its
// backward dx += dy · GELU'(x). Memory-bound maps through elementwise.cuh; the math is gelu.cuh's.
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/gelu.cuh"

namespace troupe::kernels::cuda {

void cuda_backend::gelu_forward(const tensor& x, tensor& y) {
  activate();
  const char* op = "cuda gelu_forward";
  require_like(x, "x", {{"y", &y}}, op);
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    launch_elementwise<T>(x.numel(), {x.data<T>()}, {y.data<T>()}, gelu_forward_op{},
                          ctx_->stream);
  });
}

void cuda_backend::gelu_backward(const tensor& dy, const tensor& x, tensor& dx) {
  activate();
  const char* op = "cuda gelu_backward";
  require_like(x, "x", {{"dy", &dy}, {"dx", &dx}}, op);
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    launch_elementwise<T>(x.numel(), {dy.data<T>(), x.data<T>(), dx.data<T>()}, {dx.data<T>()},
                          gelu_backward_op{}, ctx_->stream);
  });
}

}  // namespace troupe::kernels::cuda
