// The causal attention forward on Hopper's warpgroup MMA (wgmma, sm_90a only): the same maths,
// layouts and outputs as attention.cu's tensor-core forward (docs/cuda.md, "Attention"), for
// 16-bit types at head size 64. Compiled on its own for sm_90a (kernels/CMakeLists.txt), and used
// only on a device of compute capability 9.0 (context::hopper_attention).
//
// A block holds two warpgroups of 64 query rows (their Q in shared memory) and streams key/value
// tiles of 64 rows through a ring of shared-memory stages. Rows of 64 bf16 are 128 bytes, stored
// with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)) that wgmma's
// shared-memory descriptors read. Two kernels fill the ring: attn_forward_wgmma by cp.async from
// every thread, NS − 2 tiles ahead with one block-wide barrier per tile; attn_forward_tma by the
// TMA from a producer warpgroup, with a full and an empty barrier per stage. `launch` picks one
// by shape (tile_loads); their consumers run the same code, so they give the same bits.
//
// Per warpgroup and tile: S = Q·Kᵀ (both operands from shared memory, K-major) and, while the
// tensor cores run it, nothing else; then O += P·V of the previous tile is issued (P from
// registers: the accumulator layout of S is wgmma's register layout for A, so P never goes
// through shared memory; V is [key][d] in shared memory, i.e. N-major, transposed by the
// instruction) and the online softmax of this tile's scores runs while it is in flight. O is
// rescaled to the new row maximum once that P·V is done. The first tile is peeled off the loop:
// a branch around the wgmma instructions makes ptxas serialise them.
#include "kernels/cuda/attention_sm90.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "core/error.hpp"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/sm90/tma.cuh"
#include "kernels/cuda/sm90/wgmma.cuh"

namespace troupe::kernels::cuda {

namespace {

using namespace sm90;

/// One tile's online softmax, for a warp's 16 rows from row_base (this thread's: + g and + g + 8):
/// masks keys after a row (and, with documents, before its document's start dsr), turns the
/// scores in sc into probabilities against the new running maximum m (log2 domain), and once the
/// previous tile's P·V has landed in O (wg_wait<0>; `pv_done` runs right after) rescales O and the
/// running sum l to that maximum.
template <bool Docs, int SC, class F>
__device__ __forceinline__ void softmax_tile(float (&sc)[SC], float (&o)[32], float (&m)[2],
                                             float (&l)[2], int k0, int row_base, int g, int t,
                                             const int (&dsr)[2], int wmax, float sl2,
                                             F&& pv_done) {
  constexpr int N = 2 * SC;
  // Only a tile holding a key after one of this warp's rows needs the causal mask (keys ≥ T
  // follow every row < T), and only one holding a key before one of its rows' documents the
  // document mask.
  if (k0 + N - 1 > row_base || (Docs && k0 < wmax)) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row_base + g + 8 * (e >> 1), col = k0 + 8 * j + 2 * t + (e & 1);
        if (col > row || (Docs && col < dsr[e >> 1])) sc[4 * j + e] = -INFINITY;
      }
  }
  float corr[2], sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m[r], mx * sl2);
    // A row with no visible key so far keeps m = −inf; ex2 of (−inf) − 0 is 0, never NaN.
    const float bm = mn == -INFINITY ? 0.0f : mn;
    corr[r] = ex2(m[r] - bm);
    m[r] = mn;
    float su = 0.0f;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      sc[4 * j + 2 * r] = ex2(fmaf(sc[4 * j + 2 * r], sl2, -bm));
      sc[4 * j + 2 * r + 1] = ex2(fmaf(sc[4 * j + 2 * r + 1], sl2, -bm));
      su += sc[4 * j + 2 * r] + sc[4 * j + 2 * r + 1];
    }
    sum[r] = su;
  }
  wg_wait<0>();  // the previous tile's P·V is in O: rescale O to this tile's maximum
  pin(o);
  pv_done();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    o[4 * j] *= corr[0];
    o[4 * j + 1] *= corr[0];
    o[4 * j + 2] *= corr[1];
    o[4 * j + 3] *= corr[1];
  }
  l[0] = l[0] * corr[0] + sum[0];
  l[1] = l[1] * corr[1] + sum[1];
}

