// AdamW with decoupled weight decay on fp32 master weights, fused with the write of the bf16/fp16
// working copy, element-wise:
//   g = grad·grad_scale;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²
//   p = p − lr·((m/bc1)/(√(v/bc2) + eps) + wd·p);  low = round(p)
// with the bias corrections bc1 = 1 − β1^step, bc2 = 1 − β2^step computed in double on the host and
// rounded to float, exactly as the CPU reference does, so both agree to rounding. One pass over the
// five (or six) buffers is the whole optimizer step: no separate cast kernel for the low copy.
// adamw_runs does a chunk's whole flat buffer in one launch (a model has a hundred or more
// parameter tensors; one launch each cost more in launch gaps and tails than in bandwidth).
// adamw_params::grad_factor (the clip decided on the device by clip_factor) is read by every thread
// in place of grad_scale, so the host need not wait for the norm before queuing the update, and
// adamw_params::schedule in place of lr and the bias corrections, so a replayed graph follows the
// learning-rate schedule.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

struct adamw_consts {
  float lr, beta1, beta2, one_minus_b1, one_minus_b2, bc1, bc2, eps, wd, grad_scale;
  const double* factor;  // adamw_params::grad_factor, or null
  const float* schedule;  // adamw_params::schedule {lr, bc1, bc2}, or null
};

/// Applies adamw_params::grad_factor: false when the step is to be skipped (the factor is not
/// finite). The same for every thread, so a block returns as a whole.
__device__ __forceinline__ bool take_factor(adamw_consts& k) {
  if (k.schedule != nullptr) {
    k.lr = k.schedule[0];
    k.bc1 = k.schedule[1];
    k.bc2 = k.schedule[2];
  }
  if (k.factor == nullptr) return true;
  const double f = *k.factor;
  if (!isfinite(f)) return false;
  k.grad_scale = static_cast<float>(f);
  return true;
}

/// The update of one element, in IEEE round-to-nearest operations that the compiler may not fuse
/// into FMAs: left to itself, nvcc contracts differently in differently shaped loops (measured on
/// the H200: the 16-byte and the scalar loops gave results 1 ulp apart), and a run of adamw_runs
/// must give the bits of an adamw launch over the same elements. The same operations in the same
/// order as the CPU reference (built with -ffp-contract=off).
__device__ __forceinline__ void adamw_element(float& p, float grad, float& m, float& v,
                                              const adamw_consts& k, float wd) {
  const float g = __fmul_rn(grad, k.grad_scale);
  const float mi = __fadd_rn(__fmul_rn(k.beta1, m), __fmul_rn(k.one_minus_b1, g));
  const float vi = __fadd_rn(__fmul_rn(k.beta2, v), __fmul_rn(k.one_minus_b2, __fmul_rn(g, g)));
  m = mi;
  v = vi;
  const float step = __fadd_rn(
      __fdiv_rn(__fdiv_rn(mi, k.bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, k.bc2)), k.eps)),
      __fmul_rn(wd, p));
  p = __fsub_rn(p, __fmul_rn(k.lr, step));
}

/// V consecutive elements per thread and access (V = 4: 16-byte loads of the fp32 buffers).
template <class L, int V>
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, L* low,
                             adamw_consts k, std::int64_t n) {
  if (!take_factor(k)) return;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < n; i += stride) {
    pack<float, V> pp = *reinterpret_cast<const pack<float, V>*>(param + i);
    const pack<float, V> pg = *reinterpret_cast<const pack<float, V>*>(grad + i);
    pack<float, V> pm = *reinterpret_cast<const pack<float, V>*>(m + i);
    pack<float, V> pv = *reinterpret_cast<const pack<float, V>*>(v + i);
    pack<L, V> pl;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      adamw_element(pp.v[e], pg.v[e], pm.v[e], pv.v[e], k, k.wd);
      pl.v[e] = from_f<L>(pp.v[e]);
    }
    *reinterpret_cast<pack<float, V>*>(param + i) = pp;
    *reinterpret_cast<pack<float, V>*>(m + i) = pm;
    *reinterpret_cast<pack<float, V>*>(v + i) = pv;
    if (low) *reinterpret_cast<pack<L, V>*>(low + i) = pl;
  }
}

/// Runs per launch of adamw_runs_kernel: the table travels as a kernel parameter (under the 4 KiB
/// limit), so no upload precedes the launch. GPT-2 124M has 149 tensors, so one launch.
constexpr int runs_per_launch = 160;

/// Sorted, disjoint runs [begin, end) with their weight decay.
struct adamw_run_table {
  std::int64_t begin[runs_per_launch];
  std::int64_t end[runs_per_launch];
  float wd[runs_per_launch];
  int count;
};

