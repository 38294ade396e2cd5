// Softmax cross-entropy fused with its backward, one block per row of logits:
//   m = max_i x_i,  s = Σ_i exp(x_i − m),  loss = log s + m − x_target,
//   dlogits_i = (exp(x_i − m)/s − [i = target])·grad_scale, written over the logits.
// Fusing the backward means the [N, V] probabilities are never stored: the logits buffer (the
// largest activation of GPT-2, 16·1024 × 50304) is read three times from L2 and written once. The
// statistics are fp32 (the sum's block reduction in fp64) whatever the logits' dtype; the
// reductions run in a fixed order, so results are bit-identical run to run. A negative target
// marks an ignored row (zero loss, zero gradient); a target ≥ V, which the CPU reference rejects
// with an error, gives a NaN loss here (a kernel cannot throw), which the NaN check reports.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

template <class T, int V>
__global__ void cross_entropy_kernel(T* logits, const int* targets, float* losses,
                                     float grad_scale, int vocab) {
  __shared__ float red_f[32];
  __shared__ double red_d[32];
  const std::int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  const int t = targets[row];
  if (t < 0) {
    if (threadIdx.x == 0) losses[row] = 0.0f;
    if (grad_scale != 0.0f)
      for (int i = threadIdx.x; i < vocab; i += blockDim.x) x[i] = from_f<T>(0.0f);
    return;
  }
  float m = -INFINITY;
  for (int i = threadIdx.x * V; i < vocab; i += blockDim.x * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(x + i);
#pragma unroll
    for (int k = 0; k < V; ++k) m = fmaxf(m, to_f(p.v[k]));
  }
  m = warp_max(m);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red_f[threadIdx.x / 32] = m;
  __syncthreads();
  m = red_f[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = fmaxf(m, red_f[w]);

  float part = 0.0f;
  for (int i = threadIdx.x * V; i < vocab; i += blockDim.x * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(x + i);
#pragma unroll
    for (int k = 0; k < V; ++k) part += expf(to_f(p.v[k]) - m);
  }
  const double s = block_sum(static_cast<double>(part), red_d);
  const bool valid = t < vocab;
  if (threadIdx.x == 0)
    losses[row] = valid ? static_cast<float>(log(s) + (static_cast<double>(m) - to_f(x[t])))
                        : __int_as_float(0x7fc00000);
  if (grad_scale == 0.0f) return;
  // Every thread has read x[t] above only through thread 0; make sure that read precedes writes.
  __syncthreads();
  const float f = static_cast<float>(grad_scale / s);
  for (int i = threadIdx.x * V; i < vocab; i += blockDim.x * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(x + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float g = expf(to_f(p.v[k]) - m) * f;
      if (i + k == t) g -= grad_scale;
      p.v[k] = from_f<T>(g);
    }
    *reinterpret_cast<pack<T, V>*>(x + i) = p;
  }
}

// ------------------------------------------------------------------------------------------------
// launchers

void launch_cross_entropy(tensor& logits, const tensor& targets, tensor& losses, float grad_scale,
                          cudaStream_t s) {
  const char* op = "cross_entropy";
  require_float(logits, op, "logits");
  require(logits.rank() >= 1 && logits.dim(-1) > 0, op, "logits must be [N, V] with V > 0");
  const std::int64_t vocab = logits.dim(-1), n = logits.numel() / vocab;
  require_type(targets, dtype::i32, op, "targets");
  require_numel(targets, n, op, "targets");
  require_type(losses, dtype::f32, op, "losses");
  require_numel(losses, n, op, "losses");
  if (n == 0) return;
  dispatch_float(logits.type(), op, [&](auto tag) {
    using T = decltype(tag);
    with_row_vector<T>({&logits}, vocab, [&](auto v) {
      cross_entropy_kernel<T, decltype(v)::value><<<static_cast<unsigned>(n), 512, 0, s>>>(
          logits.data<T>(), targets.data<int>(), losses.data<float>(), grad_scale,
          static_cast<int>(vocab));
    });
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
