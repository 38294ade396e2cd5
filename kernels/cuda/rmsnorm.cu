// RMSNorm (LLaMA): y = x·rstd·w with rstd = 1/√(mean(x²) + eps) saved in fp32, and the backward
// dx += rstd·(w·dy − x̂·mean(w·dy·x̂)) with x̂ = x·rstd, dw += Σ dy·x̂; with a residual, dx =
// residual + the same term, read from the residual's buffer (no copy into dx first). Same shape as
// layernorm.cu: one warp per row with 16-byte accesses, and the weight gradient as a deterministic
// column sum (16-byte loads when dy and x allow them).
#include "kernels/cuda/column_sum.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

template <class T, int V>
__global__ void rmsnorm_forward_kernel(const T* x, const void* w, int wc, float eps, T* y,
                                       float* rstd_out, std::int64_t rows, int C) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) +
                           threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + row * C;
  float ss = 0.0f;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(xr + c);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += to_f(p.v[k]) * to_f(p.v[k]);
  }
  const float rstd = 1.0f / sqrtf(warp_sum(ss) / C + eps);
  T* yr = y + row * C;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> p = *reinterpret_cast<const pack<T, V>*>(xr + c);
    pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = from_f<T>(to_f(p.v[k]) * rstd * load_f(w, wc, c + k));
    *reinterpret_cast<pack<T, V>*>(yr + c) = o;
  }
  if (lane == 0) rstd_out[row] = rstd;
}

/// dx = base + the input gradient, base = dx (accumulate) or the residual.
template <class T, int V>
__global__ void rmsnorm_backward_dx_kernel(const T* dy, const T* x, const void* w, int wc,
                                           const float* rstd, const T* base, T* dx,
                                           std::int64_t rows, int C) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) +
                           threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + row * C;
  const T* dyr = dy + row * C;
  const float rs = rstd[row];
  float s = 0.0f;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(xr + c);
    pack<T, V> pd = *reinterpret_cast<const pack<T, V>*>(dyr + c);
#pragma unroll
    for (int k = 0; k < V; ++k) s += load_f(w, wc, c + k) * to_f(pd.v[k]) * to_f(px.v[k]) * rs;
  }
  const float m = warp_sum(s) / C;
  T* dxr = dx + row * C;
  const T* br = base + row * C;
  for (int c = lane * V; c < C; c += 32 * V) {
    pack<T, V> px = *reinterpret_cast<const pack<T, V>*>(xr + c);
    pack<T, V> pd = *reinterpret_cast<const pack<T, V>*>(dyr + c);
    pack<T, V> po = *reinterpret_cast<const pack<T, V>*>(br + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float wdy = load_f(w, wc, c + k) * to_f(pd.v[k]);
      po.v[k] = from_f<T>(to_f(po.v[k]) + rs * (wdy - to_f(px.v[k]) * rs * m));
    }
    *reinterpret_cast<pack<T, V>*>(dxr + c) = po;
  }
}

template <class T>
struct rmsnorm_weight_terms {
  const T* dy;
  const T* x;
  const float* rstd;
  int C;
  __device__ void operator()(std::int64_t r, int c, float (&acc)[1]) const {
    acc[0] += to_f(dy[r * C + c]) * to_f(x[r * C + c]) * rstd[r];
  }
};

/// rmsnorm_weight_terms for V adjacent columns, dy and x loaded 16 bytes at a time
/// (column_partial_vec_kernel): the same additions, the same fp32 expression.
template <class T, int V>
struct rmsnorm_weight_vec_terms {
  static constexpr int rows_in_flight = 2;
  struct slot {
    pack<T, V> dy, x;
    float rstd;
  };
  const T* dy;
  const T* x;
  const float* rstd;
  int C;
  __device__ void load(std::int64_t r, int c, slot& s) const {
    s.dy = *reinterpret_cast<const pack<T, V>*>(dy + r * C + c);
    s.x = *reinterpret_cast<const pack<T, V>*>(x + r * C + c);
    s.rstd = rstd[r];
  }
  __device__ void add(const slot& s, float (&acc)[V]) const {
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] += to_f(s.dy.v[k]) * to_f(s.x.v[k]) * s.rstd;
  }
};

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {
constexpr int rows_per_block = 8;

}  // namespace

