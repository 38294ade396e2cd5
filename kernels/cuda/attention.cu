// Causal scaled-dot-product attention on fused qkv[B·T, (H + 2·Hkv)·D] (query heads, then key heads,
// then value heads; query head h reads kv head h / (H/Hkv)), flash-style: the T×T score matrix is
// never stored. The forward keeps only lse[b, h, t], the log-sum-exp of each query's scaled scores;
// the backward recomputes the probabilities p = exp(s − lse) tile by tile.
//
// Two implementations of the same maths:
// * Tensor-core path (bf16/fp16, D ∈ {32, 64} for both directions, D = 128 forward): FlashAttention-2
//    structure with mma.sync m16n8k16 (fp32 accumulation). A block of 8 warps owns 128 rows; each
//    warp holds 16 rows of Q (or K and V in the backward) as A fragments in registers and streams
//    64-row tiles of the other operand through shared memory, double-buffered with cp.async so the
//    next tile loads while this one is multiplied (rows padded by 8 elements, so every fragment
//    load is free of bank conflicts). Warps whose rows see none of a tile (causal) skip its math. Scores stay in registers: the accumulator layout of
//    S = Q·Kᵀ is exactly the A-fragment layout of P for P·V, so the online softmax (in the log2
//    domain, exp2f) happens between two MMAs without touching shared memory.
//  * Row path (fp32, and any dtype/head size the tensor-core path does not cover): one warp per
//    query (or key) row, the lanes splitting D, K/V tiles of 32 rows in shared memory as fp32.
//    Slower, exact fp32: it is what the 1e-5 agreement with the CPU reference is tested on.
//
// The backward is deterministic without atomics: one kernel owns a tile of keys and loops over the
// queries that see it (all query heads of its kv head, in head order) to accumulate dK and dV in
// registers; a second kernel owns a tile of queries and loops over keys for dQ. Each output element
// has exactly one writer, which adds into dqkv (the backend's += contract). Δ_t = dO_t·O_t is
// computed once by a small kernel. Blocks with the most causal work are launched first.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

namespace {
constexpr float log2e = 1.4426950408889634f;
constexpr float ln2 = 0.6931471805599453f;
}  // namespace

/// Geometry shared by the kernels.
struct attn_shape {
  int T;        // sequence length
  int H;        // query heads
  int Hkv;      // key/value heads
  int D;        // head size
  int W;        // qkv row width (H + 2·Hkv)·D
  float scale;  // 1/√D
};

// ---- row path ------------------------------------------------------------------------------------

constexpr int row_warps = 8;  // rows per block
constexpr int row_tile = 32;  // keys (or queries) per shared-memory tile

/// Loads rows [r0, r0 + row_tile) of one head (column offset `col`) into shared fp32, zero past T.
template <class T>
__device__ void load_rows_f32(float* dst, const T* base, int stride, int r0, int T_len, int col,
                              int D) {
  for (int idx = threadIdx.x; idx < row_tile * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    dst[idx] = r0 + r < T_len ? to_f(base[static_cast<std::int64_t>(r0 + r) * stride + col + d]) : 0.0f;
  }
}

template <class T, int DPL>
__global__ void attn_forward_rows(const T* qkv, T* out, float* lse, attn_shape s) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + row_tile * s.D;
  const int b = blockIdx.y / s.H, h = blockIdx.y % s.H, kvh = h / (s.H / s.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i = blockIdx.x * row_warps + warp;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  float q[DPL], o[DPL];
#pragma unroll
  for (int e = 0; e < DPL; ++e) {
    const int d = lane + 32 * e;
    q[e] = i < s.T && d < s.D ? to_f(base[static_cast<std::int64_t>(i) * s.W + h * s.D + d]) : 0.0f;
    o[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int last = min(s.T - 1, blockIdx.x * row_warps + row_warps - 1);
  for (int k0 = 0; k0 <= last; k0 += row_tile) {
    __syncthreads();
    load_rows_f32(ks, base, s.W, k0, s.T, (s.H + kvh) * s.D, s.D);
    load_rows_f32(vs, base, s.W, k0, s.T, (s.H + s.Hkv + kvh) * s.D, s.D);
    __syncthreads();
    if (i >= s.T) continue;
    const int jn = min(row_tile, i - k0 + 1);
    for (int j = 0; j < jn; ++j) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < DPL; ++e) {
        const int d = lane + 32 * e;
        if (d < s.D) dot += q[e] * ks[j * s.D + d];
      }
      const float sc = warp_sum(dot) * s.scale;
      const float mn = fmaxf(m, sc);
      const float corr = expf(m - mn), p = expf(sc - mn);
      l = l * corr + p;
#pragma unroll
      for (int e = 0; e < DPL; ++e) {
        const int d = lane + 32 * e;
        o[e] = o[e] * corr + (d < s.D ? p * vs[j * s.D + d] : 0.0f);
      }
      m = mn;
    }
  }
  if (i >= s.T) return;
  T* orow = out + (static_cast<std::int64_t>(b) * s.T + i) * s.H * s.D + h * s.D;
#pragma unroll
  for (int e = 0; e < DPL; ++e) {
    const int d = lane + 32 * e;
    if (d < s.D) orow[d] = from_f<T>(o[e] / l);
  }
  if (lane == 0) lse[(static_cast<std::int64_t>(b) * s.H + h) * s.T + i] = m + logf(l);
}

