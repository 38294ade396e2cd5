// Deterministic column sums out[c] += Σ_r f(r, c), used for the gradients of norm weights and
// biases. Atomics would make the order of additions depend on scheduling; instead the rows are cut
// into fixed chunks (the cut depends only on the row count), one thread per (column, chunk) adds its
// chunk's rows in order into fp32 partials, and a second kernel adds the partials of each column in
// a fixed order (column_total). Threads of a warp own adjacent columns, so every row read is
// coalesced.
#pragma once

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

/// F: `__device__ void operator()(std::int64_t r, int c, float (&acc)[NOUT]) const` adds row r's
/// terms of column c into acc.
template <int NOUT, class F>
__global__ void column_partial_kernel(F f, std::int64_t rows, int cols, std::int64_t chunk_rows,
                                      float* partial) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int chunk = blockIdx.y, chunks = gridDim.y;
  const std::int64_t r0 = chunk * chunk_rows;
  const std::int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float acc[NOUT];
#pragma unroll
  for (int o = 0; o < NOUT; ++o) acc[o] = 0.0f;
  for (std::int64_t r = r0; r < r1; ++r) f(r, c, acc);
#pragma unroll
  for (int o = 0; o < NOUT; ++o)
    partial[(static_cast<std::int64_t>(o) * chunks + chunk) * cols + c] = acc[o];
}

/// Partial column sums of V adjacent columns per thread, for terms whose operands move in 16-byte
/// packs (a warp reads 512 contiguous bytes of a row instead of 64). F has a `slot` type and
/// `rows_in_flight`: that many rows are loaded (`f.load(r, c, slot&)`) before any is added
/// (`f.add(const slot&, float (&acc)[V])`), so more bytes are in flight per thread. Each column's
/// additions are those of column_partial_kernel with the matching scalar functor (same rows, same
/// order, the same fp32 expression), so the sums are bit for bit the same.
template <int V, class F>
__global__ void column_partial_vec_kernel(F f, std::int64_t rows, int cols,
                                          std::int64_t chunk_rows, float* partial) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c >= cols) return;
  const std::int64_t r0 = blockIdx.y * chunk_rows;
  const std::int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.0f;
  constexpr int U = F::rows_in_flight;
  std::int64_t r = r0;
  for (; r + U <= r1; r += U) {
    typename F::slot s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) f.load(r + u, c, s[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) f.add(s[u], acc);
  }
  for (; r < r1; ++r) {
    typename F::slot s;
    f.load(r, c, s);
    f.add(s, acc);
  }
  float* out = partial + static_cast<std::int64_t>(blockIdx.y) * cols + c;
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = acc[k];
}

/// Threads of a finishing block: 32 columns (x) × 32 chunk lanes (y).
constexpr int finish_cols = 32, finish_lanes = 32;

/// Σ_k partial[k · cols + c] over `chunks` rows, in a fixed order, for column c = blockIdx.x · 32 +
/// threadIdx.x of a (32, 32) block: lane y adds rows y, y + 32, ... in order, then the 32 lane sums
/// are added in lane order. One thread adding every row in turn waited ~chunks L2 round trips
/// (hundreds of rows: tens of µs per call). The total is valid in threads with threadIdx.y == 0.
__device__ inline float column_total(const float* partial, int chunks, int cols, int c) {
  __shared__ float lane_sums[finish_lanes][finish_cols + 1];
  float s = 0.0f;
  if (c < cols)
    for (int k = threadIdx.y; k < chunks; k += finish_lanes)
      s += partial[static_cast<std::int64_t>(k) * cols + c];
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.y == 0)
    for (int y = 0; y < finish_lanes; ++y) total += lane_sums[y][threadIdx.x];
  return total;
}

inline dim3 finish_grid(int cols) { return dim3((cols + finish_cols - 1) / finish_cols); }
inline dim3 finish_block() { return dim3(finish_cols, finish_lanes); }

