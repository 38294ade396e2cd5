// What both attention kernel files share (attention.cu, and the Hopper forward in
// sm90/attention_fwd.cu): the geometry, and the document starts of packed sequences.
#pragma once

#include <climits>
#include <cstdint>

namespace troupe::kernels::cuda {

inline constexpr float log2e = 1.4426950408889634f;
inline constexpr float ln2 = 0.6931471805599453f;

/// Geometry shared by the kernels.
struct attn_shape {
  int T;        // sequence length
  int H;        // query heads
  int Hkv;      // key/value heads
  int D;        // head size
  int W;        // qkv row width (H + 2·Hkv)·D
  float scale;  // 1/√D
  const int* doc = nullptr;  // attention_dims::doc_start (int32 [B·T] on the device), or null
};

// ---- packed documents ---------------------------------------------------------------------------
// With s.doc, query t of sequence b sees keys doc[b·T + t] … t. Blocks start their key loop at the
// tile holding the smallest start of their rows (the key tiles before it are never loaded) and
// mask keys before a row's start inside the tiles they do visit; the dK/dV kernels skip query
// tiles none of whose queries sees one of the block's keys. Without documents every start is 0.

/// Sequence b's row of document starts, or null without documents.
__device__ __forceinline__ const int* doc_row(const attn_shape& s, int b) {
  return s.doc ? s.doc + static_cast<std::int64_t>(b) * s.T : nullptr;
}

/// Where row t's document starts (t < T), 0 without documents.
__device__ __forceinline__ int doc_at(const int* doc, int t) { return doc ? doc[t] : 0; }

/// The smallest document start of rows [r0, r0 + n) ∩ [0, T) of one sequence (0 without
/// documents). Every thread of the block calls it (two barriers).
__device__ __forceinline__ int block_min_start(const int* doc, int r0, int n, int T_len) {
  if (!doc) return 0;
  __shared__ int smin;
  if (threadIdx.x == 0) smin = INT_MAX;
  __syncthreads();
  int v = INT_MAX;
  for (int r = threadIdx.x; r < n; r += blockDim.x)
    if (r0 + r < T_len) v = min(v, doc[r0 + r]);
  v = __reduce_min_sync(0xffffffffu, v);
  if (threadIdx.x % 32 == 0) atomicMin(&smin, v);
  __syncthreads();
  return smin;
}

/// Whether one of the queries [q0, q0 + n) ∩ [0, T) sees one of the keys [k_first, k_last]
/// (n <= blockDim.x): a query before k_first sees none of them (causal), one whose document starts
/// after k_last neither. Every thread of the block calls it (one barrier); true without documents.
__device__ __forceinline__ bool block_sees(const int* doc, int q0, int n, int T_len, int k_first,
                                           int k_last) {
  if (!doc) return true;
  const int q = q0 + static_cast<int>(threadIdx.x);
  const bool p = static_cast<int>(threadIdx.x) < n && q < T_len && q >= k_first && doc[q] <= k_last;
  return __syncthreads_or(p) != 0;
}

}  // namespace troupe::kernels::cuda
