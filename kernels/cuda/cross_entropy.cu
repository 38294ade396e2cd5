// Softmax cross-entropy fused with its backward, one block per row of logits:
//   m = max_i x_i,  s = Σ_i exp(x_i − m),  loss = log s + m − x_target,
//   dlogits_i = (exp(x_i − m)/s − [i = target])·grad_scale, written over the logits.
// Fusing the backward means the [N, V] probabilities are never stored. The logits are the largest
// activation of GPT-2 (16·1024 × 50304), so the kernel is a matter of memory traffic:
//  * Row in shared memory (16-bit logits, rows up to 110 KB: GPT-2's and LLaMA-2's vocabularies):
//    the block copies its row into shared memory once (cp.async), and the max, the sum and the
//    gradient are computed from there: the logits are read from memory once and the gradient
//    written once. Two blocks of 512 threads per SM (2 × 100 KB at GPT-2's vocabulary).
//  * Two reads (fp32, longer rows): the first pass keeps a running max and a sum rescaled whenever
//    the max grows (online softmax), so m and s come from one read; the second pass reads the row
//    again while it is still in L2 (two blocks of 512 threads per SM keep about 264 rows live).
// Both write the gradient with streaming stores (not read again soon; they should not push other
// rows out of L2). Statistics are fp32 (the sum's block reduction in fp64) whatever the logits'
// dtype; the reductions run in a fixed order, so results are bit-identical run to run.
// Exponentials are exp2 of one FMA (x·log2 e − m·log2 e): expf's extra range handling made the
// kernel compute-bound (79% SM, 50% DRAM on the H200).
// A negative target marks an ignored row (zero loss, zero gradient); a target ≥ V, which the CPU
// reference rejects with an error, gives a NaN loss here (a kernel cannot throw), which the NaN
// check reports.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

namespace {
constexpr int ce_threads = 512;
constexpr int ce_unroll = 4;  // packs loaded before any is used: more bytes in flight per thread
constexpr float log2e = 1.4426950408889634f;
}  // namespace

/// Loads with the "last use" hint (the line may be evicted) and stores that stream past L2.
template <class T, int V>
__device__ __forceinline__ pack<T, V> load_last(const T* p) {
  if constexpr (sizeof(pack<T, V>) == 16) {
    const int4 r = __ldlu(reinterpret_cast<const int4*>(p));
    return *reinterpret_cast<const pack<T, V>*>(&r);
  } else {
    return *reinterpret_cast<const pack<T, V>*>(p);
  }
}

template <class T, int V>
__device__ __forceinline__ void store_streaming(T* p, const pack<T, V>& v) {
  if constexpr (sizeof(pack<T, V>) == 16)
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
  else
    *reinterpret_cast<pack<T, V>*>(p) = v;
}

/// An ignored row (negative target): zero loss, and a zero gradient when one is asked for.
template <class T>
__device__ __forceinline__ void ignored_row(T* x, float* losses, std::int64_t row,
                                            float grad_scale, int vocab) {
  if (threadIdx.x == 0) losses[row] = 0.0f;
  if (grad_scale != 0.0f)
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) x[i] = from_f<T>(0.0f);
}

/// The largest of every thread's m, in every thread (red_f: 32 floats of shared memory, not in use
/// by the block at the call).
__device__ __forceinline__ float block_max(float m, float* red_f) {
  float bm = warp_max(m);
  if (threadIdx.x % 32 == 0) red_f[threadIdx.x / 32] = bm;
  __syncthreads();
  bm = red_f[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) bm = fmaxf(bm, red_f[w]);
  return bm;
}

template <class T, int V>
__global__ void __launch_bounds__(ce_threads, 2)
    cross_entropy_kernel(T* logits, const int* targets, float* losses, float grad_scale,
                         int vocab) {
  __shared__ float red_f[32];
  __shared__ double red_d[32];
  const std::int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  const int t = targets[row];
  if (t < 0) {
    ignored_row(x, losses, row, grad_scale, vocab);
    return;
  }
  const int step = blockDim.x * V;
  // Pass 1: this thread's running max m and Σ exp(x − m), rescaled when m grows.
  float m = -INFINITY, m2 = -INFINITY, part = 0.0f;  // m2 = m·log2(e)
  for (int base = threadIdx.x * V; base < vocab; base += step * ce_unroll) {
    pack<T, V> p[ce_unroll];
#pragma unroll
    for (int u = 0; u < ce_unroll; ++u)
      if (base + u * step < vocab) p[u] = *reinterpret_cast<const pack<T, V>*>(x + base + u * step);
#pragma unroll
    for (int u = 0; u < ce_unroll; ++u) {
      if (base + u * step >= vocab) continue;
      float pm = m;
#pragma unroll
      for (int k = 0; k < V; ++k) pm = fmaxf(pm, to_f(p[u].v[k]));
      if (pm > m) {
        part *= exp2f((m - pm) * log2e);
        m = pm;
        m2 = m * log2e;
      }
      // −∞ logits (masked entries) add nothing, also while m is still −∞ (where x − m is NaN).
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float xv = to_f(p[u].v[k]);
        part += xv == -INFINITY ? 0.0f : exp2f(fmaf(xv, log2e, -m2));
      }
    }
  }
  const float bm = block_max(m, red_f);
  // Each thread's sum moved to the row max (a thread that saw only −∞ adds nothing).
  const float mine = m == -INFINITY ? 0.0f : part * exp2f((m - bm) * log2e);
  const double s = block_sum(static_cast<double>(mine), red_d);
  const bool valid = t < vocab;
  if (threadIdx.x == 0)
    losses[row] = valid ? static_cast<float>(log(s) + (static_cast<double>(bm) - to_f(x[t])))
                        : __int_as_float(0x7fc00000);
  if (grad_scale == 0.0f) return;
  // Thread 0 read x[t] above; that read must precede the writes below.
  __syncthreads();
  const float f = static_cast<float>(grad_scale / s);
  const float bm2 = bm * log2e;
  for (int base = threadIdx.x * V; base < vocab; base += step * ce_unroll) {
    pack<T, V> p[ce_unroll];
#pragma unroll
    for (int u = 0; u < ce_unroll; ++u)
      if (base + u * step < vocab) p[u] = load_last<T, V>(x + base + u * step);
#pragma unroll
    for (int u = 0; u < ce_unroll; ++u) {
      const int i = base + u * step;
      if (i >= vocab) continue;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float g = exp2f(fmaf(to_f(p[u].v[k]), log2e, -bm2)) * f;
        if (i + k == t) g -= grad_scale;
        p[u].v[k] = from_f<T>(g);
      }
      store_streaming<T, V>(x + i, p[u]);
    }
  }
}