/// Δ[b, h, t] = Σ_d dO·O, one warp per (row, head).
template <class T>
__global__ void attn_delta(const T* dout, const T* out, float* delta, attn_shape s, int rows) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (idx >= static_cast<std::int64_t>(rows) * s.H) return;
  const std::int64_t row = idx / s.H;
  const int h = static_cast<int>(idx % s.H);
  const std::int64_t off = row * s.H * s.D + h * s.D;
  float acc = 0.0f;
  for (int d = lane; d < s.D; d += 32) acc += to_f(dout[off + d]) * to_f(out[off + d]);
  acc = warp_sum(acc);
  const std::int64_t b = row / s.T, t = row % s.T;
  if (lane == 0) delta[(b * s.H + h) * s.T + t] = acc;
}

template <class T, int DPL>
__global__ void attn_backward_dq_rows(const T* qkv, const T* dout, const float* lse,
                                      const float* delta, T* dqkv, attn_shape s) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + row_tile * s.D;
  const int b = blockIdx.y / s.H, h = blockIdx.y % s.H, kvh = h / (s.H / s.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i = blockIdx.x * row_warps + warp;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const std::int64_t orow = (static_cast<std::int64_t>(b) * s.T + i) * s.H * s.D + h * s.D;
  float q[DPL], g[DPL], dq[DPL];
#pragma unroll
  for (int e = 0; e < DPL; ++e) {
    const int d = lane + 32 * e;
    const bool ok = i < s.T && d < s.D;
    q[e] = ok ? to_f(base[static_cast<std::int64_t>(i) * s.W + h * s.D + d]) : 0.0f;
    g[e] = ok ? to_f(dout[orow + d]) : 0.0f;
    dq[e] = 0.0f;
  }
  const std::int64_t stat = (static_cast<std::int64_t>(b) * s.H + h) * s.T + i;
  const float L = i < s.T ? lse[stat] : 0.0f, Dl = i < s.T ? delta[stat] : 0.0f;
  const int last = min(s.T - 1, blockIdx.x * row_warps + row_warps - 1);
  for (int k0 = 0; k0 <= last; k0 += row_tile) {
    __syncthreads();
    load_rows_f32(ks, base, s.W, k0, s.T, (s.H + kvh) * s.D, s.D);
    load_rows_f32(vs, base, s.W, k0, s.T, (s.H + s.Hkv + kvh) * s.D, s.D);
    __syncthreads();
    if (i >= s.T) continue;
    const int jn = min(row_tile, i - k0 + 1);
    for (int j = 0; j < jn; ++j) {
      float dot = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < DPL; ++e) {
        const int d = lane + 32 * e;
        if (d < s.D) {
          dot += q[e] * ks[j * s.D + d];
          dp += g[e] * vs[j * s.D + d];
        }
      }
      const float p = expf(warp_sum(dot) * s.scale - L);
      const float ds = p * (warp_sum(dp) - Dl);
#pragma unroll
      for (int e = 0; e < DPL; ++e) {
        const int d = lane + 32 * e;
        if (d < s.D) dq[e] += ds * ks[j * s.D + d];
      }
    }
  }
  if (i >= s.T) return;
  T* dst = dqkv + (static_cast<std::int64_t>(b) * s.T + i) * s.W + h * s.D;
#pragma unroll
  for (int e = 0; e < DPL; ++e) {
    const int d = lane + 32 * e;
    if (d < s.D) dst[d] = from_f<T>(to_f(dst[d]) + dq[e] * s.scale);
  }
}

template <class T, int DPL>
__global__ void attn_backward_dkdv_rows(const T* qkv, const T* dout, const float* lse,
                                        const float* delta, T* dqkv, attn_shape s) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* gs = smem + row_tile * s.D;
  float* ls = smem + 2 * row_tile * s.D;
  float* dls = ls + row_tile;
  const int b = blockIdx.y / s.Hkv, kvh = blockIdx.y % s.Hkv, group = s.H / s.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.x * row_warps + warp;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* obase = dout + static_cast<std::int64_t>(b) * s.T * s.H * s.D;
  float k[DPL], v[DPL], dk[DPL], dv[DPL];
