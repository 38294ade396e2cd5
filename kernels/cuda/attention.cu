// Causal scaled-dot-product attention on fused qkv[B·T, (H + 2·Hkv)·D] (query heads, then key heads,
// then value heads; query head h reads kv head h / (H/Hkv)), flash-style: the T×T score matrix is
// never stored. The forward keeps only lse[b, h, t], the log-sum-exp of each query's scaled scores;
// the backward recomputes the probabilities p = exp(s − lse) tile by tile.
//
// Two implementations of the same maths here (a third, on Hopper's wgmma, is in sm90/ and takes
// the cases it covers on a device of compute capability 9.0: attention_sm90.hpp):
// * Tensor-core path (bf16/fp16, D ∈ {32, 64} for both directions, D = 128 forward): FlashAttention-2
//    structure with mma.sync m16n8k16 (fp32 accumulation). Each warp holds its rows of Q (forward:
//    32 rows for D ≤ 64, 16 for D = 128; backward: 16 rows of Q and dO, or of K and V) as A
//    fragments in registers and streams 64-row tiles of the other operands through shared memory,
//    double-buffered with cp.async so the next tile loads while this one is multiplied. B fragments
//    come from shared memory with ldmatrix (.trans for the operands used untransposed: V in P·V,
//    K in dS·K, dO in Pᵀ·dO, Q in dSᵀ·Q); rows are padded by 8 elements, so the eight 16-byte
//    rows of every 8×8 matrix fall in distinct banks. Scores stay in registers: the accumulator
//    layout of S = Q·Kᵀ is exactly the A-fragment layout of P for P·V, so the online softmax (in
//    the log2 domain: exp2 of one FMA per score) happens between two MMAs without touching shared
//    memory. Causal structure: warps whose rows see none of a tile skip it, and only tiles on the
//    diagonal (or past T) evaluate the mask.
//  * Row path (fp32, and any dtype/head size the tensor-core path does not cover): one warp per
//    query (or key) row, the lanes splitting D, K/V tiles of 32 rows in shared memory as fp32.
//    Slower, exact fp32: it is what the 1e-5 agreement with the CPU reference is tested on.
//
// The backward is deterministic without atomics: one kernel owns a tile of keys and loops over the
// queries that see it (all query heads of its kv head, in head order) to accumulate dK and dV in
// registers; a second kernel owns a tile of queries and loops over keys for dQ. Each output element
// has exactly one writer, which adds into dqkv (the backend's += contract). Δ_t = dO_t·O_t is
// computed once by a small kernel. Blocks with the most causal work are launched first (the row
// blocks are the grid's slow dimension, so the order holds across batches and heads).
#include <climits>
#include <cmath>
#include <optional>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_sm90.hpp"
#include "kernels/cuda/column_sum.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

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
  const int* doc = doc_row(s, b);
  const int ds = i < s.T ? doc_at(doc, i) : 0;
  const int first = block_min_start(doc, blockIdx.x * row_warps, row_warps, s.T);
  for (int k0 = first / row_tile * row_tile; k0 <= last; k0 += row_tile) {
    __syncthreads();
    load_rows_f32(ks, base, s.W, k0, s.T, (s.H + kvh) * s.D, s.D);
    load_rows_f32(vs, base, s.W, k0, s.T, (s.H + s.Hkv + kvh) * s.D, s.D);
    __syncthreads();
    if (i >= s.T) continue;
    const int jn = min(row_tile, i - k0 + 1);
    for (int j = max(0, ds - k0); j < jn; ++j) {
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

/// Δ as attn_delta, for 16-bit types with D = 8·G: each thread reads 16 bytes of dO and O, and the
/// G threads of one (row, head) sum their parts with shuffles (G divides 32, so a group never
/// straddles a warp).
template <class T, int G>
__global__ void attn_delta_vec(const T* dout, const T* out, float* delta, attn_shape s,
                               std::int64_t chunks) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float acc = 0.0f;
  if (c < chunks) {
    const uint4 a = reinterpret_cast<const uint4*>(dout)[c];
    const uint4 o = reinterpret_cast<const uint4*>(out)[c];
    const T* x = reinterpret_cast<const T*>(&a);
    const T* y = reinterpret_cast<const T*>(&o);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += to_f(x[i]) * to_f(y[i]);
  }
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (c < chunks && c % G == 0) {
    const std::int64_t row = c / G / s.H, b = row / s.T, t = row % s.T;
    const int h = static_cast<int>(c / G % s.H);
    delta[(b * s.H + h) * s.T + t] = acc;
  }
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
  const int* doc = doc_row(s, b);
  const int ds = i < s.T ? doc_at(doc, i) : 0;
  const int first = block_min_start(doc, blockIdx.x * row_warps, row_warps, s.T);
  for (int k0 = first / row_tile * row_tile; k0 <= last; k0 += row_tile) {
    __syncthreads();
    load_rows_f32(ks, base, s.W, k0, s.T, (s.H + kvh) * s.D, s.D);
    load_rows_f32(vs, base, s.W, k0, s.T, (s.H + s.Hkv + kvh) * s.D, s.D);
    __syncthreads();
    if (i >= s.T) continue;
    const int jn = min(row_tile, i - k0 + 1);
    for (int j = max(0, ds - k0); j < jn; ++j) {
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
  const int last_key = min(s.T - 1, first + row_warps - 1);
  const int* doc = doc_row(s, b);
  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    const float* lrow = lse + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    const float* drow = delta + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    for (int q0 = first / row_tile * row_tile; q0 < s.T; q0 += row_tile) {
      if (!block_sees(doc, q0, row_tile, s.T, first, last_key)) continue;
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
        if (doc_at(doc, q0 + r) > j) continue;  // query r's document starts after key j
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

constexpr int tile_rows = 64;  // rows of each streamed shared-memory tile (keys, or queries in dK/dV)
constexpr int bwd_warps = 8;   // warps per backward block, 16 rows each
constexpr int bwd_rows = bwd_warps * 16;  // rows a backward block owns (queries for dQ, keys for dK/dV)

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

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ldmatrix: lanes 8i..8i+7 give the row addresses of 8×8 matrix i; lane l receives row l/4, columns
// 2(l%4) and 2(l%4)+1 of each matrix (.trans: column l/4, rows 2(l%4) and 2(l%4)+1). Volatile: the
// tiles are written by cp.async behind the compiler's back, so these loads must stay between the
// barriers they are written between.
__device__ __forceinline__ void ldsm4(std::uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm4_trans(std::uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// B fragments of X·Yᵀ from a row-major shared tile Y[n][k] (row stride LD): n-block nb (rows
/// 8nb..8nb+7) for k-chunks 2kp (r[0], r[1]) and 2kp + 1 (r[2], r[3]).
template <int LD, class T>
__device__ __forceinline__ void ldsm_b(std::uint32_t (&r)[4], const T* tile, int nb, int kp) {
  const int lane = threadIdx.x % 32;
  ldsm4(r, smem_addr(tile + (nb * 8 + (lane & 7)) * LD + kp * 32 + (lane >> 3) * 8));
}

/// B fragments of X·Y from a row-major shared tile Y[k][n] (row stride LD): k-chunk kk (rows
/// 16kk..16kk+15) for n-blocks 2np (r[0], r[1]) and 2np + 1 (r[2], r[3]).
template <int LD, class T>
__device__ __forceinline__ void ldsm_bt(std::uint32_t (&r)[4], const T* tile, int kk, int np) {
  const int lane = threadIdx.x % 32;
  ldsm4_trans(r, smem_addr(tile + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + np * 16 +
                           (lane >> 4) * 8));
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

/// Packs the accumulators of two adjacent 8-column blocks (c0: columns 16kk..+7, c1: +8..+15) as
/// the A fragment of a 16-wide k-chunk: the accumulator layout of one MMA is the A layout of the
/// next, so scores never leave registers.
template <class T>
__device__ __forceinline__ void pack_a(std::uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst + r * LD + c)),
                 "l"(src), "r"(ok ? 16 : 0));
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

/// Forward block shape: WARPS warps of MT·16 query rows each, MINB blocks per multiprocessor. A
/// warp with more rows reuses each B fragment it reads from shared memory for more MMAs
/// (shared-memory bandwidth is the limit at 16 rows); D = 128 keeps MT = 1 to stay within the
/// registers.
template <class T, int D, int WARPS, int MT, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB) attn_forward_mma(const T* qkv, T* out,
                                                                    float* lse, attn_shape s) {
  constexpr int LD = D + 8, NT = tile_rows / 8, KD = D / 16, ND = D / 8, ST = tile_stages<D>;
  constexpr int BR = WARPS * 16 * MT;
  __shared__ alignas(16) T ks[ST][tile_rows * LD];
  __shared__ alignas(16) T vs[ST][tile_rows * LD];
  const int qb = gridDim.y - 1 - blockIdx.y;  // heaviest (last) query blocks first
  const int b = blockIdx.x / s.H, h = blockIdx.x % s.H, kvh = h / (s.H / s.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int row0 = qb * BR + warp * 16 * MT;  // this warp's rows: row0 .. row0 + 16·MT − 1
  const int n_kt = (min(s.T, (qb + 1) * BR) - 1) / tile_rows + 1;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* kbase = base + (s.H + kvh) * s.D;
  const T* vbase = base + (s.H + s.Hkv + kvh) * s.D;
  // Key tiles before the first document start of the block's rows are seen by none of them.
  const int* doc = doc_row(s, b);
  const int kt0 = block_min_start(doc, qb * BR, BR, s.T) / tile_rows;
  // The first K/V tile's copy starts before this warp's own rows are loaded into registers.
  prefetch_tile<T, D>(ks[0], kbase, s.W, kt0 * tile_rows, s.T);
  prefetch_tile<T, D>(vs[0], vbase, s.W, kt0 * tile_rows, s.T);
  cp_async_commit();
  std::uint32_t qa[MT][KD][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) load_a_rows<T, D>(qa[i], base + h * s.D, s.W, row0 + 16 * i, s.T);
  // This thread's rows' document starts, and the smallest and largest of the warp's rows.
  int dsr[MT][2], wmin = INT_MAX, wmax = 0;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 16 * i + g + 8 * r;
      dsr[i][r] = row < s.T ? doc_at(doc, row) : 0;
      if (row < s.T) wmin = min(wmin, dsr[i][r]);
      wmax = max(wmax, dsr[i][r]);
    }
  wmin = __reduce_min_sync(0xffffffffu, wmin);
  wmax = __reduce_max_sync(0xffffffffu, wmax);
  float o[MT][ND][4];
  float m[MT][2], l[MT][2];  // running max (log2 domain) and sum of each row
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < ND; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.0f;
    m[i][0] = m[i][1] = -INFINITY;
    l[i][0] = l[i][1] = 0.0f;
  }
  const float sl2 = s.scale * log2e;
  for (int kt = kt0; kt < n_kt; ++kt) {
    const int st = ST == 2 ? ((kt - kt0) & 1) : 0;
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
    const int k0 = kt * tile_rows;
    // A warp whose rows all precede this tile sees none of its keys (causal), nor one whose rows'
    // documents all start after it: skip the math.
    if (k0 <= row0 + 16 * MT - 1 && k0 + tile_rows - 1 >= wmin) {
      const T* kt_s = ks[st];
      const T* vt_s = vs[st];
      float sc[MT][NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < MT; ++i) sc[i][n][0] = sc[i][n][1] = sc[i][n][2] = sc[i][n][3] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < KD / 2; ++kp) {
          std::uint32_t kb[4];
          ldsm_b<LD>(kb, kt_s, n, kp);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            mma16816<T>(sc[i][n], qa[i][2 * kp], kb[0], kb[1]);
            mma16816<T>(sc[i][n], qa[i][2 * kp + 1], kb[2], kb[3]);
          }
        }
      }
      // Only a tile holding a key after one of this warp's rows needs the causal mask (keys ≥ T
      // follow every row < T, so they are masked by the same test), and only one holding a key
      // before one of its rows' documents the document mask.
      if (k0 + tile_rows - 1 > row0 || k0 < wmax) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = row0 + 16 * i + g + 8 * (e >> 1);
              const int col = k0 + n * 8 + tig * 2 + (e & 1);
              if (col > row || col < dsr[i][e >> 1]) sc[i][n][e] = -INFINITY;
            }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        // Online softmax on the raw scores: the scale is positive, so the row max commutes with
        // it, and exp2(s·scale·log2e − m) is one FMA before the exp2.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          mx[0] = fmaxf(mx[0], fmaxf(sc[i][n][0], sc[i][n][1]));
          mx[1] = fmaxf(mx[1], fmaxf(sc[i][n][2], sc[i][n][3]));
        }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          const float mn = fmaxf(m[i][r], mx[r] * sl2);
          // A row with no visible key so far keeps m = -inf; exp2 of (-inf) − 0 is 0, never NaN.
          const float base_m = mn == -INFINITY ? 0.0f : mn;
          corr[r] = exp2f(m[i][r] - base_m);
          m[i][r] = mn;
          float sum = 0.0f;
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            sc[i][n][2 * r] = exp2f(fmaf(sc[i][n][2 * r], sl2, -base_m));
            sc[i][n][2 * r + 1] = exp2f(fmaf(sc[i][n][2 * r + 1], sl2, -base_m));
            sum += sc[i][n][2 * r] + sc[i][n][2 * r + 1];
          }
          l[i][r] = l[i][r] * corr[r] + sum;
        }
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          o[i][n][0] *= corr[0];
          o[i][n][1] *= corr[0];
          o[i][n][2] *= corr[1];
          o[i][n][3] *= corr[1];
        }
      }
