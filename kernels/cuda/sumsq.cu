// Per-block sums of squares for the global gradient norm: out[i] = Σ x² over elements
// [i·norm_block, (i+1)·norm_block) of an fp32 buffer, in fp64. One warp per norm block (eight per
// CUDA block), so a block's sum depends only on its own elements (the split-invariance backend.hpp
// promises), and its fixed-order reduction (each lane's elements in order, then the lanes'
// butterfly) gives the same bits every run. A whole CUDA block per norm block, as before, spent the
// kernel on launching 160k tiny blocks (0.26 ms for 124M parameters on the H200, half the DRAM
// rate). Squares of floats are exact in fp64; only the additions round, so the CPU's differently
// ordered sum agrees to ~1e-16 relative. sumsq_blocks_list does many tensors per launch with the
// same per-block code, hence the same bits. message_hash_sumsq_blocks reads a sent gradient once
// for both its message hash's first level and these sums (hash_sumsq_kernel).
#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/warp_xxh3.cuh"
#include "kernels/message_hash.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

constexpr int sumsq_warps = 8;

/// s += the squares of one lane's 16-byte group, in order: the full blocks' step of
/// sumsq_one_block, shared with hash_sumsq_kernel so that both give the same bits.
__device__ __forceinline__ void add_squares(double& s, float x, float y, float z, float w) {
  const double a = x, b = y, c = z, d = w;
  s += a * a;
  s += b * b;
  s += c * c;
  s += d * d;
}

/// Sum of squares of norm block `blk` of x[0, n) by one warp; the result is in every lane. `vec`:
/// x is 16-byte aligned, so a full norm block is read as float4 (norm_block is a multiple of 128
/// elements).
__device__ __forceinline__ double sumsq_one_block(const float* x, std::int64_t n, std::int64_t blk,
                                                  int lane, bool vec) {
  const std::int64_t begin = blk * norm_block;
  const std::int64_t end = begin + norm_block < n ? begin + norm_block : n;
  double s = 0.0;
  if (vec && end - begin == norm_block) {
    const float4* x4 = reinterpret_cast<const float4*>(x + begin);
    float4 v[norm_block / 128];
#pragma unroll
    for (int j = 0; j < norm_block / 128; ++j) v[j] = x4[j * 32 + lane];
#pragma unroll
    for (int j = 0; j < norm_block / 128; ++j) add_squares(s, v[j].x, v[j].y, v[j].z, v[j].w);
  } else {
    for (std::int64_t i = begin + lane; i < end; i += 32) {
      const double v = x[i];
      s += v * v;
    }
  }
  return warp_sum(s);
}

__global__ void sumsq_blocks_kernel(const float* x, std::int64_t n, double* out,
                                    std::int64_t blocks, bool vec) {
  const std::int64_t blk = static_cast<std::int64_t>(blockIdx.x) * sumsq_warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= blocks) return;
  const double s = sumsq_one_block(x, n, blk, lane, vec);
  if (lane == 0) out[blk] = s;
}

/// Tensors per launch of sumsq_list_kernel: the table is a kernel parameter (3.2 KB, under the
/// classic 4 KB limit).
constexpr int sumsq_list_max = 128;

struct sumsq_list_table {
  const float* x[sumsq_list_max];
  std::int64_t n[sumsq_list_max];
  std::int64_t first[sumsq_list_max];  // first output block of each tensor, ascending
  unsigned char vec[sumsq_list_max];
  int count;
};

/// One warp per output block, over the blocks of up to 128 tensors: the tensor is found by binary
/// search over the first blocks, and its block summed exactly as sumsq_blocks_kernel does.
__global__ void sumsq_list_kernel(const __grid_constant__ sumsq_list_table t, double* out,
                                  std::int64_t blocks) {
  const std::int64_t blk = static_cast<std::int64_t>(blockIdx.x) * sumsq_warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= blocks) return;
  int lo = 0, hi = t.count - 1;  // the last tensor whose first block is <= blk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first[mid] <= blk)
      lo = mid;
    else
      hi = mid - 1;
  }
  const double s = sumsq_one_block(t.x[lo], t.n[lo], blk - t.first[lo], lane, t.vec[lo] != 0);
  if (lane == 0) out[blk] = s;
}

/// XXH3's default secret (kernels/message_hash.hpp), for hash_sumsq_kernel.
__constant__ xxh3::secret c_sumsq_secret = xxh3::default_secret;

static_assert(message_hash_block == norm_block * sizeof(float),
              "a message-hash block of fp32 is one norm block");