#pragma unroll
  for (int e = 0; e < DPL; ++e) {
    const int d = lane + 32 * e;
    const bool ok = j < s.T && d < s.D;
    k[e] = ok ? to_f(base[static_cast<std::int64_t>(j) * s.W + (s.H + kvh) * s.D + d]) : 0.0f;
    v[e] = ok ? to_f(base[static_cast<std::int64_t>(j) * s.W + (s.H + s.Hkv + kvh) * s.D + d]) : 0.0f;
    dk[e] = dv[e] = 0.0f;
  }
  const int first = blockIdx.x * row_warps;
  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    const float* lrow = lse + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    const float* drow = delta + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    for (int q0 = first / row_tile * row_tile; q0 < s.T; q0 += row_tile) {
      __syncthreads();
      load_rows_f32(qs, base, s.W, q0, s.T, h * s.D, s.D);
      load_rows_f32(gs, obase, s.H * s.D, q0, s.T, h * s.D, s.D);
      for (int r = threadIdx.x; r < row_tile; r += blockDim.x) {
        ls[r] = q0 + r < s.T ? lrow[q0 + r] : 0.0f;
        dls[r] = q0 + r < s.T ? drow[q0 + r] : 0.0f;
      }
      __syncthreads();
      if (j >= s.T) continue;
      for (int r = max(0, j - q0); r < row_tile && q0 + r < s.T; ++r) {
        float dot = 0.0f, dp = 0.0f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          const int d = lane + 32 * e;
          if (d < s.D) {
            dot += k[e] * qs[r * s.D + d];
            dp += v[e] * gs[r * s.D + d];
          }
        }
        const float p = expf(warp_sum(dot) * s.scale - ls[r]);
        const float ds = p * (warp_sum(dp) - dls[r]);
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          const int d = lane + 32 * e;
          if (d < s.D) {
            dv[e] += p * gs[r * s.D + d];
            dk[e] += ds * qs[r * s.D + d];
          }
        }
      }
    }
  }
  if (j >= s.T) return;
  T* dst = dqkv + (static_cast<std::int64_t>(b) * s.T + j) * s.W;
#pragma unroll
  for (int e = 0; e < DPL; ++e) {
    const int d = lane + 32 * e;
    if (d < s.D) {
      T* pk = dst + (s.H + kvh) * s.D + d;
      T* pv = dst + (s.H + s.Hkv + kvh) * s.D + d;
      *pk = from_f<T>(to_f(*pk) + dk[e] * s.scale);
      *pv = from_f<T>(to_f(*pv) + dv[e]);
    }
  }
}

// ---- tensor-core path ----------------------------------------------------------------------------

constexpr int blk_warps = 8;                // warps per block, 16 rows each
constexpr int blk_rows = blk_warps * 16;    // rows a block owns (queries, or keys in dK/dV)
constexpr int tile_rows = 64;               // rows of each streamed shared-memory tile

template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<bf16>(float (&c)[4], const std::uint32_t (&a)[4],
                                               std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<f16>(float (&c)[4], const std::uint32_t (&a)[4],
                                              std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Two floats rounded to T and packed lower index first (the fragment element order).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  T v[2] = {from_f<T>(lo), from_f<T>(hi)};
  std::uint32_t r;
  memcpy(&r, v, 4);
  return r;
}

template <class T>
__device__ __forceinline__ std::uint32_t ld32(const T* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}

/// Two elements of one column (rows r and r + 1 of a row-major tile) packed lower row first.
template <class T>
__device__ __forceinline__ std::uint32_t ld_col2(const T* p, int ld) {
  T v[2] = {p[0], p[ld]};
  std::uint32_t r;
  memcpy(&r, v, 4);
  return r;
}

/// A fragments of 16 rows × D from global memory (rows ≥ T read as zero).
template <class T, int D>
__device__ __forceinline__ void load_a_rows(std::uint32_t (&a)[D / 16][4], const T* base,
                                            std::int64_t stride, int row0, int T_len) {
  const int lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const bool ok0 = row0 + g < T_len, ok1 = row0 + g + 8 < T_len;
  const T* r0 = base + static_cast<std::int64_t>(row0 + g) * stride;
  const T* r1 = r0 + 8 * stride;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + tig * 2;
    a[kk][0] = ok0 ? ld32(r0 + c) : 0u;
    a[kk][1] = ok1 ? ld32(r1 + c) : 0u;
    a[kk][2] = ok0 ? ld32(r0 + c + 8) : 0u;
    a[kk][3] = ok1 ? ld32(r1 + c + 8) : 0u;
  }
}

