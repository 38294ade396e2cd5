// LayerNorm over the last dimension: y = (x − mean)·rstd·w + b with fp32 statistics saved for the
// backward, and the backward dx += rstd·(w·dy − mean(w·dy) − x̂·mean(w·dy·x̂)), dw += Σ dy·x̂,
// db += Σ dy. One warp per row (rows are 768–1600 wide in GPT-2: a warp's lanes stride the row with
// 16-byte accesses and the row stays in L1 between the passes), so no block-level synchronisation is
// needed. Rows that fit in registers take the row-cached kernels (below), which read each row once
// and fuse the weight and bias gradients into the dx pass; wider rows take the plain kernels, whose
// weight and bias gradients are column sums done deterministically by column_sum.cuh.
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

// Row-cached kernels for rows of at most `ITERS` · 32 · V elements (forward: up to 2048 in bf16;
// backward, which holds more per row: up to 768 in bf16, GPT-2 124M):
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

/// dx of every row, and per block the column sums [dw (C) | db (C)] of its rows into
/// partial[blockIdx.x · 2C ...]. Each warp adds its rows' dw and db terms into its own slice of
/// shared memory (dynamic), in which each lane owns its columns, so there are no atomics and no
/// races; at the end the block adds the warps' slices in warp order. A slice is stored lane-minor
/// (element k of pack `it` of lane l at (it·V + k)·32 + l), so the 32 lanes of a warp touch 32
/// consecutive floats (lane l's columns side by side would be an 8-way bank conflict). Keeping
/// these partial sums in registers instead (2 · ITERS · V of them next to the row's x and dy), and
/// w read through its dtype at each use, needed 128 registers with spills at two blocks per SM:
/// measured on the H200 at 52 µs per call for 16384 × 768 in bf16 (38% of DRAM bandwidth, 725k
/// local-memory requests). Each warp holds its current row (x, dy and the base of dx) and loads
/// its next row's x and dy meanwhile, at two blocks per SM.
template <class T, int V, int ITERS>
__global__ void __launch_bounds__(256, 2)
    layernorm_backward_cached_kernel(const T* dy, const T* x, const void* w, int wc,
                                     const float* mean, const float* rstd, const T* base, T* dx,
                                     float* partial, std::int64_t rows, int C) {
  extern __shared__ float sums[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  // This warp's slice: dw terms at [0, ITERS·V·32), db terms after them (lane-minor, see above);
  // after all slices, w as fp32 in the same layout (read at every use: no dtype branches and no
  // registers held for it).
  constexpr int half = ITERS * V * 32;
  float* mine = sums + static_cast<std::int64_t>(warp) * 2 * half;
  float* ws = sums + static_cast<std::int64_t>(warps) * 2 * half;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const int l = i % 32, it = i / 32 / V, k = i / 32 % V, c = (it * 32 + l) * V + k;
    ws[i] = c < C ? load_f(w, wc, c) : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < ITERS * V; ++i) mine[i * 32 + lane] = mine[half + i * 32 + lane] = 0.0f;
  __syncthreads();
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * warps;
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
  std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * warps + warp;
  pack<T, V> px[ITERS], pd[ITERS];
  float mu = 0.0f, rs = 0.0f;
  if (row < rows) {
    load_row(row, px, pd);
    mu = mean[row];
    rs = rstd[row];
  }
  for (; row < rows; row += stride) {
    // The next row's loads: a different row from the one whose dx this iteration writes, and
    // only this warp writes it, so dx may alias x, dy or the base.
    pack<T, V> nx[ITERS], nd[ITERS];
    float nmu = 0.0f, nrs = 0.0f;
    if (row + stride < rows) {
      load_row(row + stride, nx, nd);
      nmu = mean[row + stride];
      nrs = rstd[row + stride];
    }
    T* dxr = dx + row * C;
    const T* br = base + row * C;
    pack<T, V> pb[ITERS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) pb[it] = *reinterpret_cast<const pack<T, V>*>(br + c);
    }
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
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * 32 + lane) * V;
      if (c < C) {
        pack<T, V> po = pb[it];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = to_f(pd[it].v[k]);
          const float xhat = (to_f(px[it].v[k]) - mu) * rs;
          po.v[k] = from_f<T>(to_f(po.v[k]) +
                              rs * (ws[(it * V + k) * 32 + lane] * d - m1 - xhat * m2));
          mine[(it * V + k) * 32 + lane] += d * xhat;
          mine[half + (it * V + k) * 32 + lane] += d;
        }
        *reinterpret_cast<pack<T, V>*>(dxr + c) = po;
      }
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      px[it] = nx[it];
      pd[it] = nd[it];
    }
    mu = nmu;
    rs = nrs;
  }
  __syncthreads();
  // The block's warps' slices, added in warp order, written column by column ([dw | db]).
  float* out = partial + static_cast<std::int64_t>(blockIdx.x) * 2 * C;
  for (int i = threadIdx.x; i < 2 * C; i += blockDim.x) {
    const int c = i < C ? i : i - C, pk = c / V;  // pack pk = it·32 + l holds column c
    const int at = (i < C ? 0 : half) + ((pk / 32) * V + c % V) * 32 + pk % 32;
    float total = sums[at];
    for (int wi = 1; wi < warps; ++wi) total += sums[static_cast<std::int64_t>(wi) * 2 * half + at];
    out[i] = total;
  }
}

