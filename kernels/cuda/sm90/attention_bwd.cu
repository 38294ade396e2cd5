// The causal attention backward on Hopper's warpgroup MMA (sm_90a only): the same maths and the
// same two-kernel structure as attention.cu's tensor-core backward (docs/cuda.md, "Attention"),
// for 16-bit types at head size 64 without packed documents. Each gradient element has one
// writer and a fixed order of additions, so the result is the same bits on every run.
//
// dK/dV kernel: a block owns WGS·64 keys of one kv head (their K and V in shared memory) and
// streams tiles of 64 queries, of every query head of the group in head order, through a ring of
// NS stages (Q, dO, lse, Δ). Per warpgroup (64 keys) and tile: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (both
// operands from shared memory), Pᵀ = exp(Sᵀ·scale − lse), dSᵀ = Pᵀ ∘ (dPᵀ − Δ), then dV += Pᵀ·dO
// and dK += dSᵀ·Q with Pᵀ and dSᵀ from registers (the accumulator layout is the A operand's) and
// dO, Q N-major from the same stage. Those two are issued with the next tile's Sᵀ and dPᵀ, so the
// exponentials of one tile run while the tensor cores finish the previous one.
//
// dQ kernel: a block owns WGS·64 queries of one head (Q and dO in shared memory) and streams
// tiles of 64 keys (K, V): S = Q·Kᵀ, dP = dO·Vᵀ, P, dS as above, dQ += dS·K (K N-major).
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

constexpr int TILE = 64;  // queries (dK/dV kernel) or keys (dQ kernel) per streamed tile

template <int N>
__device__ __forceinline__ void pin_u(std::uint32_t (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(x[i][e])::"memory");
}

/// Starts copying n floats from src (n ≤ blockDim.x; entries at or past `valid` are zeros).
__device__ __forceinline__ void load_floats(float* dst, const float* src, int n, int valid) {
  const int i = threadIdx.x;
  if (i < n) {
    const bool ok = i < valid;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst + i)),
                 "l"(src + (ok ? i : 0)), "r"(ok ? 4 : 0));
  }
}

/// Packs an fp32 accumulator (m64n64) into the A fragments of the next wgmma (16-bit).
template <class T>
__device__ __forceinline__ void pack_a(std::uint32_t (&a)[TILE / 16][4], const float (&x)[32]) {
#pragma unroll
  for (int kk = 0; kk < TILE / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[kk][e] = pack2<T>(x[8 * kk + 2 * e], x[8 * kk + 2 * e + 1]);
}

template <bool Acc, class T>
__device__ __forceinline__ float earlier(const T* p) {
  if constexpr (Acc) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return __bfloat162float(*p);
    else
      return __half2float(*p);
  } else {
    return 0.0f;
  }
}
template <class T>
__device__ __forceinline__ T to_t(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(x);
  else
    return __float2half_rn(x);
}

/// Adds (Acc) or writes a warp's m64n64 accumulator rows, times `mul`, into rows of `dst`
/// (row stride `stride`); rows ≥ T are not written.
template <bool Acc, class T>
__device__ __forceinline__ void store_rows(T* dst, std::int64_t stride, const float (&x)[32],
                                           float mul, int row_base, int T_len) {
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_base + g + 8 * r;
    if (row >= T_len) continue;
    T* p = dst + static_cast<std::int64_t>(row) * stride;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = 8 * j + 2 * t;
      p[c] = to_t<T>(earlier<Acc>(p + c) + x[4 * j + 2 * r] * mul);
      p[c + 1] = to_t<T>(earlier<Acc>(p + c + 1) + x[4 * j + 2 * r + 1] * mul);
    }
  }
}