/// Largest row (bytes) the shared-memory kernel takes: two blocks per SM fit the H200's 227 KB.
constexpr int ce_smem_max = 110 * 1024;

template <class T, int V>
__global__ void __launch_bounds__(ce_threads, 2)
    cross_entropy_smem_kernel(T* logits, const int* targets, float* losses, float grad_scale,
                              int vocab) {
  extern __shared__ __align__(16) unsigned char ce_row[];
  __shared__ float red_f[32];
  __shared__ double red_d[32];
  using P = pack<T, V>;
  P* row_s = reinterpret_cast<P*>(ce_row);
  const std::int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  const int t = targets[row];
  if (t < 0) {
    ignored_row(x, losses, row, grad_scale, vocab);
    return;
  }
  const int packs = vocab / V;
  // Each thread copies, and later reads back, its own packs: no barrier is needed in between.
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    if constexpr (sizeof(P) == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                       static_cast<unsigned>(__cvta_generic_to_shared(row_s + i))),
                   "l"(x + static_cast<std::int64_t>(i) * V));
    } else {
      row_s[i] = reinterpret_cast<const P*>(x)[i];
    }
  }
  if constexpr (sizeof(P) == 16) asm volatile("cp.async.wait_all;\n" ::: "memory");
  float m = -INFINITY;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const P p = row_s[i];
#pragma unroll
    for (int k = 0; k < V; ++k) m = fmaxf(m, to_f(p.v[k]));
  }
  const float bm = block_max(m, red_f);
  const float bm2 = bm * log2e;
  float part = 0.0f;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const P p = row_s[i];
    // −∞ logits (masked entries) add nothing, also when the whole row is −∞.
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xv = to_f(p.v[k]);
      part += xv == -INFINITY ? 0.0f : exp2f(fmaf(xv, log2e, -bm2));
    }
  }
  const double s = block_sum(static_cast<double>(part), red_d);
  const bool valid = t < vocab;
  if (threadIdx.x == 0)
    losses[row] = valid ? static_cast<float>(log(s) + (static_cast<double>(bm) -
                                                        to_f(row_s[t / V].v[t % V])))
                        : __int_as_float(0x7fc00000);
  if (grad_scale == 0.0f) return;
  const float f = static_cast<float>(grad_scale / s);
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    P p = row_s[i];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float g = exp2f(fmaf(to_f(p.v[k]), log2e, -bm2)) * f;
      if (i * V + k == t) g -= grad_scale;
      p.v[k] = from_f<T>(g);
    }
    store_streaming<T, V>(x + static_cast<std::int64_t>(i) * V, p);
  }
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

void cuda_backend::cross_entropy(tensor& logits, const tensor& targets, tensor& losses,
                                 float grad_scale) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda cross_entropy";
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
      constexpr int V = decltype(v)::value;
      const std::size_t row_bytes = static_cast<std::size_t>(vocab) * sizeof(T);
      if (!std::is_same_v<T, float> && row_bytes <= ce_smem_max) {
        auto kernel = cross_entropy_smem_kernel<T, V>;
        static const bool sized = [&] {
          TROUPE_CUDA_CHECK(
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ce_smem_max));
          TROUPE_CUDA_CHECK(
              cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
          return true;
        }();
        (void)sized;
        kernel<<<static_cast<unsigned>(n), ce_threads, row_bytes, s>>>(
            logits.data<T>(), targets.data<int>(), losses.data<float>(), grad_scale,
            static_cast<int>(vocab));
      } else {
        cross_entropy_kernel<T, V><<<static_cast<unsigned>(n), ce_threads, 0, s>>>(
            logits.data<T>(), targets.data<int>(), losses.data<float>(), grad_scale,
            static_cast<int>(vocab));
      }
    });
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
