// The causal attention backward on Hopper's warpgroup MMA (sm_90a only): the same maths and the
// same two-kernel structure as attention.cu's tensor-core backward (docs/cuda.md, "Attention"),
// for 16-bit types at head size 64 without packed documents. Each gradient element has one
// writer and a fixed order of additions, so the result is the same bits on every run.
//
// dK/dV blocks: a block owns WGS·64 keys of one kv head (their K and V in shared memory) and
// streams tiles of queries, of every query head of the group in head order, through a ring of NS
// stages (Q, dO, lse, Δ). Per warpgroup (64 keys) and tile: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (both
// operands from shared memory), Pᵀ = exp(Sᵀ·scale − lse), dSᵀ = Pᵀ ∘ (dPᵀ − Δ), then dV += Pᵀ·dO
// and dK += dSᵀ·Q with Pᵀ and dSᵀ from registers (the accumulator layout is the A operand's) and
// dO, Q N-major from the same stage. With Overlap those two are issued with the next tile's Sᵀ
// and dPᵀ; without, a tile's products end within its step and the other blocks on the
// multiprocessor fill the tensor cores meanwhile (the shipped shape: fewer registers, 3 blocks).
//
// dQ blocks: a block owns WGS·64 queries of one head (Q and dO in shared memory) and streams
// tiles of keys (K, V): S = Q·Kᵀ, dP = dO·Vᵀ, P, dS as above, dQ += dS·K (K N-major).
//
// Both kinds of block run in one grid (attn_backward_wgmma) or as two kernels (bwd_shape::fused).
// Tiles that hold no masked element (most of them) take a softmax loop without the mask.
#include "kernels/cuda/attention_sm90.hpp"

#include <array>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/sm90/wgmma.cuh"

namespace troupe::kernels::cuda {

namespace {

using namespace sm90;

/// Starts copying n floats from src (n ≤ blockDim.x; entries at or past `valid` are zeros).
__device__ __forceinline__ void load_floats(float* dst, const float* src, int n, int valid) {
  const int i = threadIdx.x;
  if (i < n) {
    const bool ok = i < valid;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst + i)),
                 "l"(src + (ok ? i : 0)), "r"(ok ? 4 : 0));
  }
}

/// Packs an fp32 accumulator (m64nN) into the A fragments of the next wgmma (16-bit, k = N).
template <class T, int N>
__device__ __forceinline__ void pack_a(std::uint32_t (&a)[N / 16][4], const float (&x)[N / 2]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[kk][e] = pack2<T>(x[8 * kk + 2 * e], x[8 * kk + 2 * e + 1]);
}

/// Adds (Acc) or writes a warp's m64n64 accumulator rows, times `mul`, into rows of `dst`
/// (row stride `stride`), two neighbouring columns per 4-byte access; rows ≥ T are not written.
/// With Sum (written results only), also writes the column sums of the warp's 16 rows as stored
/// (rounded to T) into sums[0, 64): each thread adds its two rows of a column, then the eight
/// lanes that share the column add theirs by shuffles in a fixed order (no atomics). A warp whose
/// rows all lie past T writes no sums (it owns no partial row).
template <bool Acc, bool Sum, class T>
__device__ __forceinline__ void store_rows(T* dst, std::int64_t stride, const float (&x)[32],
                                           float mul, int row_base, int T_len, float* sums) {
  static_assert(!(Acc && Sum), "column sums are of written results");
  using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float c0 = 0.0f, c1 = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_base + g + 8 * r;
      if (row >= T_len) continue;
      T2* p = reinterpret_cast<T2*>(dst + static_cast<std::int64_t>(row) * stride + 2 * t);
      float lo, hi;
      if constexpr (Acc) {
        const T2 e = p[4 * j];
        lo = fmaf(x[4 * j + 2 * r], mul, __low2float(e));
        hi = fmaf(x[4 * j + 2 * r + 1], mul, __high2float(e));
      } else {
        lo = x[4 * j + 2 * r] * mul;
        hi = x[4 * j + 2 * r + 1] * mul;
      }
      const std::uint32_t v = pack2<T>(lo, hi);
      const T2 stored = *reinterpret_cast<const T2*>(&v);
      p[4 * j] = stored;
      if constexpr (Sum) {
        c0 += __low2float(stored);
        c1 += __high2float(stored);
      }
    }
    if constexpr (Sum) {
#pragma unroll
      for (int m = 4; m < 32; m <<= 1) {
        c0 += __shfl_xor_sync(0xffffffffu, c0, m);
        c1 += __shfl_xor_sync(0xffffffffu, c1, m);
      }
      if (g == 0 && row_base < T_len) {
        sums[8 * j + 2 * t] = c0;
        sums[8 * j + 2 * t + 1] = c1;
      }
    }
  }
}