#pragma unroll
      for (int kk = 0; kk < tile_rows / 16; ++kk) {
        std::uint32_t pa[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) pack_a<T>(pa[i], sc[i][2 * kk], sc[i][2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          std::uint32_t vb[4];
          ldsm_bt<LD>(vb, vt_s, kk, np);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            mma16816<T>(o[i][2 * np], pa[i], vb[0], vb[1]);
            mma16816<T>(o[i][2 * np + 1], pa[i], vb[2], vb[3]);
          }
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
  T* obase = out + static_cast<std::int64_t>(b) * s.T * s.H * s.D + h * s.D;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[i][r];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int row = row0 + 16 * i + g + 8 * r;
      if (row >= s.T) continue;
      const float inv = 1.0f / lr;
      T* orow = obase + static_cast<std::int64_t>(row) * s.H * s.D;
#pragma unroll
      for (int n = 0; n < ND; ++n)
        *reinterpret_cast<std::uint32_t*>(orow + n * 8 + tig * 2) =
            pack2<T>(o[i][n][2 * r] * inv, o[i][n][2 * r + 1] * inv);
      if (tig == 0)
        lse[(static_cast<std::int64_t>(b) * s.H + h) * s.T + row] = m[i][r] * ln2 + logf(lr);
    }
}

/// The value a backward kernel adds its gradient to: what dqkv held (accumulate) or nothing
/// (write: each element has exactly one writer, so dqkv need not be zeroed first).
template <bool Acc, class T>
__device__ __forceinline__ float earlier(const T& x) {
  if constexpr (Acc)
    return to_f(x);
  else
    return 0.0f;
}

