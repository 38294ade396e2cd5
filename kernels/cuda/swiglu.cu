// SwiGLU (LLaMA MLP): y = silu(gate) · up with silu(g) = g·σ(g); backward (written)
// dgate = dy·up·σ(g)·(1 + g·(1 − σ(g))), dup = dy·silu(g). Memory-bound maps through
// elementwise.cuh, fp32 math with the accurate expf.
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/elementwise.cuh"

namespace troupe::kernels::cuda {

namespace {

__device__ __forceinline__ float sigmoid_f(float g) { return 1.0f / (1.0f + expf(-g)); }

/// in {gate, up}, out {y}.
struct swiglu_forward_op {
  __device__ void operator()(const float* in, float* out) const {
    const float g = in[0];
    out[0] = g * sigmoid_f(g) * in[1];
  }
};

/// in {dy, gate, up}, out {dgate, dup}.
struct swiglu_backward_op {
  __device__ void operator()(const float* in, float* out) const {
    const float g = in[1], u = in[2], d = in[0];
    const float sg = sigmoid_f(g);
    out[0] = d * u * sg * (1.0f + g * (1.0f - sg));
    out[1] = d * g * sg;
  }
};

}  // namespace

void cuda_backend::swiglu_forward(const tensor& gate, const tensor& up, tensor& y) {
  activate();
  const char* op = "cuda swiglu_forward";
  require_like(gate, "gate", {{"up", &up}, {"y", &y}}, op);
  dispatch_float(gate.type(), op, [&](auto tag) {
    using T = decltype(tag);
    launch_elementwise<T>(gate.numel(), {gate.data<T>(), up.data<T>()}, {y.data<T>()},
                          swiglu_forward_op{}, ctx_->stream);
  });
}

void cuda_backend::swiglu_backward(const tensor& dy, const tensor& gate, const tensor& up,
                                   tensor& dgate, tensor& dup) {
  activate();
  const char* op = "cuda swiglu_backward";
  require_like(gate, "gate", {{"dy", &dy}, {"up", &up}, {"dgate", &dgate}, {"dup", &dup}}, op);
  dispatch_float(gate.type(), op, [&](auto tag) {
    using T = decltype(tag);
    launch_elementwise<T>(
        gate.numel(), {dy.data<T>(), gate.data<T>(), up.data<T>()},
        {dgate.data<T>(), dup.data<T>()}, swiglu_backward_op{}, ctx_->stream);
  });
}

}  // namespace troupe::kernels::cuda