/// Where a warp's column sums go: the partial row of its 16 rows (attention_backward_sm90's
/// `sums`: [batch · ⌈T/16⌉, W]), at column `col`; null without sums.
__device__ __forceinline__ float* sum_row(float* sums, const attn_shape& s, int b, int row_base,
                                          int col) {
  if (!sums) return nullptr;
  const std::int64_t r = static_cast<std::int64_t>(b) * ((s.T + 15) / 16) + row_base / 16;
  return sums + r * s.W + col;
}

template <class T, int WGS, int TILE, int NS, bool Overlap, bool Acc, bool Sum>
__device__ __forceinline__ void dkdv_block(const T* qkv, const T* dout, const float* lse,
                                           const float* delta, T* dqkv, float* sums,
                                           const attn_shape& s, int bh, int kb) {
  static_assert(NS >= (Overlap ? 3 : 2) && TILE <= WGS * 128);
  // With Overlap a stage is still read by the gradient products of the tile before; without, a
  // tile's products end within its step.
  constexpr int BK = WGS * 64, PF = Overlap ? NS - 2 : NS - 1, TB = TILE * ROWB;
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sk = smem;
  unsigned char* sv = sk + BK * ROWB;
  unsigned char* sq = sv + BK * ROWB;  // NS stages of TILE rows
  unsigned char* sg = sq + NS * TB;    // dO, NS stages
  float* sl = reinterpret_cast<float*>(sg + NS * TB);  // lse of each stage's queries
  float* sd = sl + NS * TILE;                          // Δ
  const int b = bh / s.Hkv, kvh = bh % s.Hkv, group = s.H / s.Hkv;
  const auto [wg, warp, g, t] = place();
  const int k0 = kb * BK;
  const int key_base = k0 + wg * 64 + warp * 16;  // this warp's keys: key_base + g, + 8
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* obase = dout + static_cast<std::int64_t>(b) * s.T * s.H * D;
  const int qt0 = k0 / TILE;
  const int n_qt = (s.T + TILE - 1) / TILE - qt0;
  const int items = group * n_qt;
  const float sl2 = s.scale * log2e;
  auto load_item = [&](int item) {
    const int h = kvh * group + item / n_qt, q0 = (qt0 + item % n_qt) * TILE, st = item % NS;
    load_tile<TILE, WGS * 128>(sq + st * TB, base + h * D, s.W, q0, s.T);
    load_tile<TILE, WGS * 128>(sg + st * TB, obase + h * D, s.H * D, q0, s.T);
    const std::int64_t row = (static_cast<std::int64_t>(b) * s.H + h) * s.T + q0;
    load_floats(sl + st * TILE, lse + row, TILE, s.T - q0);
    load_floats(sd + st * TILE, delta + row, TILE, s.T - q0);
  };
  load_tile<BK, WGS * 128>(sk, base + (s.H + kvh) * D, s.W, k0, s.T);
  load_tile<BK, WGS * 128>(sv, base + (s.H + s.Hkv + kvh) * D, s.W, k0, s.T);
#pragma unroll
  for (int p = 0; p < PF; ++p) {
    if (p < items) load_item(p);
    cp_commit();
  }
  float dk[32], dv[32], sc[TILE / 2], dp[TILE / 2];
#pragma unroll
  for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.0f;
  std::uint32_t pa[TILE / 16][4], da[TILE / 16][4];
  const std::uint32_t kaddr = smem_u32(sk + wg * 64 * ROWB);
  const std::uint32_t vaddr = smem_u32(sv + wg * 64 * ROWB);
  auto issue_grads = [&](int item) {  // dV += Pᵀ·dO, dK += dSᵀ·Q of `item`
    const int st = item % NS;
    const std::uint64_t gd = desc(smem_u32(sg + st * TB)), qd = desc(smem_u32(sq + st * TB));
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) wgmma_rs<T>(dv, pa[kk], desc_at(gd, kk * PV_KSTEP));
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) wgmma_rs<T>(dk, da[kk], desc_at(qd, kk * PV_KSTEP));
    wg_commit();
  };
  auto step = [&](int item, auto first) {
    constexpr bool First = decltype(first)::value;
    cp_wait<PF - 1>();
    fence_async();
    __syncthreads();
    if (item + PF < items) load_item(item + PF);  // into the stage of item − 2: no longer read
    cp_commit();
    const int st = item % NS, q0 = (qt0 + item % n_qt) * TILE;
    const std::uint32_t qaddr = smem_u32(sq + st * TB), gaddr = smem_u32(sg + st * TB);
    if constexpr (Overlap && !First) {
      pack_a<T, TILE>(pa, sc);
      pack_a<T, TILE>(da, dp);
    }
    wg_fence();
    wgmma_two_products<T, TILE>(sc, kaddr, qaddr, dp, vaddr, gaddr);
    if constexpr (Overlap && !First) {
      issue_grads(item - 1);
      wg_wait<1>();
    } else {
      wg_wait<0>();
    }
    pin(sc);
    pin(dp);
    // Rows are this warp's keys, columns the tile's queries. Queries before a key, and queries
    // ≥ T (zero rows whose lse and Δ read as 0), exist only near the diagonal and in the last tile.
    const float* ls = sl + st * TILE;
    const float* dl = sd + st * TILE;
    auto probabilities = [&](auto mask) {  // Pᵀ into sc, dSᵀ into dp
#pragma unroll
      for (int j = 0; j < TILE / 8; ++j) {
        const float2 lv = *reinterpret_cast<const float2*>(ls + 8 * j + 2 * t);
        const float2 dv2 = *reinterpret_cast<const float2*>(dl + 8 * j + 2 * t);
        const float nl[2] = {-lv.x * log2e, -lv.y * log2e}, dd[2] = {dv2.x, dv2.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = ex2(fmaf(sc[4 * j + e], sl2, nl[e & 1]));
          if constexpr (decltype(mask)::value) {
            const int q = q0 + 8 * j + 2 * t + (e & 1), key = key_base + g + 8 * (e >> 1);
            if (q < key || q >= s.T) pv = 0.0f;
          }
          sc[4 * j + e] = pv;
          dp[4 * j + e] = pv * (dp[4 * j + e] - dd[e & 1]);  // dSᵀ
        }
      }
    };
    if (q0 < key_base + 15 || q0 + TILE > s.T)
      probabilities(std::true_type{});
    else
      probabilities(std::false_type{});
    if constexpr (!Overlap) {
      pack_a<T, TILE>(pa, sc);
      pack_a<T, TILE>(da, dp);
      wg_fence();
      issue_grads(item);
    }
    wg_wait<0>();
    pin(dk);
    pin(dv);
  };
  step(0, std::true_type{});
  for (int item = 1; item < items; ++item) step(item, std::false_type{});
  if constexpr (Overlap) {
    pack_a<T, TILE>(pa, sc);
    pack_a<T, TILE>(da, dp);
    wg_fence();
    issue_grads(items - 1);
    wg_wait<0>();
    pin(dk);
    pin(dv);
  }
  cp_wait<0>();
  T* dbase = dqkv + static_cast<std::int64_t>(b) * s.T * s.W;
  store_rows<Acc, Sum>(dbase + (s.H + kvh) * D, s.W, dk, s.scale, key_base, s.T,
                       sum_row(sums, s, b, key_base, (s.H + kvh) * D));
  store_rows<Acc, Sum>(dbase + (s.H + s.Hkv + kvh) * D, s.W, dv, 1.0f, key_base, s.T,
                       sum_row(sums, s, b, key_base, (s.H + s.Hkv + kvh) * D));
}