/// Keys of the shared 64-row tile that a dQ warp handles at once: the scores and their gradients
/// of 32 keys take 32 registers, so the kernel fits the 128 registers of two blocks per
/// multiprocessor (a whole tile spills; measured whole backward 0.564 ms against 0.578 ms).
constexpr int dq_keys = 32;

/// Blocks per multiprocessor of the backward kernels: two at D ≤ 64; one at D = 128, whose
/// fragments and accumulators need up to 255 registers a thread.
template <int D>
constexpr int bwd_blocks = D <= 64 ? 2 : 1;

/// Docs: the kernel reads s.doc (packed documents). A template parameter, so that the kernels
/// without documents keep their registers (the dK/dV kernel at D = 64 sits at its 128-register
/// limit, where the document bookkeeping adds spills).
template <class T, int D, bool Acc, bool Docs>
__global__ void __launch_bounds__(bwd_warps * 32, bwd_blocks<D>) attn_backward_dq_mma(
    const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv, attn_shape s) {
  constexpr int LD = D + 8, KS = dq_keys, NT = KS / 8, KD = D / 16, ND = D / 8, ST = tile_stages<D>;
  __shared__ alignas(16) T ks[ST][tile_rows * LD];
  __shared__ alignas(16) T vs[ST][tile_rows * LD];
  const int qb = gridDim.y - 1 - blockIdx.y;  // heaviest (last) query blocks first
  const int b = blockIdx.x / s.H, h = blockIdx.x % s.H, kvh = h / (s.H / s.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int row0 = qb * bwd_rows + warp * 16;
  const int n_kt = (min(s.T, (qb + 1) * bwd_rows) - 1) / tile_rows + 1;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* kbase = base + (s.H + kvh) * s.D;
  const T* vbase = base + (s.H + s.Hkv + kvh) * s.D;
  const int* doc = Docs ? doc_row(s, b) : nullptr;
  const int kt0 = block_min_start(doc, qb * bwd_rows, bwd_rows, s.T) / tile_rows;
  // The first K/V tile's copy starts before this warp's own rows are loaded into registers.
  prefetch_tile<T, D>(ks[0], kbase, s.W, kt0 * tile_rows, s.T);
  prefetch_tile<T, D>(vs[0], vbase, s.W, kt0 * tile_rows, s.T);
  cp_async_commit();
  std::uint32_t qa[KD][4], ga[KD][4];
  load_a_rows<T, D>(qa, base + h * s.D, s.W, row0, s.T);
  load_a_rows<T, D>(ga, dout + static_cast<std::int64_t>(b) * s.T * s.H * s.D + h * s.D,
                    static_cast<std::int64_t>(s.H) * s.D, row0, s.T);
  const float* lrow = lse + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
  const float* drow = delta + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
  float L2[2], Dl[2];
  int dsr[2] = {0, 0}, wmin = 0, wmax = 0;  // document starts of this thread's rows; warp min, max
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    L2[r] = row < s.T ? lrow[row] * log2e : 0.0f;
    Dl[r] = row < s.T ? drow[row] : 0.0f;
  }
  if constexpr (Docs) {
    wmin = INT_MAX;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + g + 8 * r;
      dsr[r] = row < s.T ? doc[row] : 0;
      if (row < s.T) wmin = min(wmin, dsr[r]);
      wmax = max(wmax, dsr[r]);
    }
    wmin = __reduce_min_sync(0xffffffffu, wmin);
    wmax = __reduce_max_sync(0xffffffffu, wmax);
  }
  float dq[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  const float sl2 = s.scale * log2e;
  for (int kt = kt0; kt < n_kt; ++kt) {
    const int st = ST == 2 ? ((kt - kt0) & 1) : 0;
    if constexpr (ST == 2) {
      if (kt + 1 < n_kt) {
        prefetch_tile<T, D>(ks[st ^ 1], kbase, s.W, (kt + 1) * tile_rows, s.T);
        prefetch_tile<T, D>(vs[st ^ 1], vbase, s.W, (kt + 1) * tile_rows, s.T);
      }
      cp_async_commit();
      cp_async_wait<1>();
    } else {  // one stage: tile kt was started after the previous tile's last read (below)
      cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < tile_rows / KS; ++c) {
      const int k0 = kt * tile_rows + c * KS;  // first key of this chunk of the tile
      if (k0 > row0 + 15 || k0 + KS - 1 < wmin) continue;
      const T* kt_s = ks[st] + c * KS * LD;
      const T* vt_s = vs[st] + c * KS * LD;
      // Keys after one of this warp's rows exist only near the diagonal (and keys ≥ T follow
      // every row < T); rows ≥ T are never stored. Keys before one of its rows' documents only
      // in chunks before the warp's last document start.
      const bool diag = k0 + KS - 1 > row0 || k0 < wmax;
      float p[NT][4], dp[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < KD / 2; ++kp) {
          std::uint32_t kb[4], vb[4];
          ldsm_b<LD>(kb, kt_s, n, kp);
          mma16816<T>(p[n], qa[2 * kp], kb[0], kb[1]);
          mma16816<T>(p[n], qa[2 * kp + 1], kb[2], kb[3]);
          ldsm_b<LD>(vb, vt_s, n, kp);
          mma16816<T>(dp[n], ga[2 * kp], vb[0], vb[1]);
          mma16816<T>(dp[n], ga[2 * kp + 1], vb[2], vb[3]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          float pv = exp2f(fmaf(p[n][e], sl2, -L2[r]));
          const int col = k0 + n * 8 + tig * 2 + (e & 1);
          if (diag && (col > row0 + g + 8 * r || col < dsr[r])) pv = 0.0f;
          p[n][e] = pv * (dp[n][e] - Dl[r]);  // dS
        }
      }
#pragma unroll
      for (int kk = 0; kk < KS / 16; ++kk) {
        std::uint32_t da[4];
        pack_a<T>(da, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          std::uint32_t kb[4];
          ldsm_bt<LD>(kb, kt_s, kk, np);
          mma16816<T>(dq[2 * np], da, kb[0], kb[1]);
          mma16816<T>(dq[2 * np + 1], da, kb[2], kb[3]);
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
  T* dbase = dqkv + static_cast<std::int64_t>(b) * s.T * s.W + h * s.D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= s.T) continue;
    T* drow_out = dbase + static_cast<std::int64_t>(row) * s.W;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      T* pt = drow_out + n * 8 + tig * 2;
      pt[0] = from_f<T>(earlier<Acc>(pt[0]) + dq[n][2 * r] * s.scale);
      pt[1] = from_f<T>(earlier<Acc>(pt[1]) + dq[n][2 * r + 1] * s.scale);
    }
  }
}

/// Starts the copy of lse and Δ of query rows [row0, row0 + tile_rows) of one (batch, head) into
/// shared memory with cp.async (4 bytes per copy; zero past T), so the loads of the next tile's
/// statistics no longer hold up the threads that issue them.
__device__ __forceinline__ void prefetch_stats(float* ls, float* dls, const float* lrow,
                                               const float* drow, int row0, int T_len) {
  for (int r = threadIdx.x; r < 2 * tile_rows; r += blockDim.x) {
    const bool is_l = r < tile_rows;
    const int q = row0 + (is_l ? r : r - tile_rows);
    const bool ok = q < T_len;
    const float* src = (is_l ? lrow : drow) + (ok ? q : 0);
    float* dst = (is_l ? ls : dls) + (is_l ? r : r - tile_rows);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(ok ? 4 : 0));
  }
}