/// Writes a warp's rows of O / l (16-bit, two columns per 4-byte store) and their lse.
template <class T>
__device__ __forceinline__ void store_rows(T* out, float* lse, const attn_shape& s, int b, int h,
                                           int row_base, int g, int t, const float (&o)[32],
                                           const float (&m)[2], const float (&l)[2]) {
  T* obase = out + static_cast<std::int64_t>(b) * s.T * s.H * D + h * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    const int row = row_base + g + 8 * r;
    if (row >= s.T) continue;
    const float inv = 1.0f / lr;
    T* orow = obase + static_cast<std::int64_t>(row) * s.H * D;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      *reinterpret_cast<std::uint32_t*>(orow + 8 * j + 2 * t) =
          pack2<T>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    if (t == 0) lse[(static_cast<std::int64_t>(b) * s.H + h) * s.T + row] = m[r] * ln2 + logf(lr);
  }
}

/// The forward with its tiles loaded by cp.async from every thread, NS − 2 tiles ahead, one
/// block-wide barrier per tile.
///
/// Accumulator layout (m64nN, fp32): warp w of a warpgroup holds rows 16w + lane/4 and 16w +
/// lane/4 + 8; its register 4j + e is column 8j + 2(lane % 4) + (e & 1) of the row + 8(e >> 1).
template <class T, int WGS, int N, int NS, bool Docs>
__global__ void __launch_bounds__(WGS * 128, 1)
    attn_forward_wgmma(const T* qkv, T* out, float* lse, attn_shape s) {
  static_assert(NS >= 3 && N % 16 == 0);
  constexpr int BM = WGS * 64, PF = NS - 2, SC = N / 2;
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sq = smem;
  unsigned char* sk = sq + BM * ROWB;
  unsigned char* sv = sk + NS * N * ROWB;
  const int qb = gridDim.y - 1 - blockIdx.y;  // heaviest (last) query blocks first
  const int b = blockIdx.x / s.H, h = blockIdx.x % s.H, kvh = h / (s.H / s.Hkv);
  const auto [wg, warp, g, t] = place();
  const int q0 = qb * BM;
  const int row_base = q0 + wg * 64 + warp * 16;  // this warp's rows: row_base + g, + 8
  const int n_kt = (min(s.T, q0 + BM) - 1) / N + 1;
  const int my_last = (min(s.T, q0 + wg * 64 + 64) - 1) / N;  // this warpgroup's last tile
  const T* base = qkv + static_cast<std::int64_t>(b) * s.T * s.W;
  const T* kbase = base + (s.H + kvh) * D;
  const T* vbase = base + (s.H + s.Hkv + kvh) * D;
  const int* doc = Docs ? doc_row(s, b) : nullptr;
  const int kt0 = Docs ? block_min_start(doc, q0, BM, s.T) / N : 0;
  int dsr[2] = {0, 0}, wmax = 0;  // this thread's rows' document starts, the warp's largest
  if constexpr (Docs) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_base + g + 8 * r;
      dsr[r] = row < s.T ? doc[row] : 0;
    }
    wmax = __reduce_max_sync(0xffffffffu, max(dsr[0], dsr[1]));
  }
  load_tile<BM, WGS * 128>(sq, base + h * D, s.W, q0, s.T);
