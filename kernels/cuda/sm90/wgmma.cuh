// Helpers of the Hopper attention kernels (sm90/attention_fwd.cu, sm90/attention_bwd.cu): 128-byte
// swizzled tiles of 64-element rows loaded with cp.async, shared-memory descriptors, and the two
// warpgroup MMA forms they use (m64n64k16, fp32 accumulators): A and B both K-major in shared
// memory, and A from registers with B N-major in shared memory. Included by sm_90a sources only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "core/tensor.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda::sm90 {

constexpr int D = 64;        // head size (one 128-byte row per key or query)
constexpr int ROWB = D * 2;  // bytes per shared-memory row

// Shared-memory matrix descriptor of a 128-byte-swizzled tile (PTX ISA, "Matrix Descriptor
// Format"): start address, leading and stride byte offsets (16-byte units), swizzle mode 1 (128 B)
// in bits 62–63. K-major Q and K: 8-row core-matrix groups 1024 bytes apart (SBO), the next
// 16-element k step 32 bytes on. N-major V: the next 16 keys 2048 bytes on. Found by running
// candidates against a host product on the H200.
constexpr int LBO = 16, SBO = 1024, QK_KSTEP = 32, PV_KSTEP = 16 * ROWB;

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ std::uint64_t desc(std::uint32_t addr) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<std::uint64_t>(LBO >> 4) << 16) |
         (static_cast<std::uint64_t>(SBO >> 4) << 32) | (1ull << 62);
}

/// The descriptor `bytes` past the one of `d` (the same bits as desc(addr + bytes): shared
/// addresses stay below 2^18, so the address field never carries).
__device__ __forceinline__ std::uint64_t desc_at(std::uint64_t d, int bytes) {
  return d + static_cast<std::uint64_t>(bytes >> 4);
}

/// Starts copying rows [row0, row0 + ROWS) of one head into a swizzled tile, with THREADS threads
/// (a multiple of 64: each pass covers a multiple of 8 rows, so a thread's chunk and swizzle are
/// the same in every pass); rows ≥ T are zeros.
template <int ROWS, int THREADS, class T>
__device__ __forceinline__ void load_tile(unsigned char* dst, const T* base, int stride, int row0,
                                          int T_len) {
  static_assert(THREADS % 64 == 0 && ROWS * 8 % THREADS == 0);
  constexpr int STEP = THREADS / 8;  // rows per pass
  const int c = threadIdx.x % 8, r = threadIdx.x / 8;
  const std::uint32_t d = smem_u32(dst) + r * ROWB + ((c ^ (r % 8)) << 4);
  const T* src = base + static_cast<std::int64_t>(row0 + r) * stride + c * 8;
  const std::int64_t jump = static_cast<std::int64_t>(STEP) * stride;
  const bool whole = row0 + ROWS <= T_len;
#pragma unroll
  for (int i = 0; i < ROWS * 8 / THREADS; ++i) {
    const bool ok = whole || row0 + r + i * STEP < T_len;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d + i * STEP * ROWB),
                 "l"(ok ? src + i * jump : base), "r"(ok ? 16 : 0));
  }
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
/// The cp.async writes of this thread, made visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void fence_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Keeps the compiler from moving accesses to registers that an in-flight wgmma owns.
template <int N>
__device__ __forceinline__ void pin(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  std::uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    u = *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    u = *reinterpret_cast<const std::uint32_t*>(&v);
  }
  return u;
}

#define TROUPE_F8(x, o)                                                                    \
  "+f"(x[o]), "+f"(x[o + 1]), "+f"(x[o + 2]), "+f"(x[o + 3]), "+f"(x[o + 4]), "+f"(x[o + 5]), \
      "+f"(x[o + 6]), "+f"(x[o + 7])
#define TROUPE_F32(x, o) \
  TROUPE_F8(x, o), TROUPE_F8(x, o + 8), TROUPE_F8(x, o + 16), TROUPE_F8(x, o + 24)
#define TROUPE_R32                                                                             \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24," \
  "%25,%26,%27,%28,%29,%30,%31}"
#define TROUPE_R64                                                                             \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24," \
  "%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,"     \
  "%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define TROUPE_WGMMA_SS(n, ty, regs, a, b, acc)                                    \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " acc ", 0;\n"                                 \
  "wgmma.mma_async.sync.aligned.m64n" n "k16.f32." ty "." ty " " regs ", " a ", " b \
  ", p, 1, 1, 0, 0;\n}\n"
