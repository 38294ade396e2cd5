// Attention against a key/value cache, for generation (the CPU twin: kernels/cpu/attention_decode.cpp).
// kv_cache_write copies each new row's key and value heads to cache[slot, position];
// attention_decode lets the query heads of each row attend to its slot's positions 0..position:
//   s_j = q · k_j / sqrt(D),  out = Σ_j exp(s_j − m) v_j / Σ_j exp(s_j − m).
//
// One block per (row, query head), four warps. Warp w takes keys w, w + 4, ...: its lanes split D
// (DPL = D/32 elements each), a butterfly sums the dot product, and the warp keeps an online
// softmax (running max m, sum l, accumulator o) over its keys, as flash-decoding does. The four
// partial results are then merged in warp order through shared memory, so the result does not
// depend on timing. The cache may be as long as the model's positions: nothing scales with it but
// the loop. All arithmetic is fp32; q, the caches and out are fp32, bf16 or fp16 alike.
//
// Slots and positions live on the device and are not checked here (the host would have to wait
// to read them): a row outside the cache writes NaN instead of reading out of bounds.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

namespace {
constexpr int decode_warps = 4;
}  // namespace

/// The cache layout: [slots, positions, kv_width].
struct cache_shape {
  int slots;
  int positions;
  int kv_width;   // Hkv · D
  int qkv_width;  // (H + 2·Hkv) · D
  int H, Hkv, D;
};

template <class T>
__global__ void kv_cache_write_kernel(const T* qkv, const int* slots, const int* positions,
                                      T* k_cache, T* v_cache, cache_shape c, std::int64_t rows) {
  const std::int64_t per_row = 2LL * c.kv_width;
  const std::int64_t n = rows * per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += stride) {
    const std::int64_t r = idx / per_row;
    const int e = static_cast<int>(idx % per_row);
    const int slot = slots[r], pos = positions[r];
    if (slot < 0 || slot >= c.slots || pos < 0 || pos >= c.positions) continue;
    const T v = qkv[r * c.qkv_width + static_cast<std::int64_t>(c.H) * c.D + e];
    const std::int64_t at = (static_cast<std::int64_t>(slot) * c.positions + pos) * c.kv_width;
    if (e < c.kv_width)
      k_cache[at + e] = v;
    else
      v_cache[at + e - c.kv_width] = v;
  }
}