/// Starts the copy of the document starts of query rows [row0, row0 + tile_rows) of one sequence
/// into shared memory with cp.async, as prefetch_stats (zero past T).
__device__ __forceinline__ void prefetch_docs(int* dst, const int* doc, int row0, int T_len) {
  for (int r = threadIdx.x; r < tile_rows; r += blockDim.x) {
    const bool ok = row0 + r < T_len;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst + r)),
                 "l"(doc + (ok ? row0 + r : 0)), "r"(ok ? 4 : 0));
  }
}

/// Queries of the shared 64-row tile that a dK/dV warp handles at once: a quarter tile keeps the
/// transposed scores and their gradients in 16 registers next to the 96 of K, V, dK and dV, so two
/// blocks fit a multiprocessor (measured at GPT-2 124M's shape: whole backward 0.57 ms, against
/// 0.72 ms with one block of whole tiles per multiprocessor; 52 bytes of spills remain).
constexpr int dkdv_queries = 16;

template <class T, int D, bool Acc, bool Docs>
__global__ void __launch_bounds__(bwd_warps * 32, bwd_blocks<D>) attn_backward_dkdv_mma(
    const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv, attn_shape s) {
  constexpr int LD = D + 8, QS = dkdv_queries, NS = QS / 8, KD = D / 16, ND = D / 8,
                ST = tile_stages<D>;
  __shared__ alignas(16) T qs[ST][tile_rows * LD];
  __shared__ alignas(16) T gs[ST][tile_rows * LD];
  __shared__ alignas(16) float lse_s[2][tile_rows], dls[2][tile_rows];  // lse and Δ of the tile's queries
  __shared__ int dss[2][tile_rows];  // document starts of the tile's queries (with documents)
  const int kb = blockIdx.y;  // the first key blocks see the most queries: launched first
  const int b = blockIdx.x / s.Hkv, kvh = blockIdx.x % s.Hkv, group = s.H / s.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int key0 = kb * bwd_rows + warp * 16;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* obase = dout + static_cast<std::int64_t>(b) * s.T * s.H * s.D;
  const float sl2 = s.scale * log2e;
  // The (query head, query tile) items this block visits, in head order then tile order.
  const int qt0 = kb * bwd_rows / tile_rows;
  const int n_qt = (s.T + tile_rows - 1) / tile_rows - qt0;
  const int items = group * n_qt;
  const int* doc = Docs ? doc_row(s, b) : nullptr;
  const int k_first = kb * bwd_rows, k_last = min(s.T, k_first + bwd_rows) - 1;
  // The first item at or after `item` whose query tile one of the block's keys is seen from
  // (uniform over the block: every thread calls it); with documents, the query tiles whose
  // documents all start after the block's keys are never loaded.
  auto next_item = [&](int item) {
    while (item < items &&
           !block_sees(doc, (qt0 + item % n_qt) * tile_rows, tile_rows, s.T, k_first, k_last))
      ++item;
    return item;
  };
  auto prefetch = [&](int item, int stage) {
    const int h = kvh * group + item / n_qt, qt = qt0 + item % n_qt;
    prefetch_tile<T, D>(qs[stage], base + h * s.D, s.W, qt * tile_rows, s.T);
    prefetch_tile<T, D>(gs[stage], obase + h * s.D, static_cast<std::int64_t>(s.H) * s.D,
                        qt * tile_rows, s.T);
    const float* lrow = lse + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    const float* drow = delta + (static_cast<std::int64_t>(b) * s.H + h) * s.T;
    prefetch_stats(lse_s[stage], dls[stage], lrow, drow, qt * tile_rows, s.T);
    if (doc) prefetch_docs(dss[stage], doc, qt * tile_rows, s.T);
  };
  // The first tile's copy starts before this warp's keys and values are loaded into registers.
  // (The first tile holds the block's first key as a query, which sees it: item 0 is visited.)
  prefetch(0, 0);
  cp_async_commit();
  std::uint32_t ka[KD][4], va[KD][4];
  load_a_rows<T, D>(ka, base + (s.H + kvh) * s.D, s.W, key0, s.T);
  load_a_rows<T, D>(va, base + (s.H + s.Hkv + kvh) * s.D, s.W, key0, s.T);
  float dk[ND][4], dv[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  int stage = 0;
  for (int item = 0; item < items;) {
    const int st = ST == 2 ? stage : 0;
    const int next = next_item(item + 1);
    if constexpr (ST == 2) {
      if (next < items) prefetch(next, st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {  // one stage: item's tile was started after the previous item's last read (below)
      cp_async_wait<0>();
    }
    __syncthreads();
    const int qt = qt0 + item % n_qt;
#pragma unroll
    for (int sub = 0; sub < tile_rows / QS; ++sub) {
      const int q0 = qt * tile_rows + sub * QS;  // first query of this sub-tile
      // A warp whose 16 keys all follow these queries sees none of them (causal): skip.
      if (q0 + QS - 1 < key0) continue;
      const int* qds = dss[st] + sub * QS;  // the queries' document starts (with documents)
      // With documents: skip when every query's document starts after the warp's keys; mask when
      // one starts after one of them.
      bool doc_mask = false;
      if (doc) {
        const int v = lane < QS ? qds[lane] : INT_MAX;
        if (__reduce_min_sync(0xffffffffu, v) > key0 + 15) continue;
        doc_mask = __reduce_max_sync(0xffffffffu, lane < QS ? v : 0) > key0;
      }
      const T* q_s = qs[st] + sub * QS * LD;
      const T* g_s = gs[st] + sub * QS * LD;
      const float* ls = lse_s[st] + sub * QS;  // lse (natural log)
      const float* dl = dls[st] + sub * QS;
      // Queries before one of the keys exist only near the diagonal; queries ≥ T (zero-filled
      // rows whose lse and Δ read as 0) only in the last tile.
      const bool masked = q0 < key0 + 15 || q0 + QS > s.T || doc_mask;
      // Transposed scores: rows are this warp's 16 keys, columns the sub-tile's queries.
      float p[NS][4], dp[NS][4];
#pragma unroll
      for (int n = 0; n < NS; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < KD / 2; ++kp) {
          std::uint32_t qb4[4], gb4[4];
          ldsm_b<LD>(qb4, q_s, n, kp);
          mma16816<T>(p[n], ka[2 * kp], qb4[0], qb4[1]);
          mma16816<T>(p[n], ka[2 * kp + 1], qb4[2], qb4[3]);
          ldsm_b<LD>(gb4, g_s, n, kp);
          mma16816<T>(dp[n], va[2 * kp], gb4[0], gb4[1]);
          mma16816<T>(dp[n], va[2 * kp + 1], gb4[2], gb4[3]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qc = n * 8 + tig * 2 + (e & 1);
          float pv = exp2f(fmaf(p[n][e], sl2, -(ls[qc] * log2e)));
          if (masked) {
            const int q = q0 + qc, key = key0 + g + 8 * (e >> 1);
            if (q < key || q >= s.T || (doc && qds[qc] > key)) pv = 0.0f;
          }
          p[n][e] = pv;
          dp[n][e] = pv * (dp[n][e] - dl[qc]);  // dSᵀ
        }
      }
#pragma unroll
      for (int kk = 0; kk < QS / 16; ++kk) {
        std::uint32_t pa[4], da[4];
        pack_a<T>(pa, p[2 * kk], p[2 * kk + 1]);
        pack_a<T>(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          std::uint32_t gb4[4], qb4[4];
          ldsm_bt<LD>(gb4, g_s, kk, np);
          mma16816<T>(dv[2 * np], pa, gb4[0], gb4[1]);
          mma16816<T>(dv[2 * np + 1], pa, gb4[2], gb4[3]);
          ldsm_bt<LD>(qb4, q_s, kk, np);
          mma16816<T>(dk[2 * np], da, qb4[0], qb4[1]);
          mma16816<T>(dk[2 * np + 1], da, qb4[2], qb4[3]);
        }
      }
    }
    __syncthreads();
    if constexpr (ST == 1) {
      if (next < items) {
        prefetch(next, 0);
        cp_async_commit();
      }
    }
    item = next;
    stage ^= 1;
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
      krow[c] = from_f<T>(earlier<Acc>(krow[c]) + dk[n][2 * r] * s.scale);
      krow[c + 1] = from_f<T>(earlier<Acc>(krow[c + 1]) + dk[n][2 * r + 1] * s.scale);
      vrow[c] = from_f<T>(earlier<Acc>(vrow[c]) + dv[n][2 * r]);
      vrow[c + 1] = from_f<T>(earlier<Acc>(vrow[c + 1]) + dv[n][2 * r + 1]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

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
  require(!d.dropout.on(), op,
          "dropout of the attention probabilities is not implemented in the CUDA attention "
          "kernels (model.attention_dropout must be 0 on CUDA; model.hidden_dropout works)");
  require_float(qkv, op, "qkv");
  attn_shape s{d.seq, d.heads, d.kv_heads, d.head_dim, (d.heads + 2 * d.kv_heads) * d.head_dim,
               1.0f / std::sqrt(static_cast<float>(d.head_dim))};
  if (d.doc_start.defined()) {
    // The starts themselves live on the device and are not checked here (the host would have to
    // wait): 0 <= doc_start[b*T + t] <= t is the caller's (model/chunk.cpp checks it on the host).
    require_type(d.doc_start, dtype::i32, op, "doc_start");
    require(!d.doc_start.dev().is_cpu(), op,
            "doc_start must be on the GPU (upload the document starts with the micro-batch)");
    require_numel(d.doc_start, static_cast<std::int64_t>(d.batch) * d.seq, op,
                  "doc_start ([B*T])");
    s.doc = d.doc_start.data<int>();
  }
  require_numel(qkv, static_cast<std::int64_t>(d.batch) * d.seq * s.W, op,
                "qkv ([B*T, (H + 2*Hkv)*D])");
  return s;
}

/// Whether the tensor-core kernels apply: 16-bit type, supported head size, 16-byte alignment.
bool use_mma(dtype t, int D, std::initializer_list<const tensor*> ts) {
  if (t != dtype::bf16 && t != dtype::f16) return false;
  if (!(D == 32 || D == 64 || D == 128)) return false;
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

/// Δ[b, h, t] = dO·O of each (row, head) into delta; 16-byte vectors when D/8 is a power of two.
template <class T>
void launch_delta(context& ctx, const tensor& dout, const tensor& out, const attn_shape& s,
                  std::int64_t rows, float* delta) {
  const std::int64_t items = rows * s.H;
  if constexpr (!std::is_same_v<T, float>) {
    const int G = s.D / 8;
    if (s.D % 8 == 0 && G <= 32 && (G & (G - 1)) == 0 && aligned16(dout.raw()) &&
        aligned16(out.raw())) {
      const std::int64_t chunks = items * G;
      const unsigned grid = static_cast<unsigned>((chunks + 255) / 256);
      auto go = [&](auto kernel) {
        kernel<<<grid, 256, 0, ctx.stream>>>(dout.data<T>(), out.data<T>(), delta, s, chunks);
      };
      switch (G) {
        case 1: go(attn_delta_vec<T, 1>); break;
        case 2: go(attn_delta_vec<T, 2>); break;
        case 4: go(attn_delta_vec<T, 4>); break;
        case 8: go(attn_delta_vec<T, 8>); break;
        case 16: go(attn_delta_vec<T, 16>); break;
        default: go(attn_delta_vec<T, 32>); break;
      }
      return;
    }
  }
  attn_delta<T><<<static_cast<unsigned>((items + 7) / 8), 256, 0, ctx.stream>>>(
      dout.data<T>(), out.data<T>(), delta, s, static_cast<int>(rows));
}

}  // namespace

void cuda_backend::attention_forward(const tensor& qkv, const attention_dims& d, tensor& out,
                                     tensor& lse) {
  activate();
  context& ctx = *ctx_;
  const char* op = "cuda attention_forward";
  const attn_shape s = check_attention(qkv, d, op);
  require_type(out, qkv.type(), op, "out");
  require_numel(out, static_cast<std::int64_t>(d.batch) * d.seq * d.heads * d.head_dim, op,
                "out ([B*T, H*D])");
  require_type(lse, dtype::f32, op, "lse");
  require_numel(lse, static_cast<std::int64_t>(d.batch) * d.heads * d.seq, op, "lse ([B, H, T])");
#if defined(TROUPE_CUDA_SM90A)
  // On an H100/H200 the wgmma forward (sm90/attention_fwd.cu) takes the cases it covers.
  if (ctx.hopper_attention && use_mma(qkv.type(), d.head_dim, {&qkv, &out}) &&
      attention_forward_sm90(qkv.type(), qkv.raw(), out.raw(), lse.data<float>(), d.batch, s,
                             ctx.hopper_forward_loads, ctx.stream)) {
    TROUPE_CUDA_CHECK_LAUNCH();
    return;
  }
#endif
  if (use_mma(qkv.type(), d.head_dim, {&qkv, &out})) {
    dispatch_float(qkv.type(), op, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, float>)
        dispatch_mma_d(d.head_dim, [&](auto dd) {
          constexpr int D = decltype(dd)::value;
          // Grid x: (batch, head); y: query blocks, launched heaviest first by the kernel.
          auto go = [&](auto kernel, int warps, int rows) {
            kernel<<<dim3(d.batch * d.heads, (d.seq + rows - 1) / rows), warps * 32, 0,
                     ctx.stream>>>(qkv.data<T>(), out.data<T>(), lse.data<float>(), s);
          };
          // D ≤ 64: 4 warps × 32 rows at 2 blocks/SM (measured 0.134 ms instead of 0.143 ms for
          // 8 warps × 16 rows at GPT-2 124M's shape).
          if constexpr (D == 128)
            go(attn_forward_mma<T, D, 8, 1, 1>, 8, 128);
          else
            go(attn_forward_mma<T, D, 4, 2, 2>, 4, 128);
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

namespace {

/// Adds the gradient to dqkv, or writes it (`accumulate` false: dqkv's old contents are ignored).
/// With `dsum` (written results only), also writes dqkv's column sums: from the Hopper kernels'
/// per-16-row partial sums where they run, by the bias gradient's pass over dqkv otherwise.
void attention_backward_on(context& ctx, const tensor& dout, const tensor& qkv, const tensor& out,
                           const tensor& lse, const attention_dims& d, tensor& dqkv,
                           bool accumulate, tensor* dsum) {
  require(!(accumulate && dsum), "cuda attention_backward", "column sums of an accumulated dqkv");
  bool summed = false;
  const char* op = "cuda attention_backward";
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
    launch_delta<T>(ctx, dout, out, s, rows, delta.as<float>());
    TROUPE_CUDA_CHECK_LAUNCH();
#if defined(TROUPE_CUDA_SM90A)
    // On an H100/H200 the wgmma backward (sm90/attention_bwd.cu) takes the cases it covers.
    if (ctx.hopper_attention && use_mma(qkv.type(), d.head_dim, {&qkv, &dout, &dqkv})) {
      const int parts = attention_backward_sm90_sum_rows(d.batch, s);
      const int W = s.W;
      std::optional<scratch> partial;
      if (dsum) partial.emplace(ctx, sizeof(float) * static_cast<std::size_t>(parts) * W);
      if (attention_backward_sm90(qkv.type(), qkv.raw(), dout.raw(), lse.data<float>(),
                                  delta.as<float>(), dqkv.raw(), d.batch, s, accumulate,
                                  dsum ? partial->as<float>() : nullptr, ctx.stream)) {
        TROUPE_CUDA_CHECK_LAUNCH();
        if (dsum) {
          column_finish_kernel<<<finish_grid(W), finish_block(), 0, ctx.stream>>>(
              partial->as<float>(), parts, W, dsum->raw(), code_of(dsum->type()), true);
          TROUPE_CUDA_CHECK_LAUNCH();
          summed = true;
        }
        return;
      }
    }
#endif
    if constexpr (!std::is_same_v<T, float>) {
      if (use_mma(qkv.type(), d.head_dim, {&qkv, &dout, &dqkv})) {
        const int blocks = (d.seq + bwd_rows - 1) / bwd_rows;
        dispatch_mma_d(d.head_dim, [&](auto dd) {
          constexpr int D = decltype(dd)::value;
          auto run = [&](auto acc, auto docs) {
            constexpr bool Acc = decltype(acc)::value, Docs = decltype(docs)::value;
            // Grid x: (batch, head); y: row blocks, launched heaviest first by the kernels.
            attn_backward_dkdv_mma<T, D, Acc, Docs><<<dim3(d.batch * d.kv_heads, blocks), bwd_warps * 32, 0, ctx.stream>>>(
                qkv.data<T>(), dout.data<T>(), lse.data<float>(), delta.as<float>(),
                dqkv.data<T>(), s);
            TROUPE_CUDA_CHECK_LAUNCH();
            attn_backward_dq_mma<T, D, Acc, Docs><<<dim3(d.batch * d.heads, blocks), bwd_warps * 32, 0, ctx.stream>>>(
                qkv.data<T>(), dout.data<T>(), lse.data<float>(), delta.as<float>(),
                dqkv.data<T>(), s);
            TROUPE_CUDA_CHECK_LAUNCH();
          };
          auto with_docs = [&](auto acc) {
            if (s.doc)
              run(acc, std::true_type{});
            else
              run(acc, std::false_type{});
          };
          if (accumulate)
            with_docs(std::true_type{});
          else
            with_docs(std::false_type{});
        });
        return;
      }
    }
    // The row kernels always accumulate: a written result starts from zeros.
    if (!accumulate)
      TROUPE_CUDA_CHECK(cudaMemsetAsync(dqkv.raw(), 0, dqkv.bytes(), ctx.stream));
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
  if (dsum && !summed) sum_rows_on(ctx, dqkv, *dsum, true);
}

}  // namespace

void cuda_backend::attention_backward(const tensor& dout, const tensor& qkv, const tensor& out,
                                      const tensor& lse, const attention_dims& d, tensor& dqkv) {
  activate();
  attention_backward_on(*ctx_, dout, qkv, out, lse, d, dqkv, true, nullptr);
}

void cuda_backend::attention_backward_write(const tensor& dout, const tensor& qkv,
                                            const tensor& out, const tensor& lse,
                                            const attention_dims& d, tensor& dqkv,
                                            tensor& dsum) {
  activate();
  if (dsum.defined()) {
    require_float(dsum, "cuda attention_backward_write", "dsum");
    require_numel(dsum, qkv.dim(-1), "cuda attention_backward_write", "dsum");
  }
  attention_backward_on(*ctx_, dout, qkv, out, lse, d, dqkv, false,
                        dsum.defined() ? &dsum : nullptr);
}

}  // namespace troupe::kernels::cuda
