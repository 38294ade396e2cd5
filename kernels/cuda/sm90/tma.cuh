// Hopper's tensor memory accelerator (TMA) and the shared-memory barriers that count its bytes, for
// the sm_90a attention kernels: a tensor map over the qkv activations (made on the host), the
// bulk tile copy that lands a 128-byte-swizzled tile in shared memory, and mbarrier wait/arrive.
// Included by sm_90a sources only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace troupe::kernels::cuda::sm90 {

// ---- shared-memory barriers (PTX ISA, "mbarrier") --------------------------------------------

__device__ __forceinline__ void bar_init(std::uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
/// Makes the barriers' initialisation visible to the TMA unit (then a block-wide barrier).
__device__ __forceinline__ void bar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/// One arrival that also tells the barrier to wait for `bytes` more bytes of bulk copies.
__device__ __forceinline__ void bar_expect_bytes(std::uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void bar_wait(std::uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- TMA ------------------------------------------------------------------------------------

/// Copies the box at element coordinates (x, y, z) of `map` into shared memory at `dst` (1024-byte
/// aligned for the 128-byte swizzle), counting its bytes on barrier `bar`. Elements outside the
/// tensor are written as zeros.
__device__ __forceinline__ void tma_load_3d(std::uint32_t dst, const CUtensorMap* map,
                                            std::uint32_t bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(map))
               : "memory");
}

/// A tensor map over rows of `width` 16-bit elements, `rows` rows per sequence and `batch`
/// sequences (row stride `width`), read in boxes of 64 elements × `box_rows` rows with the
/// 128-byte swizzle of wgmma's descriptors. Returns false (the map untouched) where the TMA cannot
/// read the tensor: an address not 16-byte aligned, or a driver without cuTensorMapEncodeTiled.
bool encode_rows_map(CUtensorMap* map, bool bf16, const void* base, int width, int rows, int batch,
                     int box_rows);

}  // namespace troupe::kernels::cuda::sm90