/// out[c] += the column's total, or out[c] = it with `write` (out is not read: it may hold
/// anything).
__global__ inline void column_finish_kernel(const float* partial, int chunks, int cols, void* out,
                                            int code, bool write) {
  const int c = blockIdx.x * finish_cols + threadIdx.x;
  const float s = column_total(partial, chunks, cols, c);
  if (threadIdx.y == 0 && c < cols) store_f(out, code, c, write ? s : load_f(out, code, c) + s);
}

/// How column_sums cuts `rows` into chunks: enough chunks to fill the GPU for narrow matrices, few
/// enough that the finishing pass is short. Depends only on the row count.
struct column_chunks {
  std::int64_t chunk_rows;
  int chunks;
};
inline column_chunks column_chunking(std::int64_t rows) {
  constexpr std::int64_t max_chunks = 512;
  const std::int64_t chunk_rows = std::max<std::int64_t>(32, (rows + max_chunks - 1) / max_chunks);
  return {chunk_rows, static_cast<int>((rows + chunk_rows - 1) / chunk_rows)};
}

/// Launches the two passes on ctx's stream; out[o] (dtype codes[o], `cols` elements) may be null to
/// skip that output. The sums are added to out, or written with `write`.
template <int NOUT, class F>
void column_sums(context& ctx, const F& f, std::int64_t rows, int cols, void* const (&out)[NOUT],
                 const int (&codes)[NOUT], bool write = false) {
  if (rows == 0 || cols == 0) return;
  const column_chunks ch = column_chunking(rows);
  const std::int64_t chunk_rows = ch.chunk_rows;
  const int chunks = ch.chunks;
  scratch partial(ctx, sizeof(float) * NOUT * static_cast<std::size_t>(chunks) * cols);
  const int threads = 128;
  dim3 grid((cols + threads - 1) / threads, chunks);
  column_partial_kernel<NOUT><<<grid, threads, 0, ctx.stream>>>(f, rows, cols, chunk_rows,
                                                                partial.as<float>());
  TROUPE_CUDA_CHECK_LAUNCH();
  for (int o = 0; o < NOUT; ++o) {
    if (!out[o]) continue;
    column_finish_kernel<<<finish_grid(cols), finish_block(), 0, ctx.stream>>>(
        partial.as<float>() + static_cast<std::int64_t>(o) * chunks * cols, chunks, cols, out[o],
        codes[o], write);
    TROUPE_CUDA_CHECK_LAUNCH();
  }
}

/// out += column sums (out = them with `write`) through column_partial_vec_kernel (V columns per
/// thread; cols % V == 0) and column_finish_kernel: the chunks, the order and so the bits of
/// column_sums with the scalar functor.
template <int V, class F>
void column_sums_vec(context& ctx, const F& f, std::int64_t rows, int cols, void* out, int code,
                     bool write = false) {
  if (rows == 0 || cols == 0) return;
  const column_chunks ch = column_chunking(rows);
  scratch partial(ctx, sizeof(float) * static_cast<std::size_t>(ch.chunks) * cols);
  const int threads = 128, lanes = cols / V;
  const dim3 grid((lanes + threads - 1) / threads, ch.chunks);
  column_partial_vec_kernel<V><<<grid, threads, 0, ctx.stream>>>(f, rows, cols, ch.chunk_rows,
                                                                  partial.as<float>());
  TROUPE_CUDA_CHECK_LAUNCH();
  column_finish_kernel<<<finish_grid(cols), finish_block(), 0, ctx.stream>>>(
      partial.as<float>(), ch.chunks, cols, out, code, write);
  TROUPE_CUDA_CHECK_LAUNCH();
}

/// out += Σ_rows x (written with `write`: out's old contents are ignored) over x [rows, cols]:
/// the backend's sum_rows and the bias gradient's kernels (kernels/cuda/linear.cu).
void sum_rows_on(context& ctx, const tensor& x, tensor& out, bool write);

}  // namespace troupe::kernels::cuda