template <class T, int WGS, int TILE, int NS, bool Acc, bool Sum>
__device__ __forceinline__ void dq_block(const T* qkv, const T* dout, const float* lse,
                                         const float* delta, T* dqkv, float* sums,
                                         const attn_shape& s, int bh, int qb) {
  static_assert(NS >= 3);
  constexpr int BM = WGS * 64, PF = NS - 2, TB = TILE * ROWB;
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sq = smem;
  unsigned char* sg = sq + BM * ROWB;
  unsigned char* sk = sg + BM * ROWB;  // NS stages of TILE keys
  unsigned char* sv = sk + NS * TB;
  const int b = bh / s.H, h = bh % s.H, kvh = h / (s.H / s.Hkv);
  const auto [wg, warp, g, t] = place();
  const int q0 = qb * BM;
  const int row_base = q0 + wg * 64 + warp * 16;
  const int n_kt = (min(s.T, q0 + BM) - 1) / TILE + 1;
  const int my_last = (min(s.T, q0 + wg * 64 + 64) - 1) / TILE;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* kbase = base + (s.H + kvh) * D;
  const T* vbase = base + (s.H + s.Hkv + kvh) * D;
  const float sl2 = s.scale * log2e;
  load_tile<BM, WGS * 128>(sq, base + h * D, s.W, q0, s.T);
  load_tile<BM, WGS * 128>(sg, dout + static_cast<std::int64_t>(b) * s.T * s.H * D + h * D,
                           s.H * D, q0, s.T);
#pragma unroll
  for (int p = 0; p < PF; ++p) {
    if (p < n_kt) {
      load_tile<TILE, WGS * 128>(sk + (p % NS) * TB, kbase, s.W, p * TILE, s.T);
      load_tile<TILE, WGS * 128>(sv + (p % NS) * TB, vbase, s.W, p * TILE, s.T);
    }
    cp_commit();
  }
  float lr[2], dr[2];  // lse (log2 domain) and Δ of this thread's two rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_base + g + 8 * r;
    const std::int64_t i = (static_cast<std::int64_t>(b) * s.H + h) * s.T + row;
    lr[r] = row < s.T ? lse[i] * log2e : 0.0f;
    dr[r] = row < s.T ? delta[i] : 0.0f;
  }
  float dq[32], sc[TILE / 2], dp[TILE / 2];