#pragma unroll
  for (int p = 0; p < PF; ++p) {
    if (kt0 + p < n_kt) {
      const int st = (kt0 + p) % NS;
      load_tile<N, WGS * 128>(sk + st * N * ROWB, kbase, s.W, (kt0 + p) * N, s.T);
      load_tile<N, WGS * 128>(sv + st * N * ROWB, vbase, s.W, (kt0 + p) * N, s.T);
    }
    cp_commit();
  }
  float o[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2), sum
  const float sl2 = s.scale * log2e;
  const std::uint64_t qd = desc(smem_u32(sq + wg * 64 * ROWB));
  float sc[SC];                 // this tile's scores, then probabilities
  std::uint32_t pa[N / 16][4];  // the previous tile's probabilities as A fragments
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = pack2<T>(sc[8 * kk + 2 * e], sc[8 * kk + 2 * e + 1]);
  };
  auto issue_pv = [&](int tile) {
    const std::uint64_t vd = desc(smem_u32(sv + (tile % NS) * N * ROWB));
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) wgmma_rs<T>(o, pa[kk], desc_at(vd, kk * PV_KSTEP));
    wg_commit();
  };
  auto step = [&](int kt, auto first) {
    constexpr bool First = decltype(first)::value;
    cp_wait<PF - 1>();  // tile kt has landed for this thread (later ones may be in flight)
    fence_async();
    __syncthreads();    // ... for every thread; and every warpgroup is done with tile kt − 1
    if (kt + PF < n_kt) {
      const int st = (kt + PF) % NS;  // held tile kt − 2, which no warpgroup reads any more
      load_tile<N, WGS * 128>(sk + st * N * ROWB, kbase, s.W, (kt + PF) * N, s.T);
      load_tile<N, WGS * 128>(sv + st * N * ROWB, vbase, s.W, (kt + PF) * N, s.T);
    }
    cp_commit();
    if (kt > my_last) {  // past this warpgroup's rows: finish the previous tile's P·V, once
      if (!First && kt == my_last + 1) {
        pack_p();
        wg_fence();
        issue_pv(kt - 1);
        wg_wait<0>();
        pin(o);
      }
      return;
    }
    const std::uint64_t kd = desc(smem_u32(sk + (kt % NS) * N * ROWB));
    if constexpr (!First) pack_p();
    wg_fence();
#pragma unroll
    for (int k = 0; k < D / 16; ++k)
      wgmma_ss<T, 64>(sc, desc_at(qd, k * QK_KSTEP), desc_at(kd, k * QK_KSTEP), k > 0);
    wg_commit();
    if constexpr (!First) {
      issue_pv(kt - 1);
      wg_wait<1>();  // S is done; the P·V may still run
    } else {
      wg_wait<0>();
    }
    pin(sc);
    softmax_tile<Docs>(sc, o, m, l, kt * N, row_base, g, t, dsr, wmax, sl2, [] {});
  };
  step(kt0, std::true_type{});
  for (int kt = kt0 + 1; kt < n_kt; ++kt) step(kt, std::false_type{});
  if (my_last == n_kt - 1) {  // the last tile's P·V
    pack_p();
    wg_fence();
    issue_pv(n_kt - 1);
    wg_wait<0>();
    pin(o);
  }
  cp_wait<0>();
  store_rows(out, lse, s, b, h, row_base, g, t, o, m, l);
}

