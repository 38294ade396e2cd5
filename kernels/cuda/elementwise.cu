// Residual and gradient arithmetic: y = a + b, y += x, x *= s. Same-typed operands go through
// elementwise.cuh (16-byte accesses when aligned); mixed dtypes (an fp32 gradient accumulated from a
// bf16 one) take a scalar path with run-time dtype access. Outputs may alias inputs: each element
// is read before it is written by the same thread.
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/elementwise.cuh"

namespace troupe::kernels::cuda {

namespace {

__device__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void add_mixed_kernel(const void* a, int ca, const void* b, int cb, void* y, int cy,
                                 std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    store_f(y, cy, i, load_f(a, ca, i) + load_f(b, cb, i));
}

/// in {a, b}, out {a + b}.
struct add_op {
  __device__ void operator()(const float* in, float* out) const { out[0] = in[0] + in[1]; }
};

/// in {x}, out {x · s}.
struct scale_op {
  float s;
  __device__ void operator()(const float* in, float* out) const { out[0] = in[0] * s; }
};

void check_same_size(const tensor& a, const tensor& b, const char* op, const char* an,
                     const char* bn) {
  require(a.numel() == b.numel(), op,
          std::string(an) + " " + core::shape_string(a.shape()) + " and " + bn + " " +
              core::shape_string(b.shape()) + " differ in size");
}

__global__ void spin_kernel(unsigned ns) {
  const unsigned long long until = globaltimer() + ns;
  while (globaltimer() < until) __nanosleep(1000);
}

/// y = a + b on stream s (y may be a or b).
void add_on(const tensor& a, const tensor& b, tensor& y, cudaStream_t s) {
  const char* op = "cuda add";
  require_float(a, op, "a");
  require_float(b, op, "b");
  require_float(y, op, "y");
  check_same_size(a, b, op, "a", "b");
  check_same_size(a, y, op, "a", "y");
  const std::int64_t n = a.numel();
  if (n == 0) return;
  if (a.type() == b.type() && a.type() == y.type()) {
    dispatch_float(a.type(), op, [&](auto tag) {
      using T = decltype(tag);
      launch_elementwise<T>(n, {a.data<T>(), b.data<T>()}, {y.data<T>()}, add_op{}, s);
    });
    return;
  }
  add_mixed_kernel<<<grid_for(n, 256), 256, 0, s>>>(a.raw(), code_of(a.type()), b.raw(),
                                                    code_of(b.type()), y.raw(), code_of(y.type()),
                                                    n);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void debug_spin(cudaStream_t s, unsigned ns) {
  if (ns == 0) return;
  spin_kernel<<<1, 32, 0, s>>>(ns);
  TROUPE_CUDA_CHECK(cudaGetLastError());
}

void cuda_backend::add(const tensor& a, const tensor& b, tensor& y) {
  activate();
  add_on(a, b, y, ctx_->stream);
}

void cuda_backend::accumulate(const tensor& x, tensor& y) {
  activate();
  require_float(x, "cuda accumulate", "x");
  require_float(y, "cuda accumulate", "y");
  check_same_size(x, y, "cuda accumulate", "x", "y");
  add_on(y, x, y, ctx_->stream);
}

void cuda_backend::scale(tensor& x, float s) {
  activate();
  require_float(x, "cuda scale", "x");
  dispatch_float(x.type(), "cuda scale", [&](auto tag) {
    using T = decltype(tag);
    launch_elementwise<T>(x.numel(), {x.data<T>()}, {x.data<T>()}, scale_op{s}, ctx_->stream);
  });
}

}  // namespace troupe::kernels::cuda
