// LayerNorm over the last dimension: y = (x − mean)·rstd·w + b with fp32 statistics saved for the
// backward, and the backward dx += rstd·(w·dy − mean(w·dy) − x̂·mean(w·dy·x̂)), dw += Σ dy·x̂,
// db += Σ dy; the residual variant writes dx = residual + that gradient and may also sum the
// residual's columns (a bias gradient: GPT-2's projection outputs join the residual stream, see
// docs/model.md). One warp per row (rows are 768–1600 wide in GPT-2: a warp's lanes stride the
// row with 16-byte accesses and the row stays in L1 between the passes), so no block-level
// synchronisation is needed. Rows that fit in registers take the row-cached kernels (below), which
// read each row once and fuse the weight and bias gradients into the dx pass; wider rows take the
// plain kernels, whose weight and bias gradients are column sums done deterministically by
// column_sum.cuh.
// x, y, dy, dx share one dtype; w, b and their gradients may be any float dtype (fp32 gradients of
// bf16 weights).
#include "kernels/cuda/column_sum.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

template <class T, int V>
__global__ void layernorm_forward_kernel(const T* x, const void* w, int wc, const void* b, int bc,
                                         float eps, T* y, float* mean_out, float* rstd_out,
                                         std::int64_t rows, int C) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) +
                           threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + row * C;
  float s = 0.0f;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(xr + c);
#pragma unroll
    for (int k = 0; k < V; ++k) s += to_f(p.v[k]);
  }
  const float mean = warp_sum(s) / C;
  float ss = 0.0f;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(xr + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float d = to_f(p.v[k]) - mean;
      ss += d * d;
    }
  }
  const float rstd = 1.0f / sqrtf(warp_sum(ss) / C + eps);
  T* yr = y + row * C;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(xr + c);
    pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float bias = b ? load_f(b, bc, c + k) : 0.0f;
      o.v[k] = from_f<T>((to_f(p.v[k]) - mean) * rstd * load_f(w, wc, c + k) + bias);
    }
    *reinterpret_cast<pack<T, V>*>(yr + c) = o;
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

template <class T, int V>
__global__ void layernorm_backward_dx_kernel(const T* dy, const T* x, const void* w, int wc,
                                             const float* mean, const float* rstd, const T* base,
                                             T* dx, std::int64_t rows, int C) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) +
                           threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + row * C;
  const T* dyr = dy + row * C;
  const float mu = mean[row], rs = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(xr + c);
    pack<T, V> pd = *reinterpret_cast<const pack<T, V>*>(dyr + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float wdy = load_f(w, wc, c + k) * to_f(pd.v[k]);
      s1 += wdy;
      s2 += wdy * (to_f(px.v[k]) - mu) * rs;
    }
  }
  const float m1 = warp_sum(s1) / C, m2 = warp_sum(s2) / C;
  T* dxr = dx + row * C;
  const T* br = base + row * C;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(xr + c);
    pack<T, V> pd = *reinterpret_cast<const pack<T, V>*>(dyr + c);
    pack<T, V> po = *reinterpret_cast<const pack<T, V>*>(br + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float wdy = load_f(w, wc, c + k) * to_f(pd.v[k]);
      const float xhat = (to_f(px.v[k]) - mu) * rs;
      po.v[k] = from_f<T>(to_f(po.v[k]) + rs * (wdy - m1 - xhat * m2));
    }
    *reinterpret_cast<pack<T, V>*>(dxr + c) = po;
  }
}

// Row-cached kernels for rows of at most `ITERS` · 32 · V elements (up to 2048 in bf16, which
// covers GPT-2 124M's 768 and 1.5B's 1600; the backward takes fp32 rows up to 384):
// each lane keeps its columns of the row, and of w and b, in registers, so a row is read from
// memory once, and each warp does several rows (w and b are loaded once per warp). The backward
// also keeps each warp's dw and db partial sums across its rows (in shared memory); a block adds
// its warps' partials in warp order and writes one partial row per block, and a second kernel
// adds the blocks' rows in block order. The split of rows over warps depends only on the row
// count, so the sums are run-to-run identical without atomics.