#define TROUPE_WGMMA_RS(ty)                                                         \
  "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                        \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." ty "." ty " " TROUPE_R32            \
  ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"

/// d (64 × N) = [d +] A · Bᵀ, A (64 rows) and B (N rows) K-major in shared memory; accumulate 0
/// starts from zero. N is 64 or 128.
template <class T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], std::uint64_t a, std::uint64_t b,
                                         int accumulate) {
  constexpr bool bf = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && bf)
    asm volatile(TROUPE_WGMMA_SS("64", "bf16", TROUPE_R32, "%32", "%33", "%34")
                 : TROUPE_F32(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate));
  else if constexpr (N == 64)
    asm volatile(TROUPE_WGMMA_SS("64", "f16", TROUPE_R32, "%32", "%33", "%34")
                 : TROUPE_F32(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate));
  else if constexpr (N == 128 && bf)
    asm volatile(TROUPE_WGMMA_SS("128", "bf16", TROUPE_R64, "%64", "%65", "%66")
                 : TROUPE_F32(d, 0), TROUPE_F32(d, 32)
                 : "l"(a), "l"(b), "r"(accumulate));
  else
    asm volatile(TROUPE_WGMMA_SS("128", "f16", TROUPE_R64, "%64", "%65", "%66")
                 : TROUPE_F32(d, 0), TROUPE_F32(d, 32)
                 : "l"(a), "l"(b), "r"(accumulate));
  static_assert(N == 64 || N == 128);
}
/// d (64 × 64) += A · B, A from registers, B N-major in shared memory.
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const std::uint32_t (&a)[4],
                                         std::uint64_t b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(TROUPE_WGMMA_RS("bf16")
                 : TROUPE_F32(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  else
    asm volatile(TROUPE_WGMMA_RS("f16")
                 : TROUPE_F32(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

/// Where a thread sits: its warpgroup, its warp in the warpgroup, and lane / 4 and lane % 4 (the
/// row and column pair it holds in an accumulator). The first two are broadcast, so that the
/// compiler knows them warp-uniform: branches on them keep the wgmma instructions asynchronous.
struct thread_place {
  int wg, warp, g, t;
};
__device__ __forceinline__ thread_place place() {
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x % 128) / 32, 0);
  const int lane = threadIdx.x % 32;
  return {wg, warp, lane >> 2, lane & 3};
}

/// a = A1·B1ᵀ and b = A2·B2ᵀ over the head dimension (shared-memory rows of 64 elements, both
/// operands K-major; a1 … b2 their shared addresses), issued as one wgmma group.
template <class T, int N = 64>
__device__ __forceinline__ void wgmma_two_products(float (&a)[N / 2], std::uint32_t a1,
                                                   std::uint32_t b1, float (&b)[N / 2],
                                                   std::uint32_t a2, std::uint32_t b2) {
  const std::uint64_t da1 = desc(a1), db1 = desc(b1), da2 = desc(a2), db2 = desc(b2);
#pragma unroll
  for (int k = 0; k < D / 16; ++k)
    wgmma_ss<T, N>(a, desc_at(da1, k * QK_KSTEP), desc_at(db1, k * QK_KSTEP), k > 0);
#pragma unroll
  for (int k = 0; k < D / 16; ++k)
    wgmma_ss<T, N>(b, desc_at(da2, k * QK_KSTEP), desc_at(db2, k * QK_KSTEP), k > 0);
  wg_commit();
}

/// Calls f with a value of the CUDA type of `type` (bf16 or fp16); false for other types.
template <class F>
bool with_16bit_type(core::dtype type, F&& f) {
  if (type == core::dtype::bf16)
    f(__nv_bfloat16{});
  else if (type == core::dtype::f16)
    f(__half{});
  else
    return false;
  return true;
}

/// Lets `kernel` use `bytes` of dynamic shared memory (more than 48 KB needs it), once per device;
/// `most_shared` also asks for the largest shared-memory share of the multiprocessor's L1.
template <class K>
void allow_shared_memory(K kernel, int bytes, std::array<std::once_flag, 64>& once,
                         bool most_shared = false) {
  int dev = 0;
  TROUPE_CUDA_CHECK(cudaGetDevice(&dev));
  std::call_once(once[static_cast<std::size_t>(dev) % once.size()], [&] {
    TROUPE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (most_shared)
      TROUPE_CUDA_CHECK(cudaFuncSetAttribute(
          kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  });
}

}  // namespace troupe::kernels::cuda::sm90