void cuda_backend::rmsnorm_forward(const tensor& x, const tensor& w, float eps, tensor& y,
                                   tensor& rstd) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda rmsnorm_forward";
  require_float(x, op, "x");
  require(x.rank() >= 1, op, "x must have a channel dimension");
  const int C = static_cast<int>(x.dim(-1));
  const std::int64_t rows = C ? x.numel() / C : 0;
  require_float(w, op, "w");
  require_numel(w, C, op, "w");
  require_type(y, x.type(), op, "y");
  require_numel(y, x.numel(), op, "y");
  require_type(rstd, dtype::f32, op, "rstd");
  require_numel(rstd, rows, op, "rstd");
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    with_row_vector<T>({&x, &y}, C, [&](auto v) {
      rmsnorm_forward_kernel<T, decltype(v)::value><<<grid, rows_per_block * 32, 0, s>>>(
          x.data<T>(), w.raw(), code_of(w.type()), eps, y.data<T>(), rstd.data<float>(), rows, C);
    });
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                    const tensor& rstd, tensor& dx, tensor& dw) {
  rmsnorm_backward_impl(dy, x, w, rstd, nullptr, dx, dw);
}

void cuda_backend::rmsnorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                             const tensor& rstd, const tensor& residual,
                                             tensor& dx, tensor& dw) {
  rmsnorm_backward_impl(dy, x, w, rstd, &residual, dx, dw);
}

void cuda_backend::rmsnorm_backward_impl(const tensor& dy, const tensor& x, const tensor& w,
                                         const tensor& rstd, const tensor* residual, tensor& dx,
                                         tensor& dw) {
  activate();
  context& ctx = *ctx_;
  const char* op = residual ? "cuda rmsnorm_backward_residual" : "cuda rmsnorm_backward";
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
  require_type(rstd, dtype::f32, op, "rstd");
  require_numel(rstd, rows, op, "rstd");
  if (residual) {
    require_type(*residual, x.type(), op, "residual");
    require_numel(*residual, x.numel(), op, "residual");
    require(residual->raw() != dx.raw(), op, "dx must not alias the residual");
  }
  if (rows == 0) return;
  const tensor& base = residual ? *residual : dx;
  const unsigned grid = static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
  dispatch_float(x.type(), op, [&](auto tag) {
    using T = decltype(tag);
    with_row_vector<T>({&x, &dy, &dx, &base}, C, [&](auto v) {
      rmsnorm_backward_dx_kernel<T, decltype(v)::value>
          <<<grid, rows_per_block * 32, 0, ctx.stream>>>(
              dy.data<T>(), x.data<T>(), w.raw(), code_of(w.type()), rstd.data<float>(),
              base.data<T>(), dx.data<T>(), rows, C);
    });
    TROUPE_CUDA_CHECK_LAUNCH();
    bool done = false;
    with_row_vector<T>({&x, &dy}, C, [&](auto v) {
      constexpr int V = decltype(v)::value;
      if constexpr (V > 1) {
        column_sums_vec<V>(ctx,
                           rmsnorm_weight_vec_terms<T, V>{dy.data<T>(), x.data<T>(),
                                                          rstd.data<float>(), C},
                           rows, C, dw.raw(), code_of(dw.type()));
        done = true;
      }
    });
    if (done) return;
    rmsnorm_weight_terms<T> f{dy.data<T>(), x.data<T>(), rstd.data<float>(), C};
    void* const outs[1] = {dw.raw()};
    const int codes[1] = {code_of(dw.type())};
    column_sums<1>(ctx, f, rows, C, outs, codes);
  });
}

}  // namespace troupe::kernels::cuda