template <class T, int DPL>
__global__ void attention_decode_kernel(const T* qkv, const int* slots, const int* positions,
                                        const T* k_cache, const T* v_cache, T* out,
                                        cache_shape c, float scale) {
  __shared__ float part_m[decode_warps], part_l[decode_warps];
  __shared__ float part_o[decode_warps][DPL * 32];
  const std::int64_t r = blockIdx.x;
  const int h = blockIdx.y, kvh = h / (c.H / c.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = slots[r], pos = positions[r];
  T* o_row = out + r * static_cast<std::int64_t>(c.H) * c.D + static_cast<std::int64_t>(h) * c.D;
  if (slot < 0 || slot >= c.slots || pos < 0 || pos >= c.positions) {
    for (int e = threadIdx.x; e < c.D; e += blockDim.x) o_row[e] = from_f<T>(__int_as_float(0x7fc00000));
    return;
  }
  const T* q_row = qkv + r * c.qkv_width + static_cast<std::int64_t>(h) * c.D;
  float q[DPL], o[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int e = lane + 32 * i;
    q[i] = e < c.D ? to_f(q_row[e]) * scale : 0.0f;
    o[i] = 0.0f;
  }
  const std::int64_t base = static_cast<std::int64_t>(slot) * c.positions * c.kv_width +
                            static_cast<std::int64_t>(kvh) * c.D;
  float m = -INFINITY, l = 0.0f;
  for (int j = warp; j <= pos; j += decode_warps) {
    const T* k = k_cache + base + static_cast<std::int64_t>(j) * c.kv_width;
    const T* v = v_cache + base + static_cast<std::int64_t>(j) * c.kv_width;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int e = lane + 32 * i;
      if (e < c.D) s += q[i] * to_f(k[e]);
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int e = lane + 32 * i;
      o[i] = o[i] * corr + (e < c.D ? p * to_f(v[e]) : 0.0f);
    }
    m = m_new;
  }
  if (lane == 0) part_m[warp] = m, part_l[warp] = l;
#pragma unroll
  for (int i = 0; i < DPL; ++i) part_o[warp][lane + 32 * i] = o[i];
  __syncthreads();
  float top = -INFINITY;
  for (int w = 0; w < decode_warps; ++w) top = fmaxf(top, part_m[w]);
  float total = 0.0f;
  for (int w = 0; w < decode_warps; ++w)
    if (part_l[w] > 0.0f) total += part_l[w] * expf(part_m[w] - top);
  for (int e = threadIdx.x; e < c.D; e += blockDim.x) {
    float acc = 0.0f;
    for (int w = 0; w < decode_warps; ++w)
      if (part_l[w] > 0.0f) acc += part_o[w][e] * expf(part_m[w] - top);
    o_row[e] = from_f<T>(acc / total);
  }
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {

cache_shape check_cache(const tensor& qkv, const tensor& slots, const tensor& positions,
                        const tensor& k_cache, const tensor& v_cache, const attention_dims& d,
                        const char* op) {
  require(d.heads > 0 && d.kv_heads > 0 && d.head_dim > 0 && d.heads % d.kv_heads == 0, op,
          "dims must be positive with heads % kv_heads == 0, got H=" + std::to_string(d.heads) +
              " Hkv=" + std::to_string(d.kv_heads) + " D=" + std::to_string(d.head_dim));
  require(d.head_dim <= 256, op, "head_dim " + std::to_string(d.head_dim) + " above 256");
  require_float(qkv, op, "qkv");
  require_type(slots, dtype::i32, op, "slots");
  require_type(positions, dtype::i32, op, "positions");
  require_type(k_cache, qkv.type(), op, "k_cache");
  require_type(v_cache, qkv.type(), op, "v_cache");
  cache_shape c;
  c.H = d.heads;
  c.Hkv = d.kv_heads;
  c.D = d.head_dim;
  c.kv_width = d.kv_heads * d.head_dim;
  c.qkv_width = (d.heads + 2 * d.kv_heads) * d.head_dim;
  const std::int64_t rows = slots.numel();
  require_numel(positions, rows, op, "positions");
  require_numel(qkv, rows * c.qkv_width, op, "qkv");
  require(k_cache.rank() == 3 && k_cache.dim(2) == c.kv_width, op,
          "k_cache " + core::shape_string(k_cache.shape()) + " must be [S, P, " +
              std::to_string(c.kv_width) + "]");
  require(v_cache.shape() == k_cache.shape(), op, "v_cache must be shaped like k_cache");
  c.slots = static_cast<int>(k_cache.dim(0));
  c.positions = static_cast<int>(k_cache.dim(1));
  return c;
}

}  // namespace

void cuda_backend::kv_cache_write(const tensor& qkv, const tensor& slots, const tensor& positions,
                                  const attention_dims& d, tensor& k_cache, tensor& v_cache) {
  activate();
  cudaStream_t s = ctx_->stream;
  const cache_shape c =
      check_cache(qkv, slots, positions, k_cache, v_cache, d, "cuda kv_cache_write");
  const std::int64_t rows = slots.numel(), n = rows * 2 * c.kv_width;
  if (n == 0) return;
  dispatch_float(qkv.type(), "cuda kv_cache_write", [&](auto tag) {
    using T = decltype(tag);
    kv_cache_write_kernel<T><<<grid_for(n, 256), 256, 0, s>>>(
        static_cast<const T*>(qkv.raw()), slots.data<int>(), positions.data<int>(),
        static_cast<T*>(k_cache.raw()), static_cast<T*>(v_cache.raw()), c, rows);
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::attention_decode(const tensor& qkv, const tensor& slots,
                                    const tensor& positions, const tensor& k_cache,
                                    const tensor& v_cache, const attention_dims& d, tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda attention_decode";
  const cache_shape c = check_cache(qkv, slots, positions, k_cache, v_cache, d, op);
  const std::int64_t rows = slots.numel();
  require_type(out, qkv.type(), op, "out");
  require_numel(out, rows * c.H * c.D, op, "out");
  if (rows == 0) return;
  require(rows <= 0x7fffffff, op, "more than 2^31 rows");
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(c.H));
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  dispatch_float(qkv.type(), op, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto dpl) {
      attention_decode_kernel<T, decltype(dpl)::value><<<grid, 32 * decode_warps, 0, s>>>(
          static_cast<const T*>(qkv.raw()), slots.data<int>(), positions.data<int>(),
          static_cast<const T*>(k_cache.raw()), static_cast<const T*>(v_cache.raw()),
          static_cast<T*>(out.raw()), c, scale);
    };
    if (c.D <= 32)
      launch(std::integral_constant<int, 1>{});
    else if (c.D <= 64)
      launch(std::integral_constant<int, 2>{});
    else if (c.D <= 128)
      launch(std::integral_constant<int, 4>{});
    else
      launch(std::integral_constant<int, 8>{});
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