/// message_hash_sumsq_blocks of a 16-byte aligned x[0, n): one warp per block, which loads it once
/// (warp_xxh3.cuh's layout, sumsq_one_block's for a full block), hashes it and sums the squares of
/// its first counts[b] elements. A full count sums the registers in sumsq_one_block's order; a
/// shorter one (a tensor's last block) is summed by sumsq_one_block from memory (the block was
/// just read), as the tensor's own last block is; a count of 0 gives 0. A last block shorter than
/// norm_block is hashed by the warp's first lane with the header's XXH3.
__global__ void __launch_bounds__(256)
    hash_sumsq_kernel(const float* x, const int* counts, std::int64_t n, std::int64_t blocks,
                      std::uint64_t* digests, double* sums) {
  __shared__ std::uint64_t kw[24];
  if (threadIdx.x < 24) kw[threadIdx.x] = c_sumsq_secret.w[threadIdx.x];
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t blk = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) +
                          threadIdx.x / 32;
       blk < blocks; blk += warps) {
    const std::int64_t base = blk * norm_block;
    const int count = counts[blk];
    if (base + norm_block > n) {
      const double s = count > 0 ? sumsq_one_block(x + base, count, 0, lane, true) : 0.0;
      if (lane == 0) {
        const auto* bytes = reinterpret_cast<const unsigned char*>(x + base);
        digests[blk] = xxh3::xxh3_64(xxh3::byte_reader{bytes},
                                     static_cast<std::uint64_t>(n - base) * sizeof(float), 0,
                                     c_sumsq_secret);
        sums[blk] = s;
      }
      continue;
    }
    warp_block_xxh3 hash(lane);
    double s = 0.0;
#pragma unroll 1
    for (int round = 0; round < 4; ++round) {
      pack<float, 4> v[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        v[h] = *reinterpret_cast<const pack<float, 4>*>(x + base +
                                                        4 * (32 * (2 * round + h) + lane));
      if (count == norm_block)
#pragma unroll
        for (int h = 0; h < 2; ++h) add_squares(s, v[h].v[0], v[h].v[1], v[h].v[2], v[h].v[3]);
      hash.round(v, round, lane, kw);
    }
    const std::uint64_t merged = hash.merged(kw);
    if (count == norm_block)
      s = warp_sum(s);
    else
      s = count > 0 ? sumsq_one_block(x + base, count, 0, lane, true) : 0.0;
    if (lane == 0) {
      digests[blk] = warp_block_xxh3::digest(merged);
      sums[blk] = s;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

void cuda_backend::sumsq_blocks(const tensor& x, tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda sumsq_blocks";
  require_type(x, dtype::f32, op, "x");
  require_type(out, dtype::f64, op, "out");
  const std::int64_t n = x.numel(), blocks = (n + norm_block - 1) / norm_block;
  require_numel(out, blocks, op, "out (ceil(x.numel() / norm_block))");
  if (blocks == 0) return;
  static_assert(norm_block % 128 == 0, "the float4 path reads 128 elements per warp and step");
  const unsigned grid = static_cast<unsigned>((blocks + sumsq_warps - 1) / sumsq_warps);
  sumsq_blocks_kernel<<<grid, sumsq_warps * 32, 0, s>>>(x.data<float>(), n, out.data<double>(),
                                                        blocks, aligned16(x.raw()));
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda sumsq_blocks_list";
  require_type(out, dtype::f64, op, "out");
  std::int64_t total = 0;
  for (const tensor& x : xs) {
    require_type(x, dtype::f32, op, "xs[]");
    total += (x.numel() + norm_block - 1) / norm_block;
  }
  require_numel(out, total, op, "out (the blocks of every tensor)");
  std::int64_t at = 0;  // first output block of the next launch
  std::size_t i = 0;
  while (i < xs.size()) {
    sumsq_list_table t{};
    std::int64_t blocks = 0;
    for (; i < xs.size() && t.count < sumsq_list_max; ++i) {
      const std::int64_t nb = (xs[i].numel() + norm_block - 1) / norm_block;
      if (nb == 0) continue;
      t.x[t.count] = xs[i].data<float>();
      t.n[t.count] = xs[i].numel();
      t.first[t.count] = blocks;
      t.vec[t.count] = aligned16(xs[i].raw()) ? 1 : 0;
      ++t.count;
      blocks += nb;
    }
    if (blocks == 0) continue;
    const unsigned grid = static_cast<unsigned>((blocks + sumsq_warps - 1) / sumsq_warps);
    sumsq_list_kernel<<<grid, sumsq_warps * 32, 0, s>>>(t, out.data<double>() + at, blocks);
    TROUPE_CUDA_CHECK_LAUNCH();
    at += blocks;
  }
}

void cuda_backend::message_hash_sumsq_blocks(const tensor& x, const tensor& counts,
                                             tensor& blocks, tensor& sums) {
  const char* op = "cuda message_hash_sumsq_blocks";
  if (!x.defined() || x.dev().is_cpu() || !aligned16(x.raw()) || counts.dev().is_cpu() ||
      blocks.dev().is_cpu() || sums.dev().is_cpu())
    return backend::message_hash_sumsq_blocks(x, counts, blocks, sums);
  activate();
  require_type(x, dtype::f32, op, "x");
  const auto nb = static_cast<std::int64_t>(message_hash_blocks_of(x.bytes()));
  require_type(blocks, dtype::i64, op, "blocks");
  require_numel(blocks, nb, op, "blocks (message_hash_blocks_of(x.bytes()))");
  require_type(counts, dtype::i32, op, "counts");
  require_numel(counts, nb, op, "counts (one per block)");
  require_type(sums, dtype::f64, op, "sums");
  require_numel(sums, nb, op, "sums (one per block)");
  if (nb == 0) return;
  const auto grid = static_cast<unsigned>(std::min<std::int64_t>((nb + 7) / 8, 4096));
  hash_sumsq_kernel<<<grid, 256, 0, ctx_->stream>>>(x.data<float>(), counts.data<std::int32_t>(),
                                                    x.numel(), nb, blocks.data<std::uint64_t>(),
                                                    sums.data<double>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
