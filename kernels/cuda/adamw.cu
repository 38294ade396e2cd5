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
#include "kernels/cuda/warp_xxh3.cuh"
#include "kernels/message_hash.hpp"

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

/// The last of `count` (>= 1) runs sorted by begin whose begin is <= i (run 0 when none is), by
/// binary search of the block's shared copy of the table.
__device__ __forceinline__ int last_begun(std::int64_t i, const std::int64_t* begin_s, int count) {
  int a = 0, b = count - 1;
  while (a < b) {
    const int mid = (a + b + 1) / 2;
    if (begin_s[mid] <= i)
      a = mid;
    else
      b = mid - 1;
  }
  return a;
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
    const int a = last_begun(i, begin_s, count);  // begin_s[0] == lo <= i
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

/// XXH3's default secret (kernels/message_hash.hpp), for adamw_block_kernel.
__constant__ xxh3::secret c_adamw_secret = xxh3::default_secret;

/// Elements of one message-hash block (4096 bytes of fp32).
constexpr std::int64_t hash_block_elems = static_cast<std::int64_t>(message_hash_block / sizeof(float));
static_assert(hash_block_elems == 1024, "adamw_block_kernel: a warp's 32 lanes read 8 float4 each");

/// The run of element i in the block's shared table (the last with begin <= i), or -1 when i lies
/// before the first run or after the run's end.
__device__ __forceinline__ int run_of(std::int64_t i, const std::int64_t* begin_s,
                                      const std::int64_t* end_s, int count) {
  if (count == 0) return -1;
  const int a = last_begun(i, begin_s, count);
  return i >= begin_s[a] && i < end_s[a] ? a : -1;
}

/// adamw_runs_kernel's update of blocks [first, last) of message_hash_block bytes of param (runs
/// given relative to param's start, 16-byte aligned as adamw_runs_kernel<L, 4> needs), one warp
/// per block, the run of a block found once when the block lies inside it (adamw_runs_kernel
/// searches the table for every 16-byte group; times in docs/cuda.md). With Hash, each block's
/// message-hash digest (seed 0) of the parameters as written, from the registers that hold them
/// (warp_xxh3.cuh: lane l holds float4 32j + l of the block, the layout of sumsq's norm blocks).
/// `update` false (the step skipped by grad_factor): the blocks are hashed, nothing is written.
/// A last, shorter block is updated element by element and hashed by its warp's first lane.
template <class L, bool Hash>
__global__ void __launch_bounds__(256)
    adamw_block_kernel(float* param, const float* grad, float* m, float* v, L* low, adamw_consts k,
                       const __grid_constant__ adamw_run_table runs, std::int64_t n,
                       std::int64_t first, std::int64_t last, std::uint64_t* digests) {
  const bool update = take_factor(k);
  if (!Hash && !update) return;
  __shared__ std::int64_t begin_s[runs_per_launch], end_s[runs_per_launch];
  __shared__ float wd_s[runs_per_launch];
  __shared__ std::uint64_t kw[24];
  const int count = runs.count;
  for (int r = threadIdx.x; r < count; r += blockDim.x) {
    begin_s[r] = runs.begin[r];
    end_s[r] = runs.end[r];
    wd_s[r] = runs.wd[r];
  }
  if (threadIdx.x < 24) kw[threadIdx.x] = c_adamw_secret.w[threadIdx.x];
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t blk = first + static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) +
                          threadIdx.x / 32;
       blk < last; blk += warps) {
    const std::int64_t base = blk * hash_block_elems;
    if (base + hash_block_elems > n) {
      for (std::int64_t i = base + lane; i < n; i += 32) {
        const int r = update ? run_of(i, begin_s, end_s, count) : -1;
        if (r < 0) continue;
        float pi = param[i], mi = m[i], vi = v[i];
        adamw_element(pi, grad[i], mi, vi, k, wd_s[r]);
        param[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (low) low[i] = from_f<L>(pi);
      }
      if (!Hash) continue;
      __syncwarp();  // the lanes' writes are visible to lane 0 from here
      if (lane == 0)
        digests[blk] = xxh3::xxh3_64(xxh3::byte_reader{reinterpret_cast<const unsigned char*>(param + base)},
                                     static_cast<std::uint64_t>(n - base) * sizeof(float), 0,
                                     c_adamw_secret);
      continue;
    }
    // Most blocks lie inside one run (a tensor's): then every group is updated, with no search
    // per group and its four loads issued together. The test is the same for the whole warp.
    const int rb = update ? run_of(base, begin_s, end_s, count) : -1;
    const bool inside = rb >= 0 && end_s[rb] >= base + hash_block_elems;
    const float wd_b = rb >= 0 ? wd_s[rb] : 0.0f;
    warp_block_xxh3 hash(lane);
#pragma unroll 1
    for (int round = 0; round < 4; ++round) {
      pack<float, 4> pp[2];
      if (inside) {
        pack<float, 4> pg[2], pm[2], pv[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const std::int64_t i = base + 4 * (32 * (2 * round + h) + lane);
          pp[h] = *reinterpret_cast<const pack<float, 4>*>(param + i);
          pg[h] = *reinterpret_cast<const pack<float, 4>*>(grad + i);
          pm[h] = *reinterpret_cast<const pack<float, 4>*>(m + i);
          pv[h] = *reinterpret_cast<const pack<float, 4>*>(v + i);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const std::int64_t i = base + 4 * (32 * (2 * round + h) + lane);
          pack<L, 4> pl;
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            adamw_element(pp[h].v[x], pg[h].v[x], pm[h].v[x], pv[h].v[x], k, wd_b);
            pl.v[x] = from_f<L>(pp[h].v[x]);
          }
          *reinterpret_cast<pack<float, 4>*>(param + i) = pp[h];
          *reinterpret_cast<pack<float, 4>*>(m + i) = pm[h];
          *reinterpret_cast<pack<float, 4>*>(v + i) = pv[h];
          if (low) *reinterpret_cast<pack<L, 4>*>(low + i) = pl;
        }
      } else {
        // A block with run ends or gaps in it (or none updated): group by group, each finding
        // its own run; elements of no run are hashed as they are.
#pragma unroll 1
        for (int h = 0; h < 2; ++h) {
          const std::int64_t i = base + 4 * (32 * (2 * round + h) + lane);
          if (Hash) pp[h] = *reinterpret_cast<const pack<float, 4>*>(param + i);
          const int r = update ? run_of(i, begin_s, end_s, count) : -1;
          if (r < 0) continue;
          if (!Hash) pp[h] = *reinterpret_cast<const pack<float, 4>*>(param + i);
          const std::int64_t e = end_s[r];
          const float wd = wd_s[r];
          for (int x = 0; x < 4 && i + x < e; ++x) {
            float mj = m[i + x], vj = v[i + x];
            adamw_element(pp[h].v[x], grad[i + x], mj, vj, k, wd);
            param[i + x] = pp[h].v[x];
            m[i + x] = mj;
            v[i + x] = vj;
            if (low) low[i + x] = from_f<L>(pp[h].v[x]);
          }
        }
      }
      if (Hash) hash.round(pp, round, lane, kw);
    }
    if (!Hash) continue;
    const std::uint64_t merged = hash.merged(kw);
    if (lane == 0) digests[blk] = warp_block_xxh3::digest(merged);
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

/// The runs with elements, sorted by begin; refused when one is not a range of the n elements or
/// two overlap.
std::vector<adamw_run> sorted_runs(const char* op, const std::vector<adamw_run>& runs,
                                   std::int64_t n) {
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
  return sorted;
}

/// True when the buffers and runs allow 16-byte groups (adamw_runs_kernel<L, 4>).
bool vectorised(const tensor& param, const tensor& grad, const tensor& m, const tensor& v,
                const tensor& low, const std::vector<adamw_run>& sorted) {
  bool vec = aligned16(param.raw()) && aligned16(grad.raw()) && aligned16(m.raw()) &&
             aligned16(v.raw()) &&
             (!low.defined() || reinterpret_cast<std::uintptr_t>(low.raw()) % 8 == 0);
  for (const adamw_run& r : sorted) vec = vec && r.begin % 4 == 0;
  return vec;
}

/// The table of runs [first, last) of `sorted` with their weight decay.
adamw_run_table table_of(const std::vector<adamw_run>& sorted, std::size_t first, std::size_t last,
                         float weight_decay) {
  adamw_run_table t{};
  t.count = static_cast<int>(last - first);
  for (std::size_t i = first; i < last; ++i) {
    t.begin[i - first] = sorted[i].begin;
    t.end[i - first] = sorted[i].end;
    t.wd[i - first] = sorted[i].decay ? weight_decay : 0.0f;
  }
  return t;
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

namespace {

/// True when adamw_block_kernel can take these runs: 16-byte groups, and every launch after the
/// first (runs_per_launch runs each) begins on a block, so no block belongs to two launches.
bool by_blocks(const tensor& param, const tensor& grad, const tensor& m, const tensor& v,
               const tensor& low, const std::vector<adamw_run>& sorted) {
  bool ok = vectorised(param, grad, m, v, low, sorted);
  for (std::size_t first = runs_per_launch; first < sorted.size(); first += runs_per_launch)
    ok = ok && sorted[first].begin % hash_block_elems == 0;
  return ok;
}

/// adamw_block_kernel over the sorted runs, one launch per runs_per_launch of them (by_blocks
/// holds). Without Hash each launch visits the blocks its runs touch; with Hash the launches
/// together visit every block of param and write its digest into `digests`.
template <bool Hash>
void launch_by_blocks(cudaStream_t s, tensor& param, const tensor& grad, tensor& m, tensor& v,
                      tensor& low, const std::vector<adamw_run>& sorted, const adamw_params& p,
                      std::uint64_t* digests) {
  const std::int64_t n = param.numel();
  const std::int64_t nblocks = (n + hash_block_elems - 1) / hash_block_elems;
  const adamw_consts k = consts_of(p);
  const std::size_t launches =
      std::max<std::size_t>(1, (sorted.size() + runs_per_launch - 1) / runs_per_launch);
  for (std::size_t l = 0; l < launches; ++l) {
    const std::size_t first = l * runs_per_launch;
    const std::size_t last = std::min(sorted.size(), first + runs_per_launch);
    if (!Hash && first == last) continue;
    const adamw_run_table t = table_of(sorted, first, last, p.weight_decay);
    std::int64_t b0 = 0, b1 = nblocks;
    if (!Hash) {
      b0 = sorted[first].begin / hash_block_elems;
      b1 = (sorted[last - 1].end + hash_block_elems - 1) / hash_block_elems;
    } else {
      if (l > 0) b0 = sorted[first].begin / hash_block_elems;
      if (l + 1 < launches) b1 = sorted[last].begin / hash_block_elems;
    }
    if (b1 <= b0) continue;
    // Eight warps (blocks of 4096 bytes) per CUDA block, as many as keep the memory busy.
    const auto grid = static_cast<unsigned>(std::min<std::int64_t>((b1 - b0 + 7) / 8, 4096));
    auto run = [&](auto low_tag) {
      using L = decltype(low_tag);
      L* lp = low.defined() ? low.data<L>() : nullptr;
      adamw_block_kernel<L, Hash><<<grid, 256, 0, s>>>(param.data<float>(), grad.data<float>(),
                                                        m.data<float>(), v.data<float>(), lp, k, t,
                                                        n, b0, b1, digests);
    };
    if (low.defined() && low.type() == dtype::f16)
      run(f16{});
    else
      run(bf16{});
    TROUPE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void cuda_backend::adamw_runs(tensor& param, const tensor& grad, tensor& m, tensor& v,
                              const std::vector<adamw_run>& runs, const adamw_params& p,
                              tensor& low) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda adamw_runs";
  check_buffers(op, param, grad, m, v, p, low);
  const std::vector<adamw_run> sorted = sorted_runs(op, runs, param.numel());
  if (sorted.empty()) return;
  if (by_blocks(param, grad, m, v, low, sorted)) {
    launch_by_blocks<false>(s, param, grad, m, v, low, sorted, p, nullptr);
    return;
  }
  const adamw_consts k = consts_of(p);
  const bool vec = vectorised(param, grad, m, v, low, sorted);
  for (std::size_t first = 0; first < sorted.size(); first += runs_per_launch) {
    const std::size_t last = std::min(sorted.size(), first + runs_per_launch);
    const adamw_run_table t = table_of(sorted, first, last, p.weight_decay);
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

void cuda_backend::adamw_runs_hashed(tensor& param, const tensor& grad, tensor& m, tensor& v,
                                     const std::vector<adamw_run>& runs, const adamw_params& p,
                                     tensor& low, tensor& blocks) {
  activate();
  const char* op = "cuda adamw_runs_hashed";
  check_buffers(op, param, grad, m, v, p, low);
  require_type(blocks, dtype::i64, op, "blocks");
  require_numel(blocks, static_cast<std::int64_t>(message_hash_blocks_of(param.bytes())), op,
                "blocks (message_hash_blocks_of(param.bytes()))");
  require(!blocks.dev().is_cpu(), op, "blocks must be device memory");
  const std::vector<adamw_run> sorted = sorted_runs(op, runs, param.numel());
  if (param.numel() == 0) return;
  if (by_blocks(param, grad, m, v, low, sorted)) {
    launch_by_blocks<true>(ctx_->stream, param, grad, m, v, low, sorted, p,
                           blocks.data<std::uint64_t>());
    return;
  }
  adamw_runs(param, grad, m, v, runs, p, low);
  launch_message_hash_blocks(*ctx_, param.raw(), param.bytes(), blocks.data<std::uint64_t>());
}

}  // namespace troupe::kernels::cuda