#pragma unroll
  for (int i = 0; i < 32; ++i) dq[i] = 0.0f;
  std::uint32_t da[TILE / 16][4];
  const std::uint32_t qaddr = smem_u32(sq + wg * 64 * ROWB);
  const std::uint32_t gaddr = smem_u32(sg + wg * 64 * ROWB);
  auto issue_dq = [&](int tile) {  // dQ += dS·K of `tile`
    const std::uint64_t kd = desc(smem_u32(sk + (tile % NS) * TB));
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) wgmma_rs<T>(dq, da[kk], desc_at(kd, kk * PV_KSTEP));
    wg_commit();
  };
  auto step = [&](int kt, auto first) {
    constexpr bool First = decltype(first)::value;
    cp_wait<PF - 1>();
    fence_async();
    __syncthreads();
    if (kt + PF < n_kt) {
      const int st = (kt + PF) % NS;
      load_tile<TILE, WGS * 128>(sk + st * TB, kbase, s.W, (kt + PF) * TILE, s.T);
      load_tile<TILE, WGS * 128>(sv + st * TB, vbase, s.W, (kt + PF) * TILE, s.T);
    }
    cp_commit();
    if (kt > my_last) {  // past this warpgroup's rows: finish the previous tile's dQ, once
      if (!First && kt == my_last + 1) {
        pack_a<T, TILE>(da, dp);
        wg_fence();
        issue_dq(kt - 1);
        wg_wait<0>();
        pin(dq);
      }
      return;
    }
    const int st = kt % NS;
    const std::uint32_t kaddr = smem_u32(sk + st * TB), vaddr = smem_u32(sv + st * TB);
    if constexpr (!First) pack_a<T, TILE>(da, dp);
    wg_fence();
    wgmma_two_products<T, TILE>(sc, qaddr, kaddr, dp, gaddr, vaddr);
    if constexpr (!First) {
      issue_dq(kt - 1);
      wg_wait<1>();
    } else {
      wg_wait<0>();
    }
    pin(sc);
    pin(dp);
    const int k0 = kt * TILE;
    auto gradients = [&](auto mask) {  // dS into dp
#pragma unroll
      for (int j = 0; j < TILE / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          float pv = ex2(fmaf(sc[4 * j + e], sl2, -lr[r]));
          if constexpr (decltype(mask)::value)
            if (k0 + 8 * j + 2 * t + (e & 1) > row_base + g + 8 * r) pv = 0.0f;
          dp[4 * j + e] = pv * (dp[4 * j + e] - dr[r]);  // dS
        }
    };
    if (k0 + TILE - 1 > row_base)  // a key after one of this warp's rows
      gradients(std::true_type{});
    else
      gradients(std::false_type{});
    wg_wait<0>();
    pin(dq);
  };
  step(0, std::true_type{});
  for (int kt = 1; kt < n_kt; ++kt) step(kt, std::false_type{});
  if (my_last == n_kt - 1) {
    pack_a<T, TILE>(da, dp);
    wg_fence();
    issue_dq(n_kt - 1);
    wg_wait<0>();
    pin(dq);
  }
  cp_wait<0>();
  store_rows<Acc, Sum>(dqkv + static_cast<std::int64_t>(b) * s.T * s.W + h * D, s.W, dq,
                       s.scale, row_base, s.T, sum_row(sums, s, b, row_base, h * D));
}