/// A grid-stride loop over [lo, hi) in groups of V elements; each group finds its run by binary
/// search in the block's shared copy of the table and is skipped when it lies in a gap between
/// runs. REQUIRES for V > 1: every run begins at a multiple of V, so a group that reaches past its
/// run's end holds only gap elements after it (the next run begins at a later multiple of V).
template <class L, int V>
__global__ void __launch_bounds__(256)
    adamw_runs_kernel(float* param, const float* grad, float* m, float* v, L* low, adamw_consts k,
                      const __grid_constant__ adamw_run_table runs, std::int64_t lo,
                      std::int64_t hi) {
  if (!take_factor(k)) return;
  __shared__ std::int64_t begin_s[runs_per_launch], end_s[runs_per_launch];
  __shared__ float wd_s[runs_per_launch];
  const int count = runs.count;
  for (int r = threadIdx.x; r < count; r += blockDim.x) {
    begin_s[r] = runs.begin[r];
    end_s[r] = runs.end[r];
    wd_s[r] = runs.wd[r];
  }
  __syncthreads();
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * V;
  for (std::int64_t i = lo + (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
       i < hi; i += stride) {
    int a = 0, b = count - 1;  // the last run with begin <= i (begin_s[0] == lo <= i)
    while (a < b) {
      const int mid = (a + b + 1) / 2;
      if (begin_s[mid] <= i)
        a = mid;
      else
        b = mid - 1;
    }
    const std::int64_t e = end_s[a];
    if (i >= e) continue;
    const float wd = wd_s[a];
    if (i + V <= e) {
      pack<float, V> pp = *reinterpret_cast<const pack<float, V>*>(param + i);
      const pack<float, V> pg = *reinterpret_cast<const pack<float, V>*>(grad + i);
      pack<float, V> pm = *reinterpret_cast<const pack<float, V>*>(m + i);
      pack<float, V> pv = *reinterpret_cast<const pack<float, V>*>(v + i);
      pack<L, V> pl;
#pragma unroll
      for (int x = 0; x < V; ++x) {
        adamw_element(pp.v[x], pg.v[x], pm.v[x], pv.v[x], k, wd);
        pl.v[x] = from_f<L>(pp.v[x]);
      }
      *reinterpret_cast<pack<float, V>*>(param + i) = pp;
      *reinterpret_cast<pack<float, V>*>(m + i) = pm;
      *reinterpret_cast<pack<float, V>*>(v + i) = pv;
      if (low) *reinterpret_cast<pack<L, V>*>(low + i) = pl;
    } else {
      for (std::int64_t j = i; j < e; ++j) {
        float pj = param[j], mj = m[j], vj = v[j];
        adamw_element(pj, grad[j], mj, vj, k, wd);
        param[j] = pj;
        m[j] = mj;
        v[j] = vj;
        if (low) low[j] = from_f<L>(pj);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {

adamw_consts consts_of(const adamw_params& p) {
  adamw_consts k{};
  k.lr = p.lr;
  k.beta1 = p.beta1;
  k.beta2 = p.beta2;
  k.one_minus_b1 = 1.0f - p.beta1;
  k.one_minus_b2 = 1.0f - p.beta2;
  k.bc1 = adamw_bias_correction(p.beta1, p.step);
  k.bc2 = adamw_bias_correction(p.beta2, p.step);
  k.eps = p.eps;
  k.wd = p.weight_decay;
  k.grad_scale = p.grad_scale;
  k.factor = p.grad_factor.defined() ? p.grad_factor.data<double>() : nullptr;
  k.schedule = p.schedule.defined() ? p.schedule.data<float>() : nullptr;
  return k;
}

/// The checks both launchers make: fp32 param/grad/m/v of n elements, low bf16/fp16 of n or
/// undefined, step >= 1.
void check_buffers(const char* op, const tensor& param, const tensor& grad, const tensor& m,
                   const tensor& v, const adamw_params& p, const tensor& low) {
  require_type(param, dtype::f32, op, "param");
  require_type(grad, dtype::f32, op, "grad");
  require_type(m, dtype::f32, op, "m");
  require_type(v, dtype::f32, op, "v");
  const std::int64_t n = param.numel();
  require_numel(grad, n, op, "grad");
  require_numel(m, n, op, "m");
  require_numel(v, n, op, "v");
  if (low.defined()) {
    require(low.type() == dtype::bf16 || low.type() == dtype::f16, op,
            std::string("low must be bf16 or fp16, got ") + core::dtype_name(low.type()));
    require_numel(low, n, op, "low");
  }
  require(p.step >= 1, op, "step must be >= 1 (1-based), got " + std::to_string(p.step));
  if (p.grad_factor.defined()) {
    require_type(p.grad_factor, dtype::f64, op, "grad_factor");
    require_numel(p.grad_factor, 1, op, "grad_factor");
  }
  if (p.schedule.defined()) {
    require_type(p.schedule, dtype::f32, op, "schedule");
    require_numel(p.schedule, 3, op, "schedule ({lr, bc1, bc2})");
  }
}

}  // namespace

void cuda_backend::adamw(tensor& param, const tensor& grad, tensor& m, tensor& v,
                         const adamw_params& p, tensor& low) {
  activate();
  cudaStream_t s = ctx_->stream;
  check_buffers("cuda adamw", param, grad, m, v, p, low);
  const std::int64_t n = param.numel();
  if (n == 0) return;
  const adamw_consts k = consts_of(p);
  const bool vec = n % 4 == 0 && aligned16(param.raw()) && aligned16(grad.raw()) &&
                   aligned16(m.raw()) && aligned16(v.raw()) &&
                   (!low.defined() || reinterpret_cast<std::uintptr_t>(low.raw()) % 8 == 0);
  auto run = [&](auto low_tag) {
    using L = decltype(low_tag);
    L* lp = low.defined() ? low.data<L>() : nullptr;
    if (vec)
      adamw_kernel<L, 4><<<grid_for(n / 4, 256), 256, 0, s>>>(
          param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), lp, k, n);
    else
      adamw_kernel<L, 1><<<grid_for(n, 256), 256, 0, s>>>(
          param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), lp, k, n);
  };
  if (low.defined() && low.type() == dtype::f16)
    run(f16{});
  else
    run(bf16{});
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::adamw_runs(tensor& param, const tensor& grad, tensor& m, tensor& v,
                              const std::vector<adamw_run>& runs, const adamw_params& p,
                              tensor& low) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda adamw_runs";
  check_buffers(op, param, grad, m, v, p, low);
  const std::int64_t n = param.numel();
  std::vector<adamw_run> sorted;
  for (const adamw_run& r : runs) {
    require(r.begin >= 0 && r.begin <= r.end && r.end <= n, op,
            "run [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                ") is not a range of the " + std::to_string(n) + " elements");
    if (r.begin < r.end) sorted.push_back(r);
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const adamw_run& a, const adamw_run& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < sorted.size(); ++i)
    require(sorted[i].begin >= sorted[i - 1].end, op,
            "runs [" + std::to_string(sorted[i - 1].begin) + ", " +
                std::to_string(sorted[i - 1].end) + ") and [" + std::to_string(sorted[i].begin) +
                ", " + std::to_string(sorted[i].end) + ") overlap");
  if (sorted.empty()) return;
  const adamw_consts k = consts_of(p);
  bool vec = aligned16(param.raw()) && aligned16(grad.raw()) && aligned16(m.raw()) &&
             aligned16(v.raw()) &&
             (!low.defined() || reinterpret_cast<std::uintptr_t>(low.raw()) % 8 == 0);
  for (const adamw_run& r : sorted) vec = vec && r.begin % 4 == 0;
  for (std::size_t first = 0; first < sorted.size(); first += runs_per_launch) {
    const std::size_t last = std::min(sorted.size(), first + runs_per_launch);
    adamw_run_table t{};
    t.count = static_cast<int>(last - first);
    for (std::size_t i = first; i < last; ++i) {
      t.begin[i - first] = sorted[i].begin;
      t.end[i - first] = sorted[i].end;
      t.wd[i - first] = sorted[i].decay ? p.weight_decay : 0.0f;
    }
    const std::int64_t lo = sorted[first].begin, hi = sorted[last - 1].end;
    // Enough resident threads to saturate memory; each block copies the table once.
    const int V = vec ? 4 : 1;
    const unsigned blocks =
        static_cast<unsigned>(std::min<std::int64_t>((hi - lo + 256 * V - 1) / (256 * V), 4096));
    auto run = [&](auto low_tag) {
      using L = decltype(low_tag);
      L* lp = low.defined() ? low.data<L>() : nullptr;
      if (vec)
        adamw_runs_kernel<L, 4><<<blocks, 256, 0, s>>>(param.data<float>(), grad.data<float>(),
                                                       m.data<float>(), v.data<float>(), lp, k, t,
                                                       lo, hi);
      else
        adamw_runs_kernel<L, 1><<<blocks, 256, 0, s>>>(param.data<float>(), grad.data<float>(),
                                                       m.data<float>(), v.data<float>(), lp, k, t,
                                                       lo, hi);
    };
    if (low.defined() && low.type() == dtype::f16)
      run(f16{});
    else
      run(bf16{});
    TROUPE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace troupe::kernels::cuda