/// Blocks of the row-cached kernels: enough rows per warp to amortise the w/b loads and the
/// backward's partial sums, few enough blocks to fill the GPU. Depends only on `rows`.
inline unsigned cached_grid(std::int64_t rows, std::int64_t rows_per_block) {
  return static_cast<unsigned>(
      std::clamp<std::int64_t>((rows + rows_per_block - 1) / rows_per_block, 1, 256));
}

// Both kernels load a warp's next row while they work on the current one (the loop's loads
// would otherwise wait on the row's reductions). On the H200, 16384 × 768 in bf16
// (bench/gpu_norm_bench): forward 19.1 → 17.4 µs, backward 52.7 → 37.5 µs with the backward at
// 8 rows per warp and the base of dx read with the row.
template <class T, int V, int ITERS>
__global__ void __launch_bounds__(256)
    layernorm_forward_cached_kernel(const T* x, const void* w, int wc, const void* b, int bc,
                                    float eps, T* y, float* mean_out, float* rstd_out,
                                    std::int64_t rows, int C) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  float wv[ITERS][V], bv[ITERS][V];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * 32 + lane) * V;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      wv[it][k] = c < C ? load_f(w, wc, c + k) : 0.0f;
      bv[it][k] = c < C && b ? load_f(b, bc, c + k) : 0.0f;
    }
  }
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * warps;
  auto load_row = [&](std::int64_t row, pack<T, V> (&px)[ITERS]) {
    const T* xr = x + row * C;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) px[it] = *reinterpret_cast<const pack<T, V>*>(xr + c);
    }
  };
  std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * warps + threadIdx.x / 32;
  pack<T, V> px[ITERS];
  if (row < rows) load_row(row, px);
  for (; row < rows; row += stride) {
    pack<T, V> nx[ITERS];
    if (row + stride < rows) load_row(row + stride, nx);
    float s = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) {
#pragma unroll
        for (int k = 0; k < V; ++k) s += to_f(px[it].v[k]);
      }
    }
    const float mean = warp_sum(s) / C;
    float ss = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = to_f(px[it].v[k]) - mean;
          ss += d * d;
        }
      }
    }
    const float rstd = 1.0f / sqrtf(warp_sum(ss) / C + eps);
    T* yr = y + row * C;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) {
        pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k)
          o.v[k] = from_f<T>((to_f(px[it].v[k]) - mean) * rstd * wv[it][k] + bv[it][k]);
        *reinterpret_cast<pack<T, V>*>(yr + c) = o;
      }
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) px[it] = nx[it];
  }
}

/// Makes the compiler treat p's words as new values: conversions of p done before this call cannot
/// be reused after it, so the 16-bit packs are held instead of their fp32 conversions (twice the
/// registers; the wide row-cached backward spilled with them).
template <class T, int V>
__device__ __forceinline__ void launder(pack<T, V>& p) {
  static_assert(sizeof(pack<T, V>) % 4 == 0, "packs are whole 32-bit words");
  auto* w = reinterpret_cast<unsigned*>(&p);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(pack<T, V>) / 4); ++i)
    asm volatile("" : "+r"(w[i]));
}

/// dx of every row, and per block the column sums [dw (C) | db (C)] of its rows (with RSUM, also
/// [... | rsum (C)], the residual's column sums) into partial[blockIdx.x · NS·C ...]. Each warp
/// adds its rows' terms into its own slice of shared memory (dynamic), in which each lane owns its
/// columns, so there are no atomics and no races; at the end the block adds the warps' slices in
/// warp order. A slice is stored lane-minor (element k of pack `it` of lane l at
/// (it·V + k)·32 + l), so the 32 lanes of a warp touch 32 consecutive floats (lane l's columns
/// side by side would be an 8-way bank conflict). Keeping these partial sums in registers
/// instead (2 · ITERS · V of them next to the row's x and dy), and w read through its dtype at
/// each use, needed 128 registers with spills at two blocks per SM: measured on the H200 at 52 µs
/// per call for 16384 × 768 in bf16 (38% of DRAM bandwidth, 725k local-memory requests).
/// Rows of up to 768 in bf16 (ITERS ≤ 3) take 8 warps per block, two blocks per SM, and each warp
/// loads its next row's x and dy while it works on the current one (PREFETCH). Wider rows (up to
/// 2048: GPT-2 1.5B's 1600) hold up to 8 packs of x, dy and the base per lane: a second row in
/// flight would spill, so they take 4 warps per block without prefetching, and the SM's other
/// blocks hide the loads.
template <class T, int V, int ITERS, int WARPS, bool PREFETCH, bool RSUM>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 8 ? 2 : 3)
    layernorm_backward_cached_kernel(const T* dy, const T* x, const void* w, int wc,
                                     const float* mean, const float* rstd, const T* base, T* dx,
                                     float* partial, std::int64_t rows, int C) {
  extern __shared__ float sums[];
  constexpr int NS = RSUM ? 3 : 2;  // slices per warp: dw, db (, rsum)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // This warp's slices, each lane-minor (see above): dw terms at [0, half), db terms after them,
  // then the residual's; after all warps' slices, w as fp32 in the same layout (read at every
  // use: no dtype branches and no registers held for it).
  constexpr int half = ITERS * V * 32;
  float* mine = sums + static_cast<std::int64_t>(warp) * NS * half;
  float* ws = sums + static_cast<std::int64_t>(WARPS) * NS * half;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const int l = i % 32, it = i / 32 / V, k = i / 32 % V, c = (it * 32 + l) * V + k;
    ws[i] = c < C ? load_f(w, wc, c) : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < ITERS * V; ++i)