/// The same forward with its tiles loaded by the TMA from a producer warpgroup, which gives its
/// registers to the two consumer warpgroups of 64 query rows (setmaxnreg: 80 at launch, so two
/// blocks share a multiprocessor, 24 for the producer and 104 for the consumers, which is what the
/// 7 KB it gives up buys). The consumers wait only for the tiles they read (a full barrier per
/// stage, the TMA's bytes counted on it) and free each stage once their P·V of it is done (an
/// empty barrier per stage, one arrival per consumer warp): no block-wide barrier per tile, and no
/// load instructions among the consumers'. Its step loop is attn_forward_wgmma's with the waits
/// and releases changed; one consumer function shared by both kernels made this one 3 % slower
/// (docs/cuda.md).
template <class T, int NS, bool Docs>
__global__ void __launch_bounds__(384, 2)
    attn_forward_tma(const __grid_constant__ CUtensorMap map, T* out, float* lse, attn_shape s) {
  static_assert(NS >= 2);
  constexpr int WGS = 2, BM = WGS * 64, N = 64, SC = N / 2;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_u32(smem_raw) % 1024) % 1024);
  unsigned char* sq = smem;
  unsigned char* sk = sq + BM * ROWB;
  unsigned char* sv = sk + NS * N * ROWB;
  const std::uint32_t q_full = smem_u32(sv + NS * N * ROWB);  // then full[NS], empty[NS]
  const auto full_bar = [&](int st) { return q_full + 8 * (1 + st); };
  const auto empty_bar = [&](int st) { return q_full + 8 * (1 + NS + st); };
  const int qb = gridDim.y - 1 - blockIdx.y;  // heaviest (last) query blocks first
  const int b = blockIdx.x / s.H, h = blockIdx.x % s.H, kvh = h / (s.H / s.Hkv);
  const int q0 = qb * BM;
  const int n_kt = (min(s.T, q0 + BM) - 1) / N + 1;
  const int* doc = Docs ? doc_row(s, b) : nullptr;
  const int kt0 = Docs ? block_min_start(doc, q0, BM, s.T) / N : 0;
  if (threadIdx.x == 0) {
    bar_init(q_full, 1);
    for (int st = 0; st < NS; ++st) {
      bar_init(full_bar(st), 1);
      bar_init(empty_bar(st), WGS * 4);
    }
    bar_init_fence();
  }
  __syncthreads();
  if (__shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0) == WGS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == WGS * 128) {  // the producer
      tma_prefetch_map(&map);
      bar_expect_bytes(q_full, BM * ROWB);
      for (int w = 0; w < WGS; ++w)
        tma_load_3d(smem_u32(sq + w * 64 * ROWB), &map, q_full, h * D, q0 + w * 64, b);
      for (int kt = kt0; kt < n_kt; ++kt) {
        const int i = kt - kt0, st = i % NS;
        if (i >= NS) bar_wait(empty_bar(st), (i / NS - 1) & 1);
        bar_expect_bytes(full_bar(st), 2 * N * ROWB);
        tma_load_3d(smem_u32(sk + st * N * ROWB), &map, full_bar(st), (s.H + kvh) * D, kt * N, b);
        tma_load_3d(smem_u32(sv + st * N * ROWB), &map, full_bar(st), (s.H + s.Hkv + kvh) * D,
                    kt * N, b);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 104;\n" ::: "memory");
  const auto [wg, warp, g, t] = place();
  const int row_base = q0 + wg * 64 + warp * 16;  // this warp's rows: row_base + g, + 8
  const int my_last = (min(s.T, q0 + wg * 64 + 64) - 1) / N;  // this warpgroup's last tile
  int dsr[2] = {0, 0}, wmax = 0;  // this thread's rows' document starts, the warp's largest
  if constexpr (Docs) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_base + g + 8 * r;
      dsr[r] = row < s.T ? doc[row] : 0;
    }
    wmax = __reduce_max_sync(0xffffffffu, max(dsr[0], dsr[1]));
  }
  const auto stage = [&](int kt) { return (kt - kt0) % NS; };
  const auto release = [&](int kt) {
    if (g == 0 && t == 0) bar_arrive(empty_bar(stage(kt)));
  };
  float o[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2), sum
  const float sl2 = s.scale * log2e;
  const std::uint64_t qd = desc(smem_u32(sq + wg * 64 * ROWB));
  float sc[SC];                 // this tile's scores, then probabilities
  std::uint32_t pa[N / 16][4];  // the previous tile's probabilities as A fragments
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = pack2<T>(sc[8 * kk + 2 * e], sc[8 * kk + 2 * e + 1]);
  };
  auto issue_pv = [&](int tile) {
    const std::uint64_t vd = desc(smem_u32(sv + stage(tile) * N * ROWB));
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) wgmma_rs<T>(o, pa[kk], desc_at(vd, kk * PV_KSTEP));
    wg_commit();
  };
  bar_wait(q_full, 0);
  auto step = [&](int kt, auto first) {
    constexpr bool First = decltype(first)::value;
    if (kt > my_last) {  // past this warpgroup's rows: finish the previous tile's P·V, once
      if (!First && kt == my_last + 1) {
        pack_p();
        wg_fence();
        issue_pv(kt - 1);
        wg_wait<0>();
        pin(o);
        release(kt - 1);
      }
      release(kt);  // a tile this warpgroup does not read
      return;
    }
    bar_wait(full_bar(stage(kt)), ((kt - kt0) / NS) & 1);
    const std::uint64_t kd = desc(smem_u32(sk + stage(kt) * N * ROWB));
    if constexpr (!First) pack_p();
    wg_fence();
#pragma unroll
    for (int k = 0; k < D / 16; ++k)
      wgmma_ss<T, 64>(sc, desc_at(qd, k * QK_KSTEP), desc_at(kd, k * QK_KSTEP), k > 0);
    wg_commit();
    if constexpr (!First) {
      issue_pv(kt - 1);
      wg_wait<1>();  // S is done; the P·V may still run
    } else {
      wg_wait<0>();
    }
    pin(sc);
    softmax_tile<Docs>(sc, o, m, l, kt * N, row_base, g, t, dsr, wmax, sl2, [&] {
      if constexpr (!First) release(kt - 1);
    });
  };
  step(kt0, std::true_type{});
  for (int kt = kt0 + 1; kt < n_kt; ++kt) step(kt, std::false_type{});
  if (my_last == n_kt - 1) {  // the last tile's P·V
    pack_p();
    wg_fence();
    issue_pv(n_kt - 1);
    wg_wait<0>();
    pin(o);
    release(n_kt - 1);
  }
  store_rows(out, lse, s, b, h, row_base, g, t, o, m, l);
}