template <class T, int WGS, int NS, bool Acc>
__global__ void __launch_bounds__(WGS * 128, 1)
    attn_backward_dkdv_wgmma(const T* qkv, const T* dout, const float* lse, const float* delta,
                             T* dqkv, attn_shape s) {
  static_assert(NS >= 3);
  constexpr int BK = WGS * 64, PF = NS - 2, TB = TILE * ROWB;
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sk = smem;
  unsigned char* sv = sk + BK * ROWB;
  unsigned char* sq = sv + BK * ROWB;  // NS stages of TILE rows
  unsigned char* sg = sq + NS * TB;    // dO, NS stages
  float* sl = reinterpret_cast<float*>(sg + NS * TB);  // lse of each stage's queries
  float* sd = sl + NS * TILE;                          // Δ
  const int kb = blockIdx.y;  // the first key blocks see the most queries: launched first
  const int b = blockIdx.x / s.Hkv, kvh = blockIdx.x % s.Hkv, group = s.H / s.Hkv;
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
    load_tile(sq + st * TB, base + h * D, s.W, q0, TILE, s.T);
    load_tile(sg + st * TB, obase + h * D, s.H * D, q0, TILE, s.T);
    const std::int64_t row = (static_cast<std::int64_t>(b) * s.H + h) * s.T + q0;
    load_floats(sl + st * TILE, lse + row, TILE, s.T - q0);
    load_floats(sd + st * TILE, delta + row, TILE, s.T - q0);
  };
  load_tile(sk, base + (s.H + kvh) * D, s.W, k0, BK, s.T);
  load_tile(sv, base + (s.H + s.Hkv + kvh) * D, s.W, k0, BK, s.T);
#pragma unroll
  for (int p = 0; p < PF; ++p) {
    if (p < items) load_item(p);
    cp_commit();
  }
  float dk[32], dv[32], sc[32], dp[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.0f;
  std::uint32_t pa[TILE / 16][4], da[TILE / 16][4];
  const std::uint32_t kaddr = smem_u32(sk + wg * 64 * ROWB);
  const std::uint32_t vaddr = smem_u32(sv + wg * 64 * ROWB);
  auto issue_grads = [&](int item) {  // dV += Pᵀ·dO, dK += dSᵀ·Q of `item`
    const int st = item % NS;
    const std::uint32_t gaddr = smem_u32(sg + st * TB), qaddr = smem_u32(sq + st * TB);
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) wgmma_rs<T>(dv, pa[kk], desc(gaddr + kk * PV_KSTEP));
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) wgmma_rs<T>(dk, da[kk], desc(qaddr + kk * PV_KSTEP));
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
    if constexpr (!First) {
      pack_a<T>(pa, sc);
      pack_a<T>(da, dp);
    }
    wg_fence();
    wgmma_two_products<T>(sc, kaddr, qaddr, dp, vaddr, gaddr);
    if constexpr (!First) {
      issue_grads(item - 1);
      wg_wait<1>();
    } else {
      wg_wait<0>();
    }
    pin(sc);
    pin(dp);
    // Rows are this warp's keys, columns the tile's queries. Queries before a key, and queries
    // ≥ T (zero rows whose lse and Δ read as 0), exist only near the diagonal and in the last tile.
    const bool masked = q0 < key_base + 15 || q0 + TILE > s.T;
    const float* ls = sl + st * TILE;
    const float* dl = sd + st * TILE;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = 8 * j + 2 * t + (e & 1);
        float pv = ex2(fmaf(sc[4 * j + e], sl2, -ls[qc] * log2e));
        if (masked) {
          const int q = q0 + qc, key = key_base + g + 8 * (e >> 1);
          if (q < key || q >= s.T) pv = 0.0f;
        }
        sc[4 * j + e] = pv;
        dp[4 * j + e] = pv * (dp[4 * j + e] - dl[qc]);  // dSᵀ
      }
    wg_wait<0>();
    pin(dk);
    pin(dv);
  };
  step(0, std::true_type{});
  for (int item = 1; item < items; ++item) step(item, std::false_type{});
  pack_a<T>(pa, sc);
  pack_a<T>(da, dp);
  wg_fence();
  issue_grads(items - 1);
  wg_wait<0>();
  pin(dk);
  pin(dv);
  cp_wait<0>();
  T* dbase = dqkv + static_cast<std::int64_t>(b) * s.T * s.W;
  store_rows<Acc>(dbase + (s.H + kvh) * D, s.W, dk, s.scale, key_base, s.T);
  store_rows<Acc>(dbase + (s.H + s.Hkv + kvh) * D, s.W, dv, 1.0f, key_base, s.T);
}