#pragma unroll
    for (int sl = 0; sl < NS; ++sl) mine[sl * half + i * 32 + lane] = 0.0f;
  __syncthreads();
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * WARPS;
  auto load_row = [&](std::int64_t row, pack<T, V> (&px)[ITERS], pack<T, V> (&pd)[ITERS]) {
    const T* xr = x + row * C;
    const T* dyr = dy + row * C;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) {
        px[it] = *reinterpret_cast<const pack<T, V>*>(xr + c);
        pd[it] = *reinterpret_cast<const pack<T, V>*>(dyr + c);
      }
    }
  };
  std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * WARPS + warp;
  pack<T, V> px[ITERS], pd[ITERS];
  float mu = 0.0f, rs = 0.0f;
  if (PREFETCH && row < rows) {
    load_row(row, px, pd);
    mu = mean[row];
    rs = rstd[row];
  }
  for (; row < rows; row += stride) {
    // The next row's loads: a different row from the one whose dx this iteration writes, and
    // only this warp writes it, so dx may alias x, dy or the base.
    pack<T, V> nx[PREFETCH ? ITERS : 1], nd[PREFETCH ? ITERS : 1];
    float nmu = 0.0f, nrs = 0.0f;
    if constexpr (PREFETCH) {
      if (row + stride < rows) {
        load_row(row + stride, nx, nd);
        nmu = mean[row + stride];
        nrs = rstd[row + stride];
      }
    } else {
      load_row(row, px, pd);
      mu = mean[row];
      rs = rstd[row];
    }
    T* dxr = dx + row * C;
    const T* br = base + row * C;
    pack<T, V> pb[ITERS];
    auto load_base = [&] {
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c = (it * 32 + lane) * V;
        if (c < C) pb[it] = *reinterpret_cast<const pack<T, V>*>(br + c);
      }
    };
    // With the next row in flight, the base is read with the row; without, after the row's
    // reductions, so that x, dy and the base are not all held at once (the wide rows would spill).
    if constexpr (PREFETCH) load_base();
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float wdy = ws[(it * V + k) * 32 + lane] * to_f(pd[it].v[k]);
          s1 += wdy;
          s2 += wdy * ((to_f(px[it].v[k]) - mu) * rs);
        }
      }
    }
    const float m1 = warp_sum(s1) / C, m2 = warp_sum(s2) / C;
    if constexpr (!PREFETCH) {
      load_base();
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        launder(px[it]);
        launder(pd[it]);
      }
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) {
        pack<T, V> po = pb[it];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = to_f(pd[it].v[k]);
          const float xhat = (to_f(px[it].v[k]) - mu) * rs;
          const float r = to_f(po.v[k]);
          po.v[k] = from_f<T>(r + rs * (ws[(it * V + k) * 32 + lane] * d - m1 - xhat * m2));
          mine[(it * V + k) * 32 + lane] += d * xhat;
          mine[half + (it * V + k) * 32 + lane] += d;
          if constexpr (RSUM) mine[2 * half + (it * V + k) * 32 + lane] += r;
        }
        *reinterpret_cast<pack<T, V>*>(dxr + c) = po;
      }
    }
    if constexpr (PREFETCH) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        px[it] = nx[it];
        pd[it] = nd[it];
      }
      mu = nmu;
      rs = nrs;
    }
  }
  __syncthreads();
  // The block's warps' slices, added in warp order, written column by column ([dw | db | rsum]).
  float* out = partial + static_cast<std::int64_t>(blockIdx.x) * NS * C;
  for (int i = threadIdx.x; i < NS * C; i += blockDim.x) {
    const int sl = i / C, c = i - sl * C, pk = c / V;  // pack pk = it·32 + l holds column c
    const int at = sl * half + ((pk / 32) * V + c % V) * 32 + pk % 32;
    float total = sums[at];
    for (int wi = 1; wi < WARPS; ++wi)
      total += sums[static_cast<std::int64_t>(wi) * NS * half + at];
    out[i] = total;
  }
}