// The block shape: 2 warpgroups (128 query rows), key tiles of 64, 4 stages (80 KB), one block per
// multiprocessor. Measured on the H200 at GPT-2 124M's shape against 3 warpgroups, key tiles of
// 128 and 3 stages (docs/cuda.md).
constexpr int fwd_wgs = 2, fwd_n = 64, fwd_ns = 4;
// The TMA kernel's stages (4 × 16 KB of keys and values beside 16 KB of Q, two blocks per
// multiprocessor; 3 stages measured the same, 6 leave room for one block only).
constexpr int tma_ns = 4;

template <class T, bool Docs>
bool launch_tma(const void* qkv, void* out, float* lse, int batch, const attn_shape& s,
                cudaStream_t stream) {
  CUtensorMap map;
  if (!encode_rows_map(&map, std::is_same_v<T, __nv_bfloat16>, qkv, s.W, s.T, batch, 64))
    return false;
  auto kernel = attn_forward_tma<T, tma_ns, Docs>;
  constexpr int smem = (2 * 64 + 2 * tma_ns * 64) * ROWB + 1024 + 8 * (1 + 2 * tma_ns);
  static std::array<std::once_flag, 64> once;
  allow_shared_memory(kernel, smem, once, true);  // two blocks' 166 KB
  const dim3 grid(batch * s.H, (s.T + 127) / 128);
  kernel<<<grid, 384, smem, stream>>>(map, static_cast<T*>(out), lse, s);
  return true;
}

template <class T, bool Docs>
void launch(const void* qkv, void* out, float* lse, int batch, const attn_shape& s,
            tile_loads loads, cudaStream_t stream) {
  // Measured on the H200 (docs/cuda.md): the TMA kernel is ahead where key/value heads are shared
  // and from T = 2048 on, the cp.async kernel for shorter sequences with a key/value head per
  // query head (GPT-2 124M's shape: 0.0863 against 0.0887 ms).
  // Chosen by shape, a tensor the TMA cannot read goes to the cp.async kernel; asked for by
  // TROUPE_CUDA_ATTENTION=tma, it is an error rather than a silent change of kernel.
  const bool forced = loads == tile_loads::tma;
  if (loads == tile_loads::by_shape)
    loads = s.Hkv < s.H || s.T >= 2048 ? tile_loads::tma : tile_loads::cp_async;
  if (loads == tile_loads::tma) {
    if (launch_tma<T, Docs>(qkv, out, lse, batch, s, stream)) return;
    if (forced)
      throw core::failure(
          "attention forward: TROUPE_CUDA_ATTENTION=tma, but the TMA cannot read the qkv tensor "
          "(an address not 16-byte aligned, or a driver without cuTensorMapEncodeTiled); unset "
          "it to let the forward choose (docs/cuda.md)");
  }
  auto kernel = attn_forward_wgmma<T, fwd_wgs, fwd_n, fwd_ns, Docs>;
  constexpr int smem = (fwd_wgs * 64 + 2 * fwd_ns * fwd_n) * ROWB;
  static std::array<std::once_flag, 64> once;
  allow_shared_memory(kernel, smem, once);
  const dim3 grid(batch * s.H, (s.T + fwd_wgs * 64 - 1) / (fwd_wgs * 64));
  kernel<<<grid, fwd_wgs * 128, smem, stream>>>(static_cast<const T*>(qkv), static_cast<T*>(out),
                                                 lse, s);
}

}  // namespace

bool attention_forward_sm90(core::dtype type, const void* qkv, void* out, float* lse, int batch,
                            const attn_shape& s, tile_loads loads, cudaStream_t stream) {
  if (s.D != D) return false;
  return with_16bit_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (s.doc)
      launch<T, true>(qkv, out, lse, batch, s, loads, stream);
    else
      launch<T, false>(qkv, out, lse, batch, s, loads, stream);
  });
}

}  // namespace troupe::kernels::cuda