/// Starts the copy of rows [row0, row0 + tile_rows) × D of one head into a padded shared tile with
/// cp.async (16 bytes per thread and copy); rows ≥ T are zero-filled. Completes at the matching
/// cp_async_wait.
template <class T, int D>
__device__ __forceinline__ void prefetch_tile(T* dst, const T* base, std::int64_t stride, int row0,
                                              int T_len) {
  constexpr int LD = D + 8, chunks = D / 8;
  for (int idx = threadIdx.x; idx < tile_rows * chunks; idx += blockDim.x) {
    const int r = idx / chunks, c = (idx % chunks) * 8;
    const bool ok = row0 + r < T_len;
    const T* src = base + static_cast<std::int64_t>(ok ? row0 + r : 0) * stride + c;
    const unsigned dst_addr = static_cast<unsigned>(__cvta_generic_to_shared(dst + r * LD + c));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(src),
                 "r"(ok ? 16 : 0));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/// Shared-memory stages of the streamed tiles: two (the next tile loads while this one is used)
/// when they fit the 48 KB of static shared memory, else one.
template <int D>
constexpr int tile_stages = D <= 64 ? 2 : 1;

template <class T, int D>
__global__ void __launch_bounds__(blk_warps * 32) attn_forward_mma(const T* qkv, T* out,
                                                                   float* lse, attn_shape s) {
  constexpr int LD = D + 8, NT = tile_rows / 8, KD = D / 16, ND = D / 8, ST = tile_stages<D>;
  __shared__ alignas(16) T ks[ST][tile_rows * LD];
  __shared__ alignas(16) T vs[ST][tile_rows * LD];
  const int qb = gridDim.x - 1 - blockIdx.x;  // heaviest (last) query blocks first
  const int b = blockIdx.y / s.H, h = blockIdx.y % s.H, kvh = h / (s.H / s.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int row0 = qb * blk_rows + warp * 16;
  const int n_kt = (min(s.T, (qb + 1) * blk_rows) - 1) / tile_rows + 1;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* kbase = base + (s.H + kvh) * s.D;
  const T* vbase = base + (s.H + s.Hkv + kvh) * s.D;
  std::uint32_t qa[KD][4];
  load_a_rows<T, D>(qa, base + h * s.D, s.W, row0, s.T);
  float o[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = s.scale * log2e;
  prefetch_tile<T, D>(ks[0], kbase, s.W, 0, s.T);
  prefetch_tile<T, D>(vs[0], vbase, s.W, 0, s.T);
  cp_async_commit();
  for (int kt = 0; kt < n_kt; ++kt) {
    const int st = ST == 2 ? (kt & 1) : 0;
    if constexpr (ST == 2) {
      if (kt + 1 < n_kt) {
        prefetch_tile<T, D>(ks[st ^ 1], kbase, s.W, (kt + 1) * tile_rows, s.T);
        prefetch_tile<T, D>(vs[st ^ 1], vbase, s.W, (kt + 1) * tile_rows, s.T);
      }
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // A warp whose 16 rows all precede this tile sees none of its keys (causal): skip the math.
    if (kt * tile_rows <= row0 + 15) {
      const T* kt_s = ks[st];
      const T* vt_s = vs[st];
      float sc[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
          const T* kr = kt_s + (n * 8 + g) * LD + kk * 16 + tig * 2;
          mma16816<T>(sc[n], qa[kk], ld32(kr), ld32(kr + 8));
        }
      }
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + g + (e >= 2 ? 8 : 0);
          const int col = kt * tile_rows + n * 8 + tig * 2 + (e & 1);
          const float v = (col > row || col >= s.T) ? -INFINITY : sc[n][e] * sl2;
          sc[n][e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      float corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        // A row with no visible key so far keeps m = -inf; exp2 of (-inf) − 0 is 0, never NaN.
        const float base_m = mx[r] == -INFINITY ? 0.0f : mx[r];
        corr[r] = exp2f(m[r] - base_m);
        m[r] = mx[r];
        l[r] *= corr[r];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          sc[n][2 * r] = exp2f(sc[n][2 * r] - base_m);
          sc[n][2 * r + 1] = exp2f(sc[n][2 * r + 1] - base_m);
          l[r] += sc[n][2 * r] + sc[n][2 * r + 1];
        }
      }
#pragma unroll
      for (int n = 0; n < ND; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
      }
#pragma unroll
      for (int kk = 0; kk < tile_rows / 16; ++kk) {
        const std::uint32_t pa[4] = {pack2<T>(sc[2 * kk][0], sc[2 * kk][1]),
                                     pack2<T>(sc[2 * kk][2], sc[2 * kk][3]),
                                     pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                     pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          const T* vr = vt_s + (kk * 16 + tig * 2) * LD + n * 8 + g;
          mma16816<T>(o[n], pa, ld_col2(vr, LD), ld_col2(vr + 8 * LD, LD));
        }
      }
    }
    __syncthreads();
    if constexpr (ST == 1) {
      if (kt + 1 < n_kt) {
        prefetch_tile<T, D>(ks[0], kbase, s.W, (kt + 1) * tile_rows, s.T);
        prefetch_tile<T, D>(vs[0], vbase, s.W, (kt + 1) * tile_rows, s.T);
        cp_async_commit();
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  T* obase = out + static_cast<std::int64_t>(b) * s.T * s.H * s.D + h * s.D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= s.T) continue;
    const float inv = 1.0f / l[r];
    T* orow = obase + static_cast<std::int64_t>(row) * s.H * s.D;
#pragma unroll
    for (int n = 0; n < ND; ++n)
      *reinterpret_cast<std::uint32_t*>(orow + n * 8 + tig * 2) =
          pack2<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    if (tig == 0) lse[(static_cast<std::int64_t>(b) * s.H + h) * s.T + row] = m[r] * ln2 + logf(l[r]);
  }
}

template <class T, int D>
// Two blocks per multiprocessor: the register cap (128) costs no spills here and doubles the warps
// that hide each other's latency.
__global__ void __launch_bounds__(blk_warps * 32, 2) attn_backward_dq_mma(
    const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv, attn_shape s) {
  constexpr int LD = D + 8, NT = tile_rows / 8, KD = D / 16, ND = D / 8;
  static_assert(tile_stages<D> == 2, "the backward kernels double-buffer (D <= 64)");
  __shared__ alignas(16) T ks[2][tile_rows * LD];
  __shared__ alignas(16) T vs[2][tile_rows * LD];
  const int qb = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / s.H, h = blockIdx.y % s.H, kvh = h / (s.H / s.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int row0 = qb * blk_rows + warp * 16;
  const int n_kt = (min(s.T, (qb + 1) * blk_rows) - 1) / tile_rows + 1;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* kbase = base + (s.H + kvh) * s.D;
  const T* vbase = base + (s.H + s.Hkv + kvh) * s.D;
  std::uint32_t qa[KD][4], ga[KD][4];
  load_a_rows<T, D>(qa, base + h * s.D, s.W, row0, s.T);
  load_a_rows<T, D>(ga, dout + static_cast<std::int64_t>(b) * s.T * s.H * s.D + h * s.D,
                    static_cast<std::int64_t>(s.H) * s.D, row0, s.T);
  const float* lrow = lse + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
  const float* drow = delta + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
  float L2[2], Dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    L2[r] = row < s.T ? lrow[row] * log2e : 0.0f;
    Dl[r] = row < s.T ? drow[row] : 0.0f;
  }
  float dq[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  const float sl2 = s.scale * log2e;
  prefetch_tile<T, D>(ks[0], kbase, s.W, 0, s.T);
  prefetch_tile<T, D>(vs[0], vbase, s.W, 0, s.T);
  cp_async_commit();
  for (int kt = 0; kt < n_kt; ++kt) {
    const int st = kt & 1;
    if (kt + 1 < n_kt) {
      prefetch_tile<T, D>(ks[st ^ 1], kbase, s.W, (kt + 1) * tile_rows, s.T);
      prefetch_tile<T, D>(vs[st ^ 1], vbase, s.W, (kt + 1) * tile_rows, s.T);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (kt * tile_rows <= row0 + 15) {
      const T* kt_s = ks[st];
      const T* vt_s = vs[st];
      float p[NT][4], dp[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
          const T* kr = kt_s + (n * 8 + g) * LD + kk * 16 + tig * 2;
          mma16816<T>(p[n], qa[kk], ld32(kr), ld32(kr + 8));
          const T* vr = vt_s + (n * 8 + g) * LD + kk * 16 + tig * 2;
          mma16816<T>(dp[n], ga[kk], ld32(vr), ld32(vr + 8));
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int row = row0 + g + 8 * r;
          const int col = kt * tile_rows + n * 8 + tig * 2 + (e & 1);
          const float pv =
              (col > row || col >= s.T || row >= s.T) ? 0.0f : exp2f(p[n][e] * sl2 - L2[r]);
          p[n][e] = pv * (dp[n][e] - Dl[r]);  // dS
        }
      }
#pragma unroll
      for (int kk = 0; kk < tile_rows / 16; ++kk) {
        const std::uint32_t da[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]),
                                     pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                                     pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                                     pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          const T* kr = kt_s + (kk * 16 + tig * 2) * LD + n * 8 + g;
          mma16816<T>(dq[n], da, ld_col2(kr, LD), ld_col2(kr + 8 * LD, LD));
        }
      }
    }
    __syncthreads();
  }
  T* dbase = dqkv + static_cast<std::int64_t>(b) * s.T * s.W + h * s.D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= s.T) continue;
    T* drow_out = dbase + static_cast<std::int64_t>(row) * s.W;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      T* pt = drow_out + n * 8 + tig * 2;
      pt[0] = from_f<T>(to_f(pt[0]) + dq[n][2 * r] * s.scale);
      pt[1] = from_f<T>(to_f(pt[1]) + dq[n][2 * r + 1] * s.scale);
    }
  }
}