/// Where layernorm_param_finish_kernel adds each part of a partial row: dw, db and the residual's
/// column sums (a null pointer skips that part).
struct layernorm_param_outs {
  void* out[3] = {nullptr, nullptr, nullptr};
  int code[3] = {0, 0, 0};
};

/// out.out[p][c] += Σ_blocks partial[block][p·C + c] for the `parts` parts of each partial row,
/// in the fixed order of column_total.
__global__ void layernorm_param_finish_kernel(const float* partial, int blocks, int C, int parts,
                                              layernorm_param_outs o) {
  const int i = blockIdx.x * finish_cols + threadIdx.x;
  const float s = column_total(partial, blocks, parts * C, i);
  if (threadIdx.y != 0 || i >= parts * C) return;
  const int p = i / C, c = i - p * C;
  void* out = o.out[p];
  if (!out) return;
  store_f(out, o.code[p], c, load_f(out, o.code[p], c) + s);
}

/// dw and db terms of one (row, column), and with acc[2] (column_sums<3>) the residual's.
template <class T>
struct layernorm_param_terms {
  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  const T* residual;
  int C;
  template <int N>
  __device__ void operator()(std::int64_t r, int c, float (&acc)[N]) const {
    const float d = to_f(dy[r * C + c]);
    acc[0] += d * (to_f(x[r * C + c]) - mean[r]) * rstd[r];
    acc[1] += d;
    if constexpr (N > 2) acc[2] += to_f(residual[r * C + c]);
  }
};

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {
constexpr int rows_per_block = 8;  // 8 warps of 32 lanes, one row each

/// Calls f(std::integral_constant<int, I>) with the smallest I of `Is` (ascending) such that
/// rows of C elements fit in I · 32 · V; returns false (f not called) when none does, or when rows
/// do not move in 16-byte packs (V = 1: odd widths, not worth the instantiations).
template <int V, int... Is, class F>
bool with_row_iters(int C, F&& f) {
  if constexpr (V == 1) {
    (void)C;
    (void)f;
    return false;
  } else {
    const int need = (C + 32 * V - 1) / (32 * V);
    bool done = false;
    ((done = done || (need <= Is && (f(std::integral_constant<int, Is>{}), true))), ...);
    return done;
  }
}

}  // namespace

void cuda_backend::layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps,
                                     tensor& y, tensor& mean, tensor& rstd) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda layernorm_forward";
  require_float(x, op, "x");
  require(x.rank() >= 1, op, "x must have a channel dimension");
  const int C = static_cast<int>(x.dim(-1));
  const std::int64_t rows = C ? x.numel() / C : 0;
  require_float(w, op, "w");
  require_numel(w, C, op, "w");
  if (b.defined()) {
    require_float(b, op, "b");
    require_numel(b, C, op, "b");
  }
  require_type(y, x.type(), op, "y");
  require_numel(y, x.numel(), op, "y");
  require_type(mean, dtype::f32, op, "mean");
  require_type(rstd, dtype::f32, op, "rstd");
  require_numel(mean, rows, op, "mean");
  require_numel(rstd, rows, op, "rstd");
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    with_row_vector<T>({&x, &y}, C, [&](auto v) {
      constexpr int V = decltype(v)::value;
      const bool cached = with_row_iters<V, 1, 2, 3, 4, 6, 8>(C, [&](auto iters) {
        layernorm_forward_cached_kernel<T, V, decltype(iters)::value>
            <<<cached_grid(rows, 8 * rows_per_block), rows_per_block * 32, 0, s>>>(
                x.data<T>(), w.raw(), code_of(w.type()), b.defined() ? b.raw() : nullptr,
                b.defined() ? code_of(b.type()) : 0, eps, y.data<T>(), mean.data<float>(),
                rstd.data<float>(), rows, C);
      });
      if (cached) return;
      layernorm_forward_kernel<T, V><<<grid, rows_per_block * 32, 0, s>>>(
          x.data<T>(), w.raw(), code_of(w.type()), b.defined() ? b.raw() : nullptr,
          b.defined() ? code_of(b.type()) : 0, eps, y.data<T>(), mean.data<float>(),
          rstd.data<float>(), rows, C);
    });
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

