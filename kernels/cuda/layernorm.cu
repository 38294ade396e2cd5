// LayerNorm over the last dimension: y = (x − mean)·rstd·w + b with fp32 statistics saved for the
// backward, and the backward dx += rstd·(w·dy − mean(w·dy) − x̂·mean(w·dy·x̂)), dw += Σ dy·x̂,
// db += Σ dy. One warp per row (rows are 768–1600 wide in GPT-2: a warp's lanes stride the row with
// 16-byte accesses and the row stays in L1 between the passes), so no block-level synchronisation is
// needed. The weight and bias gradients are column sums done deterministically by column_sum.cuh.
// x, y, dy, dx share one dtype; w, b and their gradients may be any float dtype (fp32 gradients of
// bf16 weights).
#include "kernels/cuda/column_sum.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

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
                                             const float* mean, const float* rstd, T* dx,
                                             std::int64_t rows, int C) {
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
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(xr + c);
    pack<T, V> pd = *reinterpret_cast<const pack<T, V>*>(dyr + c);
    pack<T, V> po = *reinterpret_cast<const pack<T, V>*>(dxr + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float wdy = load_f(w, wc, c + k) * to_f(pd.v[k]);
      const float xhat = (to_f(px.v[k]) - mu) * rs;
      po.v[k] = from_f<T>(to_f(po.v[k]) + rs * (wdy - m1 - xhat * m2));
    }
    *reinterpret_cast<pack<T, V>*>(dxr + c) = po;
  }
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
// launchers

namespace {
constexpr int rows_per_block = 8;  // 8 warps of 32 lanes, one row each

}  // namespace

void launch_layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps,
                              tensor& y, tensor& mean, tensor& rstd, cudaStream_t s) {
  const char* op = "layernorm_forward";
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
      layernorm_forward_kernel<T, decltype(v)::value><<<grid, rows_per_block * 32, 0, s>>>(
          x.data<T>(), w.raw(), code_of(w.type()), b.defined() ? b.raw() : nullptr,
          b.defined() ? code_of(b.type()) : 0, eps, y.data<T>(), mean.data<float>(),
          rstd.data<float>(), rows, C);
    });
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

void launch_layernorm_backward(context& ctx, const tensor& dy, const tensor& x, const tensor& w,
                               const tensor& mean, const tensor& rstd, tensor& dx, tensor& dw,
                               tensor& db) {
  const char* op = "layernorm_backward";
  require_float(x, op, "x");
  require(x.rank() >= 1, op, "x must have a channel dimension");
  const int C = static_cast<int>(x.dim(-1));
  const std::int64_t rows = C ? x.numel() / C : 0;
  require_type(dy, x.type(), op, "dy");
  require_type(dx, x.type(), op, "dx");
  require_numel(dy, x.numel(), op, "dy");
  require_numel(dx, x.numel(), op, "dx");
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
    with_row_vector<T>({&x, &dy, &dx}, C, [&](auto v) {
      layernorm_backward_dx_kernel<T, decltype(v)::value>
          <<<grid, rows_per_block * 32, 0, ctx.stream>>>(dy.data<T>(), x.data<T>(), w.raw(),
                                                         code_of(w.type()), mean.data<float>(),
                                                         rstd.data<float>(), dx.data<T>(), rows, C);
    });
    TROUPE_CUDA_CHECK_LAUNCH();
    layernorm_param_terms<T> f{dy.data<T>(), x.data<T>(), mean.data<float>(), rstd.data<float>(),
                               C};
    void* const outs[2] = {dw.raw(), db.defined() ? db.raw() : nullptr};
    const int codes[2] = {code_of(dw.type()), db.defined() ? code_of(db.type()) : 0};
    column_sums<2>(ctx, f, rows, C, outs, codes);
  });
}

}  // namespace troupe::kernels::cuda