template <class T, int D>
__global__ void __launch_bounds__(blk_warps * 32) attn_backward_dkdv_mma(
    const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv, attn_shape s) {
  constexpr int LD = D + 8, NT = tile_rows / 8, KD = D / 16, ND = D / 8;
  static_assert(tile_stages<D> == 2, "the backward kernels double-buffer (D <= 64)");
  __shared__ alignas(16) T qs[2][tile_rows * LD];
  __shared__ alignas(16) T gs[2][tile_rows * LD];
  __shared__ float l2s[2][tile_rows], dls[2][tile_rows];
  const int kb = blockIdx.x;  // the first key blocks see the most queries: launched first
  const int b = blockIdx.y / s.Hkv, kvh = blockIdx.y % s.Hkv, group = s.H / s.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int key0 = kb * blk_rows + warp * 16;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* obase = dout + static_cast<std::int64_t>(b) * s.T * s.H * s.D;
  std::uint32_t ka[KD][4], va[KD][4];
  load_a_rows<T, D>(ka, base + (s.H + kvh) * s.D, s.W, key0, s.T);
  load_a_rows<T, D>(va, base + (s.H + s.Hkv + kvh) * s.D, s.W, key0, s.T);
  float dk[ND][4], dv[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  const float sl2 = s.scale * log2e;
  // The (query head, query tile) items this block visits, in head order then tile order.
  const int qt0 = kb * blk_rows / tile_rows;
  const int n_qt = (s.T + tile_rows - 1) / tile_rows - qt0;
  const int items = group * n_qt;
  auto prefetch = [&](int item, int stage) {
    const int h = kvh * group + item / n_qt, qt = qt0 + item % n_qt;
    prefetch_tile<T, D>(qs[stage], base + h * s.D, s.W, qt * tile_rows, s.T);
    prefetch_tile<T, D>(gs[stage], obase + h * s.D, static_cast<std::int64_t>(s.H) * s.D,
                        qt * tile_rows, s.T);
    const float* lrow = lse + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    const float* drow = delta + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    for (int r = threadIdx.x; r < tile_rows; r += blockDim.x) {
      const int q = qt * tile_rows + r;
      l2s[stage][r] = q < s.T ? lrow[q] * log2e : 0.0f;
      dls[stage][r] = q < s.T ? drow[q] : 0.0f;
    }
  };
  prefetch(0, 0);
  cp_async_commit();
  for (int item = 0; item < items; ++item) {
    const int st = item & 1;
    if (item + 1 < items) prefetch(item + 1, st ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int qt = qt0 + item % n_qt;
    // A warp whose 16 keys all follow this tile's queries sees none of them (causal): skip.
    if (qt * tile_rows + tile_rows - 1 >= key0) {
      const T* q_s = qs[st];
      const T* g_s = gs[st];
      // Transposed scores: rows are this warp's 16 keys, columns the tile's 64 queries.
      float p[NT][4], dp[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
          const T* qr = q_s + (n * 8 + g) * LD + kk * 16 + tig * 2;
          mma16816<T>(p[n], ka[kk], ld32(qr), ld32(qr + 8));
          const T* gr = g_s + (n * 8 + g) * LD + kk * 16 + tig * 2;
          mma16816<T>(dp[n], va[kk], ld32(gr), ld32(gr + 8));
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + g + 8 * (e >> 1);
          const int qc = n * 8 + tig * 2 + (e & 1);
          const int q = qt * tile_rows + qc;
          const float pv =
              (q < key || q >= s.T || key >= s.T) ? 0.0f : exp2f(p[n][e] * sl2 - l2s[st][qc]);
          p[n][e] = pv;
          dp[n][e] = pv * (dp[n][e] - dls[st][qc]);  // dSᵀ
        }
      }
#pragma unroll
      for (int kk = 0; kk < tile_rows / 16; ++kk) {
        const std::uint32_t pa[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]),
                                     pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                                     pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                                     pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        const std::uint32_t da[4] = {pack2<T>(dp[2 * kk][0], dp[2 * kk][1]),
                                     pack2<T>(dp[2 * kk][2], dp[2 * kk][3]),
                                     pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                     pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          const T* gr = g_s + (kk * 16 + tig * 2) * LD + n * 8 + g;
          mma16816<T>(dv[n], pa, ld_col2(gr, LD), ld_col2(gr + 8 * LD, LD));
          const T* qr = q_s + (kk * 16 + tig * 2) * LD + n * 8 + g;
          mma16816<T>(dk[n], da, ld_col2(qr, LD), ld_col2(qr + 8 * LD, LD));
        }
      }
    }
    __syncthreads();
  }
  T* dbase = dqkv + static_cast<std::int64_t>(b) * s.T * s.W;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + g + 8 * r;
    if (key >= s.T) continue;
    T* krow = dbase + static_cast<std::int64_t>(key) * s.W + (s.H + kvh) * s.D;
    T* vrow = dbase + static_cast<std::int64_t>(key) * s.W + (s.H + s.Hkv + kvh) * s.D;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      const int c = n * 8 + tig * 2;
      krow[c] = from_f<T>(to_f(krow[c]) + dk[n][2 * r] * s.scale);
      krow[c + 1] = from_f<T>(to_f(krow[c + 1]) + dk[n][2 * r + 1] * s.scale);
      vrow[c] = from_f<T>(to_f(vrow[c]) + dv[n][2 * r]);
      vrow[c + 1] = from_f<T>(to_f(vrow[c + 1]) + dv[n][2 * r + 1]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// launchers

namespace {

attn_shape check_attention(const tensor& qkv, const attention_dims& d, const char* op) {
  require(d.batch > 0 && d.seq > 0 && d.heads > 0 && d.kv_heads > 0 && d.head_dim > 0 &&
              d.heads % d.kv_heads == 0,
          op,
          "dims must be positive with heads % kv_heads == 0, got B=" + std::to_string(d.batch) +
              " T=" + std::to_string(d.seq) + " H=" + std::to_string(d.heads) +
              " Hkv=" + std::to_string(d.kv_heads) + " D=" + std::to_string(d.head_dim));
  require(d.head_dim <= 128, op,
          "head_dim " + std::to_string(d.head_dim) + " > 128 is not supported on CUDA");
  require_float(qkv, op, "qkv");
  attn_shape s{d.seq, d.heads, d.kv_heads, d.head_dim, (d.heads + 2 * d.kv_heads) * d.head_dim,
               1.0f / std::sqrt(static_cast<float>(d.head_dim))};
  require_numel(qkv, static_cast<std::int64_t>(d.batch) * d.seq * s.W, op,
                "qkv ([B*T, (H + 2*Hkv)*D])");
  return s;
}

/// Whether the tensor-core kernels apply: 16-bit type, supported head size, 16-byte alignment.
bool use_mma(dtype t, int D, bool backward, std::initializer_list<const tensor*> ts) {
  if (t != dtype::bf16 && t != dtype::f16) return false;
  if (!(D == 32 || D == 64 || (D == 128 && !backward))) return false;
  for (const tensor* x : ts)
    if (!aligned16(x->raw())) return false;
  return true;
}

template <class F>
void dispatch_dpl(int D, F&& f) {
  if (D <= 32)
    f(std::integral_constant<int, 1>{});
  else if (D <= 64)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 4>{});
}

template <class F>
void dispatch_mma_d(int D, F&& f) {
  if (D == 32)
    f(std::integral_constant<int, 32>{});
  else if (D == 64)
    f(std::integral_constant<int, 64>{});
  else
    f(std::integral_constant<int, 128>{});
}

}  // namespace

void launch_attention_forward(context& ctx, const tensor& qkv, const attention_dims& d,
                              tensor& out, tensor& lse) {
  const char* op = "attention_forward";
  const attn_shape s = check_attention(qkv, d, op);
  require_type(out, qkv.type(), op, "out");
  require_numel(out, static_cast<std::int64_t>(d.batch) * d.seq * d.heads * d.head_dim, op,
                "out ([B*T, H*D])");
  require_type(lse, dtype::f32, op, "lse");
  require_numel(lse, static_cast<std::int64_t>(d.batch) * d.heads * d.seq, op, "lse ([B, H, T])");
  if (use_mma(qkv.type(), d.head_dim, false, {&qkv, &out})) {
    dim3 grid((d.seq + blk_rows - 1) / blk_rows, d.batch * d.heads);
    dispatch_float(qkv.type(), op, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, float>)
        dispatch_mma_d(d.head_dim, [&](auto dd) {
          attn_forward_mma<T, decltype(dd)::value><<<grid, blk_warps * 32, 0, ctx.stream>>>(
              qkv.data<T>(), out.data<T>(), lse.data<float>(), s);
        });
    });
  } else {
    dim3 grid((d.seq + row_warps - 1) / row_warps, d.batch * d.heads);
    const std::size_t smem = 2 * row_tile * d.head_dim * sizeof(float);
    dispatch_float(qkv.type(), op, [&](auto tag) {
      using T = decltype(tag);
      dispatch_dpl(d.head_dim, [&](auto dpl) {
        attn_forward_rows<T, decltype(dpl)::value><<<grid, row_warps * 32, smem, ctx.stream>>>(
            qkv.data<T>(), out.data<T>(), lse.data<float>(), s);
      });
    });
  }
  TROUPE_CUDA_CHECK_LAUNCH();
}