template <class T, int WGS, int NS, bool Acc>
__global__ void __launch_bounds__(WGS * 128, 1)
    attn_backward_dq_wgmma(const T* qkv, const T* dout, const float* lse, const float* delta,
                           T* dqkv, attn_shape s) {
  static_assert(NS >= 3);
  constexpr int BM = WGS * 64, PF = NS - 2, TB = TILE * ROWB;
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sq = smem;
  unsigned char* sg = sq + BM * ROWB;
  unsigned char* sk = sg + BM * ROWB;  // NS stages of TILE keys
  unsigned char* sv = sk + NS * TB;
  const int qb = gridDim.y - 1 - blockIdx.y;  // heaviest (last) query blocks first
  const int b = blockIdx.x / s.H, h = blockIdx.x % s.H, kvh = h / (s.H / s.Hkv);
  const auto [wg, warp, g, t] = place();
  const int q0 = qb * BM;
  const int row_base = q0 + wg * 64 + warp * 16;
  const int n_kt = (min(s.T, q0 + BM) - 1) / TILE + 1;
  const int my_last = (min(s.T, q0 + wg * 64 + 64) - 1) / TILE;
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* kbase = base + (s.H + kvh) * D;
  const T* vbase = base + (s.H + s.Hkv + kvh) * D;
  const float sl2 = s.scale * log2e;
  load_tile(sq, base + h * D, s.W, q0, BM, s.T);
  load_tile(sg, dout + static_cast<std::int64_t>(b) * s.T * s.H * D + h * D, s.H * D, q0, BM,
            s.T);
#pragma unroll
  for (int p = 0; p < PF; ++p) {
    if (p < n_kt) {
      load_tile(sk + (p % NS) * TB, kbase, s.W, p * TILE, TILE, s.T);
      load_tile(sv + (p % NS) * TB, vbase, s.W, p * TILE, TILE, s.T);
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
  float dq[32], sc[32], dp[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) dq[i] = 0.0f;
  std::uint32_t da[TILE / 16][4];
  const std::uint32_t qaddr = smem_u32(sq + wg * 64 * ROWB);
  const std::uint32_t gaddr = smem_u32(sg + wg * 64 * ROWB);
  auto issue_dq = [&](int tile) {  // dQ += dS·K of `tile`
    const std::uint32_t kaddr = smem_u32(sk + (tile % NS) * TB);
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) wgmma_rs<T>(dq, da[kk], desc(kaddr + kk * PV_KSTEP));
    wg_commit();
  };
  auto step = [&](int kt, auto first) {
    constexpr bool First = decltype(first)::value;
    cp_wait<PF - 1>();
    fence_async();
    __syncthreads();
    if (kt + PF < n_kt) {
      const int st = (kt + PF) % NS;
      load_tile(sk + st * TB, kbase, s.W, (kt + PF) * TILE, TILE, s.T);
      load_tile(sv + st * TB, vbase, s.W, (kt + PF) * TILE, TILE, s.T);
    }
    cp_commit();
    if (kt > my_last) {  // past this warpgroup's rows: finish the previous tile's dQ, once
      if (!First && kt == my_last + 1) {
        pack_a<T>(da, dp);
        wg_fence();
        issue_dq(kt - 1);
        wg_wait<0>();
        pin(dq);
      }
      return;
    }
    const int st = kt % NS;
    const std::uint32_t kaddr = smem_u32(sk + st * TB), vaddr = smem_u32(sv + st * TB);
    if constexpr (!First) pack_a<T>(da, dp);
    wg_fence();
    wgmma_two_products<T>(sc, qaddr, kaddr, dp, gaddr, vaddr);
    if constexpr (!First) {
      issue_dq(kt - 1);
      wg_wait<1>();
    } else {
      wg_wait<0>();
    }
    pin(sc);
    pin(dp);
    const int k0 = kt * TILE;
    const bool masked = k0 + TILE - 1 > row_base;  // a key after one of this warp's rows
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float pv = ex2(fmaf(sc[4 * j + e], sl2, -lr[r]));
        if (masked && k0 + 8 * j + 2 * t + (e & 1) > row_base + g + 8 * r) pv = 0.0f;
        dp[4 * j + e] = pv * (dp[4 * j + e] - dr[r]);  // dS
      }
    wg_wait<0>();
    pin(dq);
  };
  step(0, std::true_type{});
  for (int kt = 1; kt < n_kt; ++kt) step(kt, std::false_type{});
  if (my_last == n_kt - 1) {
    pack_a<T>(da, dp);
    wg_fence();
    issue_dq(n_kt - 1);
    wg_wait<0>();
    pin(dq);
  }
  cp_wait<0>();
  store_rows<Acc>(dqkv + static_cast<std::int64_t>(b) * s.T * s.W + h * D, s.W, dq, s.scale,
                  row_base, s.T);
}