/// A backward's block shapes: warpgroups per block (64 keys or queries each), the tile the dK/dV
/// blocks stream (queries), its ring's stages and whether a tile's softmax runs beside the
/// gradient products of the tile before; the dQ blocks' tile (keys) and stages; one launch or two.
/// Measured on the H200 against the others in docs/cuda.md ("The Hopper kernels").
struct bwd_shape {
  int wgs, kv_tile, kv_stages;
  bool kv_overlap;
  int q_tile, q_stages;
  bool fused;  // one launch for both kernels
};
constexpr bwd_shape shipped_shape{1, 64, 3, false, 64, 3, true};

template <class T, int WGS, int KVT, int KVS, bool KVO, int QT, int QS, bool Acc, bool Sum>
__global__ void __launch_bounds__(WGS * 128, 1)
    attn_backward_dkdv_wgmma(const T* qkv, const T* dout, const float* lse, const float* delta,
                             T* dqkv, float* sums, attn_shape s) {
  // The first key blocks see the most queries: launched first.
  dkdv_block<T, WGS, KVT, KVS, KVO, Acc, Sum>(qkv, dout, lse, delta, dqkv, sums, s, blockIdx.x,
                                              blockIdx.y);
}
template <class T, int WGS, int KVT, int KVS, bool KVO, int QT, int QS, bool Acc, bool Sum>
__global__ void __launch_bounds__(WGS * 128, 1)
    attn_backward_dq_wgmma(const T* qkv, const T* dout, const float* lse, const float* delta,
                           T* dqkv, float* sums, attn_shape s) {
  // The last query blocks see the most keys: launched first.
  dq_block<T, WGS, QT, QS, Acc, Sum>(qkv, dout, lse, delta, dqkv, sums, s, blockIdx.x,
                                     gridDim.y - 1 - blockIdx.y);
}
/// Both kernels as one grid (they read the same inputs and write different columns of dqkv):
/// the dK/dV blocks, then the dQ blocks, each heaviest first, so that the dQ blocks fill the
/// multiprocessors the last dK/dV blocks leave.
template <class T, int WGS, int KVT, int KVS, bool KVO, int QT, int QS, bool Acc, bool Sum>
__global__ void __launch_bounds__(WGS * 128, WGS == 1 ? 3 : 1)
    attn_backward_wgmma(const T* qkv, const T* dout, const float* lse, const float* delta,
                        T* dqkv, float* sums, attn_shape s, int batch, int blocks) {
  const int kv_rows = batch * s.Hkv, i = static_cast<int>(blockIdx.x);
  if (i < kv_rows * blocks) {
    dkdv_block<T, WGS, KVT, KVS, KVO, Acc, Sum>(qkv, dout, lse, delta, dqkv, sums, s,
                                                i % kv_rows, i / kv_rows);
  } else {
    const int j = i - kv_rows * blocks, q_rows = batch * s.H;
    dq_block<T, WGS, QT, QS, Acc, Sum>(qkv, dout, lse, delta, dqkv, sums, s, j % q_rows,
                                       blocks - 1 - j / q_rows);
  }
}