/// dw[c] += Σ_blocks partial[block][c], db[c] += Σ_blocks partial[block][C + c], in the fixed
/// order of column_total.
__global__ void layernorm_param_finish_kernel(const float* partial, int blocks, int C, void* dw,
                                              int dwc, void* db, int dbc) {
  const int i = blockIdx.x * finish_cols + threadIdx.x;
  const float s = column_total(partial, blocks, 2 * C, i);
  if (threadIdx.y != 0 || i >= 2 * C) return;
  void* out = i < C ? dw : db;
  if (!out) return;
  const int c = i < C ? i : i - C, code = i < C ? dwc : dbc;
  store_f(out, code, c, load_f(out, code, c) + s);
}

/// dw and db terms of one (row, column).
template <class T>
struct layernorm_param_terms {
  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  int C;
  __device__ void operator()(std::int64_t r, int c, float (&acc)[2]) const {
    const float d = to_f(dy[r * C + c]);
    acc[0] += d * (to_f(x[r * C + c]) - mean[r]) * rstd[r];
    acc[1] += d;
  }
};

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {
constexpr int rows_per_block = 8;  // 8 warps of 32 lanes, one row each

/// Calls f(std::integral_constant<int, I>) with the smallest I of {1, 2, 3, 4, 6, 8} up to
/// MAX_ITERS such that rows of C elements fit in I · 32 · V; returns false (f not called) when
/// none does, or when rows do not move in 16-byte packs (V = 1: odd widths, not worth the
/// instantiations).
template <int V, int MAX_ITERS, class F>
bool with_row_iters(int C, F&& f) {
  if constexpr (V == 1) {
    (void)C;
    (void)f;
    return false;
  } else {
    const int need = (C + 32 * V - 1) / (32 * V);
    if (need <= 1) return f(std::integral_constant<int, 1>{}), true;
    if (need <= 2) return f(std::integral_constant<int, 2>{}), true;
    if (need <= 3) return f(std::integral_constant<int, 3>{}), true;
    if constexpr (MAX_ITERS >= 8) {
      if (need <= 4) return f(std::integral_constant<int, 4>{}), true;
      if (need <= 6) return f(std::integral_constant<int, 6>{}), true;
      if (need <= 8) return f(std::integral_constant<int, 8>{}), true;
    }
    return false;
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
      const bool cached = with_row_iters<V, 8>(C, [&](auto iters) {
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
void layernorm_backward_on(context& ctx, const tensor& dy, const tensor& x, const tensor& w,
                           const tensor& mean, const tensor& rstd, tensor& dx, tensor& dw,
                           tensor& db, const tensor* residual) {
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
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    const T* base = residual ? residual->data<T>() : dx.data<T>();
    const tensor& base_t = residual ? *residual : dx;
    bool cached = false;
    with_row_vector<T>({&x, &dy, &dx, &base_t}, C, [&](auto v) {
      constexpr int V = decltype(v)::value;
      // At most 3 packs per lane (768 in bf16): the shared partial sums of 8 warps stay within
      // 51 KB; wider rows take the plain kernels.
      cached = with_row_iters<V, 3>(C, [&](auto iters) {
        // 8 rows per warp (16384 rows are 256 blocks, one wave at two blocks per SM on an H200:
        // 2 rows per warp measured 52.7 µs, 8 rows 37.5); the cut depends only on the row count
        // (fixed sums, see above).
        const unsigned blocks = static_cast<unsigned>(std::clamp<std::int64_t>(
            (rows + 8 * rows_per_block - 1) / (8 * rows_per_block), 1, 1024));
        scratch partial(ctx, sizeof(float) * 2 * static_cast<std::size_t>(C) * blocks);
        // 2 · ITERS · V · 32 floats per warp, 8 warps, and w: up to 51 KB (ITERS 3, V 8), over
        // the 48 KB a kernel gets without asking.
        constexpr int ITERS = decltype(iters)::value;
        const std::size_t smem = sizeof(float) * (2 * rows_per_block + 1) * ITERS * V * 32;
        auto kernel = layernorm_backward_cached_kernel<T, V, ITERS>;
        // Per launch, not once: the attribute belongs to the current device's context.
        TROUPE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)));
        kernel<<<blocks, rows_per_block * 32, smem, ctx.stream>>>(
                dy.data<T>(), x.data<T>(), w.raw(), code_of(w.type()), mean.data<float>(),
                rstd.data<float>(), base, dx.data<T>(), partial.as<float>(), rows, C);
        TROUPE_CUDA_CHECK_LAUNCH();
        layernorm_param_finish_kernel<<<finish_grid(2 * C), finish_block(), 0, ctx.stream>>>(
            partial.as<float>(), static_cast<int>(blocks), C, dw.raw(), code_of(dw.type()),
            db.defined() ? db.raw() : nullptr, db.defined() ? code_of(db.type()) : 0);
        TROUPE_CUDA_CHECK_LAUNCH();
      });
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
                               C};
    void* const outs[2] = {dw.raw(), db.defined() ? db.raw() : nullptr};
    const int codes[2] = {code_of(dw.type()), db.defined() ? code_of(db.type()) : 0};
    column_sums<2>(ctx, f, rows, C, outs, codes);
  });
}

}  // namespace

void cuda_backend::layernorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                      const tensor& mean, const tensor& rstd, tensor& dx,
                                      tensor& dw, tensor& db) {
  activate();
  layernorm_backward_on(*ctx_, dy, x, w, mean, rstd, dx, dw, db, nullptr);
}

void cuda_backend::layernorm_backward_residual(const tensor& dy, const tensor& x,
                                               const tensor& w, const tensor& mean,
                                               const tensor& rstd, const tensor& residual,
                                               tensor& dx, tensor& dw, tensor& db,
                                               tensor& rsum) {
  activate();
  // rsum is summed from the residual after dx is written.
  require(!rsum.defined() || residual.raw() != dx.raw() || residual.numel() == 0,
          "cuda layernorm_backward_residual", "dx must not alias the residual");
  layernorm_backward_on(*ctx_, dy, x, w, mean, rstd, dx, dw, db, &residual);
  if (rsum.defined()) sum_rows(residual, rsum);
}

}  // namespace troupe::kernels::cuda