void launch_attention_backward(context& ctx, const tensor& dout, const tensor& qkv,
                               const tensor& out, const tensor& lse, const attention_dims& d,
                               tensor& dqkv) {
  const char* op = "attention_backward";
  const attn_shape s = check_attention(qkv, d, op);
  const std::int64_t rows = static_cast<std::int64_t>(d.batch) * d.seq;
  require_type(dout, qkv.type(), op, "dout");
  require_type(out, qkv.type(), op, "out");
  require_type(dqkv, qkv.type(), op, "dqkv");
  require_numel(dout, rows * d.heads * d.head_dim, op, "dout ([B*T, H*D])");
  require_numel(out, rows * d.heads * d.head_dim, op, "out ([B*T, H*D])");
  require_numel(dqkv, qkv.numel(), op, "dqkv");
  require_type(lse, dtype::f32, op, "lse");
  require_numel(lse, static_cast<std::int64_t>(d.batch) * d.heads * d.seq, op, "lse ([B, H, T])");
  scratch delta(ctx, sizeof(float) * static_cast<std::size_t>(rows) * d.heads);
  dispatch_float(qkv.type(), op, [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t items = rows * d.heads;
    attn_delta<T><<<static_cast<unsigned>((items + 7) / 8), 256, 0, ctx.stream>>>(
        dout.data<T>(), out.data<T>(), delta.as<float>(), s, static_cast<int>(rows));
    TROUPE_CUDA_CHECK_LAUNCH();
    if constexpr (!std::is_same_v<T, float>) {
      if (use_mma(qkv.type(), d.head_dim, true, {&qkv, &dout, &dqkv})) {
        const int blocks = (d.seq + blk_rows - 1) / blk_rows;
        dispatch_mma_d(d.head_dim, [&](auto dd) {
          constexpr int D = decltype(dd)::value;
          if constexpr (D <= 64) {
            attn_backward_dkdv_mma<T, D>
                <<<dim3(blocks, d.batch * d.kv_heads), blk_warps * 32, 0, ctx.stream>>>(
                qkv.data<T>(), dout.data<T>(), lse.data<float>(), delta.as<float>(),
                dqkv.data<T>(), s);
            TROUPE_CUDA_CHECK_LAUNCH();
            attn_backward_dq_mma<T, D>
                <<<dim3(blocks, d.batch * d.heads), blk_warps * 32, 0, ctx.stream>>>(
                qkv.data<T>(), dout.data<T>(), lse.data<float>(), delta.as<float>(),
                dqkv.data<T>(), s);
            TROUPE_CUDA_CHECK_LAUNCH();
          }
        });
        return;
      }
    }
    dispatch_dpl(d.head_dim, [&](auto dpl) {
      constexpr int DPL = decltype(dpl)::value;
      const unsigned tiles = static_cast<unsigned>((d.seq + row_warps - 1) / row_warps);
      const std::size_t smem_kv = 2 * row_tile * d.head_dim * sizeof(float) + 2 * row_tile * sizeof(float);
      attn_backward_dkdv_rows<T, DPL><<<dim3(tiles, d.batch * d.kv_heads), row_warps * 32, smem_kv,
                                        ctx.stream>>>(qkv.data<T>(), dout.data<T>(),
                                                      lse.data<float>(), delta.as<float>(),
                                                      dqkv.data<T>(), s);
      TROUPE_CUDA_CHECK_LAUNCH();
      attn_backward_dq_rows<T, DPL><<<dim3(tiles, d.batch * d.heads), row_warps * 32,
                                      2 * row_tile * d.head_dim * sizeof(float), ctx.stream>>>(
          qkv.data<T>(), dout.data<T>(), lse.data<float>(), delta.as<float>(), dqkv.data<T>(), s);
      TROUPE_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace troupe::kernels::cuda