template <class T, bool Acc, bool Sum, bwd_shape C>
void launch(const void* qkv, const void* dout, const float* lse, const float* delta, void* dqkv,
            float* sums, int batch, const attn_shape& s, cudaStream_t stream) {
  static std::array<std::once_flag, 64> once_kv, once_q, once_both;
  constexpr int rows = C.wgs * 64;
  const int blocks = (s.T + rows - 1) / rows;
  constexpr int smem_kv = 2 * rows * ROWB + C.kv_stages * C.kv_tile * (2 * ROWB + 2 * 4);
  constexpr int smem_q = 2 * rows * ROWB + C.q_stages * C.q_tile * 2 * ROWB;
  const auto* q = static_cast<const T*>(qkv);
  const auto* g = static_cast<const T*>(dout);
  auto* d = static_cast<T*>(dqkv);
  if constexpr (C.fused) {
    auto both = attn_backward_wgmma<T, C.wgs, C.kv_tile, C.kv_stages, C.kv_overlap, C.q_tile,
                                    C.q_stages, Acc, Sum>;
    constexpr int smem = smem_kv > smem_q ? smem_kv : smem_q;
    allow_shared_memory(both, smem, once_both);
    const unsigned grid = static_cast<unsigned>(batch * (s.Hkv + s.H) * blocks);
    both<<<grid, C.wgs * 128, smem, stream>>>(q, g, lse, delta, d, sums, s, batch, blocks);
  } else {
    const auto ub = static_cast<unsigned>(blocks);
    auto dkdv = attn_backward_dkdv_wgmma<T, C.wgs, C.kv_tile, C.kv_stages, C.kv_overlap,
                                         C.q_tile, C.q_stages, Acc, Sum>;
    allow_shared_memory(dkdv, smem_kv, once_kv);
    dkdv<<<dim3(batch * s.Hkv, ub), C.wgs * 128, smem_kv, stream>>>(q, g, lse, delta, d, sums,
                                                                     s);
    TROUPE_CUDA_CHECK(cudaGetLastError());
    auto dq = attn_backward_dq_wgmma<T, C.wgs, C.kv_tile, C.kv_stages, C.kv_overlap, C.q_tile,
                                     C.q_stages, Acc, Sum>;
    allow_shared_memory(dq, smem_q, once_q);
    dq<<<dim3(batch * s.H, ub), C.wgs * 128, smem_q, stream>>>(q, g, lse, delta, d, sums, s);
  }
}

}  // namespace

int attention_backward_sm90_sum_rows(int batch, const attn_shape& s) {
  return batch * ((s.T + 15) / 16);
}

bool attention_backward_sm90(core::dtype type, const void* qkv, const void* dout,
                             const float* lse, const float* delta, void* dqkv, int batch,
                             const attn_shape& s, bool accumulate, float* sums,
                             cudaStream_t stream) {
  if (s.D != D || s.doc || (accumulate && sums)) return false;
  return with_16bit_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (accumulate)
      launch<T, true, false, shipped_shape>(qkv, dout, lse, delta, dqkv, nullptr, batch, s,
                                            stream);
    else if (sums)
      launch<T, false, true, shipped_shape>(qkv, dout, lse, delta, dqkv, sums, batch, s, stream);
    else
      launch<T, false, false, shipped_shape>(qkv, dout, lse, delta, dqkv, nullptr, batch, s,
                                             stream);
  });
}

}  // namespace troupe::kernels::cuda