// Block shapes: two warpgroups (128 keys or queries), one block per multiprocessor; the dK/dV
// kernel's ring has 3 stages (82 KB; with 4, 98 KB, it took 0.319 instead of 0.275 ms at GPT-2
// 124M's shape on the H200), the dQ kernel's 4.
constexpr int bwd_wgs = 2, dkdv_ns = 3, dq_ns = 4;

template <class T, bool Acc>
void launch(const void* qkv, const void* dout, const float* lse, const float* delta, void* dqkv,
            int batch, const attn_shape& s, cudaStream_t stream) {
  static std::array<std::once_flag, 64> once_kv, once_q;
  constexpr int rows = bwd_wgs * 64, tb = TILE * ROWB;
  const unsigned blocks = static_cast<unsigned>((s.T + rows - 1) / rows);
  auto dkdv = attn_backward_dkdv_wgmma<T, bwd_wgs, dkdv_ns, Acc>;
  constexpr int smem_kv = 2 * rows * ROWB + dkdv_ns * (2 * tb + 2 * TILE * 4);
  allow_shared_memory(dkdv, smem_kv, once_kv);
  dkdv<<<dim3(batch * s.Hkv, blocks), bwd_wgs * 128, smem_kv, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(dout), lse, delta, static_cast<T*>(dqkv),
      s);
  TROUPE_CUDA_CHECK(cudaGetLastError());
  auto dq = attn_backward_dq_wgmma<T, bwd_wgs, dq_ns, Acc>;
  constexpr int smem_q = 2 * rows * ROWB + dq_ns * 2 * tb;
  allow_shared_memory(dq, smem_q, once_q);
  dq<<<dim3(batch * s.H, blocks), bwd_wgs * 128, smem_q, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(dout), lse, delta, static_cast<T*>(dqkv),
      s);
}

}  // namespace

bool attention_backward_sm90(core::dtype type, const void* qkv, const void* dout,
                             const float* lse, const float* delta, void* dqkv, int batch,
                             const attn_shape& s, bool accumulate, cudaStream_t stream) {
  if (s.D != D || s.doc) return false;
  return with_16bit_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (accumulate)
      launch<T, true>(qkv, dout, lse, delta, dqkv, batch, s, stream);
    else
      launch<T, false>(qkv, dout, lse, delta, dqkv, batch, s, stream);
  });
}

}  // namespace troupe::kernels::cuda