namespace {

/// dx += LayerNorm's input gradient, or, with a residual, dx = *residual + that gradient (written).
/// With `rsum`, also rsum += Σ_rows *residual (fused into the row-cached kernels; a separate
/// column-sum pass otherwise). Returns after queueing everything.
void layernorm_backward_on(context& ctx, const tensor& dy, const tensor& x, const tensor& w,
                           const tensor& mean, const tensor& rstd, tensor& dx, tensor& dw,
                           tensor& db, const tensor* residual, tensor* rsum) {
  const char* op = residual ? "cuda layernorm_backward_residual" : "cuda layernorm_backward";
  require_float(x, op, "x");
  require(x.rank() >= 1, op, "x must have a channel dimension");
  const int C = static_cast<int>(x.dim(-1));
  const std::int64_t rows = C ? x.numel() / C : 0;
  require_type(dy, x.type(), op, "dy");
  require_type(dx, x.type(), op, "dx");
  require_numel(dy, x.numel(), op, "dy");
  require_numel(dx, x.numel(), op, "dx");
  if (residual) {
    require_type(*residual, x.type(), op, "residual");
    require_numel(*residual, x.numel(), op, "residual");
  }
  if (rsum) {
    require(residual != nullptr, op, "rsum needs a residual");
    require_float(*rsum, op, "rsum");
    require_numel(*rsum, C, op, "rsum");
  }
  require_float(w, op, "w");
  require_numel(w, C, op, "w");
  require_float(dw, op, "dw");
  require_numel(dw, C, op, "dw");
  if (db.defined()) {
    require_float(db, op, "db");
    require_numel(db, C, op, "db");
  }
  require_type(mean, dtype::f32, op, "mean");
  require_type(rstd, dtype::f32, op, "rstd");
  require_numel(mean, rows, op, "mean");
  require_numel(rstd, rows, op, "rstd");
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
  layernorm_param_outs outs;
  outs.out[0] = dw.raw();
  outs.code[0] = code_of(dw.type());
  if (db.defined()) {
    outs.out[1] = db.raw();
    outs.code[1] = code_of(db.type());
  }
  if (rsum) {
    outs.out[2] = rsum->raw();
    outs.code[2] = code_of(rsum->type());
  }
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    const T* base = residual ? residual->data<T>() : dx.data<T>();
    const tensor& base_t = residual ? *residual : dx;
    bool cached = false;
    with_row_vector<T>({&x, &dy, &dx, &base_t}, C, [&](auto v) {
      constexpr int V = decltype(v)::value;
      // Rows of at most 3 packs per lane (768 in bf16) take 8 warps per block with prefetching;
      // 16-bit rows of up to 8 packs (2048) take 4 warps without (see the kernel). Wider rows,
      // and fp32 ones past 3 packs, take the plain kernels.
      auto launch = [&](auto iters, auto warps_c, auto rpw_c) {
        constexpr int ITERS = decltype(iters)::value, WARPS = decltype(warps_c)::value;
        constexpr int RPW = decltype(rpw_c)::value;
        // RPW rows per warp (8 at 768: 16384 rows are 256 blocks, one wave at two blocks per
        // SM on an H200; 2 rows per warp measured 52.7 µs, 8 rows 37.5); the cut depends only
        // on the row count (fixed sums, see above).
        const unsigned blocks = static_cast<unsigned>(std::clamp<std::int64_t>(
            (rows + RPW * WARPS - 1) / (RPW * WARPS), 1, 1024));
        const int parts = rsum ? 3 : 2;
        scratch partial(ctx, sizeof(float) * parts * static_cast<std::size_t>(C) * blocks);
        // parts · ITERS · V · 32 floats per warp, and w: 51 KB at ITERS 3, V 8, 8 warps and
        // two parts; 104 KB at ITERS 8, 4 warps and three parts; over the 48 KB a kernel gets
        // without asking.
        const std::size_t smem = sizeof(float) * (parts * WARPS + 1) * ITERS * V * 32;
        auto run = [&](auto kernel) {
          // Per launch, not once: the attribute belongs to the current device's context.
          TROUPE_CUDA_CHECK(cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
          kernel<<<blocks, WARPS * 32, smem, ctx.stream>>>(
              dy.data<T>(), x.data<T>(), w.raw(), code_of(w.type()), mean.data<float>(),
              rstd.data<float>(), base, dx.data<T>(), partial.as<float>(), rows, C);
          TROUPE_CUDA_CHECK_LAUNCH();
        };
        constexpr bool prefetch = WARPS == 8;
        if (rsum)
          run(layernorm_backward_cached_kernel<T, V, ITERS, WARPS, prefetch, true>);
        else
          run(layernorm_backward_cached_kernel<T, V, ITERS, WARPS, prefetch, false>);
        layernorm_param_finish_kernel<<<finish_grid(parts * C), finish_block(), 0,
                                        ctx.stream>>>(partial.as<float>(),
                                                      static_cast<int>(blocks), C, parts, outs);
        TROUPE_CUDA_CHECK_LAUNCH();
      };
      using eight = std::integral_constant<int, 8>;
      using four = std::integral_constant<int, 4>;
      cached = with_row_iters<V, 1, 2, 3>(C, [&](auto iters) {
        launch(iters, eight{}, eight{});
      });
      if constexpr (sizeof(T) == 2) {
        if (!cached)
          cached = with_row_iters<V, 4, 6, 7, 8>(C, [&](auto iters) {
            launch(iters, four{}, four{});  // 7: GPT-2 1.5B's 1600 in bf16, where 8 spilled
          });
      }
    });
    if (cached) return;
    with_row_vector<T>({&x, &dy, &dx, &base_t}, C, [&](auto v) {
      layernorm_backward_dx_kernel<T, decltype(v)::value>
          <<<grid, rows_per_block * 32, 0, ctx.stream>>>(dy.data<T>(), x.data<T>(), w.raw(),
                                                         code_of(w.type()), mean.data<float>(),
                                                         rstd.data<float>(), base, dx.data<T>(),
                                                         rows, C);
    });
    TROUPE_CUDA_CHECK_LAUNCH();
    layernorm_param_terms<T> f{dy.data<T>(), x.data<T>(), mean.data<float>(), rstd.data<float>(),
                               residual ? residual->data<T>() : nullptr, C};
    if (rsum) {
      void* const three[3] = {outs.out[0], outs.out[1], outs.out[2]};
      const int codes[3] = {outs.code[0], outs.code[1], outs.code[2]};
      column_sums<3>(ctx, f, rows, C, three, codes);
    } else {
      void* const two[2] = {outs.out[0], outs.out[1]};
      const int codes[2] = {outs.code[0], outs.code[1]};
      column_sums<2>(ctx, f, rows, C, two, codes);
    }
  });
}

}  // namespace

void cuda_backend::layernorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                      const tensor& mean, const tensor& rstd, tensor& dx,
                                      tensor& dw, tensor& db) {
  activate();
  layernorm_backward_on(*ctx_, dy, x, w, mean, rstd, dx, dw, db, nullptr, nullptr);
}

void cuda_backend::layernorm_backward_residual(const tensor& dy, const tensor& x,
                                               const tensor& w, const tensor& mean,
                                               const tensor& rstd, const tensor& residual,
                                               tensor& dx, tensor& dw, tensor& db,
                                               tensor& rsum) {
  activate();
  // The plain kernels sum rsum from the residual after dx is written.
  require(!rsum.defined() || residual.raw() != dx.raw() || residual.numel() == 0,
          "cuda layernorm_backward_residual", "dx must not alias the residual");
  layernorm_backward_on(*ctx_, dy, x, w, mean, rstd, dx, dw, db, &residual,
                        rsum.defined() ? &rsum : nullptr);
}

}  // namespace troupe::kernels::cuda
