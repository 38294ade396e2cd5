// Rotary position embedding, rotate-half convention (Hugging Face LLaMA): in each of the first
// rot_heads heads of a row, element i < D/2 pairs with i + D/2 and the pair turns by the angle
// a = t·f_i of position t = row % T (generation and packed documents: t = positions[row];
// f_i = theta^(-2i/D), or its llama3-scaled value: kernels/rope_freq.hpp); the other heads are
// copied. The backward applies the transpose (inverse rotation), written (in place when dx is dy).
//
// The angle is computed exactly as the CPU reference does (kernels/cpu/rope.cpp): in double, with
// cos/sin rounded once to float. In fp32 the product t·inv_freq alone is off by up to ~1e-4 rad at
// t ~ 1000, which would break the 1e-5 agreement. A block computes its row's angles once and every
// head of the row uses them, so the fp64 math is a small cost next to the memory traffic.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

__device__ __forceinline__ void rope_angle(std::int64_t t, int i, int head_dim,
                                           const rope_spec& rope, float& c, float& s) {
  const double inv_freq = rope_inv_freq(rope, i, head_dim);
  double sd, cd;
  sincos(static_cast<double>(t) * inv_freq, &sd, &cd);
  c = static_cast<float>(cd);
  s = static_cast<float>(sd);
}

/// A pair (a1, a2) turned by (c, s): forward (a1·c − a2·s, a2·c + a1·s), backward the transpose.
/// Rounded step by step (no fused multiply-add), so that the scalar and the vector kernels give the
/// same bits.
template <bool Backward>
__device__ __forceinline__ void turn(float a1, float a2, float c, float s, float& o1, float& o2) {
  if constexpr (!Backward) {
    o1 = __fsub_rn(__fmul_rn(a1, c), __fmul_rn(a2, s));
    o2 = __fadd_rn(__fmul_rn(a2, c), __fmul_rn(a1, s));
  } else {
    o1 = __fadd_rn(__fmul_rn(a1, c), __fmul_rn(a2, s));
    o2 = __fsub_rn(__fmul_rn(a2, c), __fmul_rn(a1, s));
  }
}

/// One block per row at a time (row r at position positions[r] when positions is given, for
/// generation and packed documents, else r % seq). The angle of pair i depends on the position and
/// i alone, so the block computes cos and sin of its row's head_dim / 2 angles once, into shared
/// memory, and every head of the row reads them: the same values the per-pair computation gave,
/// at 1 / heads_total of its fp64 work. Forward: y = R x on the first rot_heads heads, the others
/// copied (when y is not x). Backward: dx = Rᵀ dy, the others dx = dy (copied when dx is not dy).
/// A thread reads both elements of its pair before it writes them, so out may be in.
template <bool Backward>
__global__ void rope_kernel(const void* in, void* out, int code, int seq, int heads_total,
                            int rot_heads, int head_dim, rope_spec rope, std::int64_t rows,
                            const int* positions) {
  extern __shared__ float cs[];  // cos of pair i at cs[i], sin at cs[half + i]
  const int half = head_dim / 2;
  const int pairs = heads_total * half;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::int64_t t = positions ? positions[row] : row % seq;
    __syncthreads();  // the previous row's readers are done with cs
    for (int i = threadIdx.x; i < half; i += blockDim.x) rope_angle(t, i, head_dim, rope, cs[i], cs[half + i]);
    __syncthreads();
    const std::int64_t row_base = row * heads_total * head_dim;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
      const int h = p / half, i = p - h * half;
      const std::int64_t base = row_base + static_cast<std::int64_t>(h) * head_dim;
      const float a1 = load_f(in, code, base + i), a2 = load_f(in, code, base + i + half);
      if (h < rot_heads) {
        float o1, o2;
        turn<Backward>(a1, a2, cs[i], cs[half + i], o1, o2);
        store_f(out, code, base + i, o1);
        store_f(out, code, base + i + half, o2);
      } else if (in != out) {
        store_f(out, code, base + i, a1);
        store_f(out, code, base + i + half, a2);
      }
    }
  }
}

/// rope_kernel for 16-byte aligned rows of T whose half head holds a multiple of V elements: a
/// thread turns V adjacent pairs, loading and storing them 16 bytes at a time (a warp moves 512
/// contiguous bytes instead of 64). The same angles and arithmetic per pair: the same bits.
template <bool Backward, class T, int V>
__global__ void rope_vec_kernel(const T* in, T* out, int seq, int heads_total, int rot_heads,
                                int head_dim, rope_spec rope, std::int64_t rows,
                                const int* positions) {
  extern __shared__ float cs[];  // cos of pair i at cs[i], sin at cs[half + i]
  const int half = head_dim / 2, per_head = half / V;
  const int groups = heads_total * per_head;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::int64_t t = positions ? positions[row] : row % seq;
    __syncthreads();  // the previous row's readers are done with cs
    for (int i = threadIdx.x; i < half; i += blockDim.x)
      rope_angle(t, i, head_dim, rope, cs[i], cs[half + i]);
    __syncthreads();
    const std::int64_t row_base = row * heads_total * head_dim;
    for (int p = threadIdx.x; p < groups; p += blockDim.x) {
      const int h = p / per_head, i = (p - h * per_head) * V;
      const std::int64_t base = row_base + static_cast<std::int64_t>(h) * head_dim + i;
      const pack<T, V> a1 = *reinterpret_cast<const pack<T, V>*>(in + base);
      const pack<T, V> a2 = *reinterpret_cast<const pack<T, V>*>(in + base + half);
      if (h < rot_heads) {
        pack<T, V> o1, o2;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          float r1, r2;
          turn<Backward>(to_f(a1.v[k]), to_f(a2.v[k]), cs[i + k], cs[half + i + k], r1, r2);
          o1.v[k] = from_f<T>(r1);
          o2.v[k] = from_f<T>(r2);
        }
        *reinterpret_cast<pack<T, V>*>(out + base) = o1;
        *reinterpret_cast<pack<T, V>*>(out + base + half) = o2;
      } else if (in != out) {
        *reinterpret_cast<pack<T, V>*>(out + base) = a1;
        *reinterpret_cast<pack<T, V>*>(out + base + half) = a2;
      }
    }
  }
}

/// Launches rope_vec_kernel (16-byte aligned x and y, whole packs per half head) or rope_kernel
/// over `rows` rows: one block of 128 threads per row, at most 65,536 blocks (each then takes every
/// 65,536th row).
template <bool Backward>
void launch_rope(const void* in, void* out, int code, int seq, int heads_total, int rot_heads,
                 int head_dim, const rope_spec& rope, std::int64_t rows, const int* positions,
                 cudaStream_t s) {
  const auto blocks = static_cast<unsigned>(rows < 65536 ? rows : 65536);
  const std::size_t shared = sizeof(float) * static_cast<std::size_t>(head_dim);
  bool vec = false;
  dispatch_float(static_cast<dtype>(code), "cuda rope", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if ((head_dim / 2) % V != 0 || !aligned16(in) || !aligned16(out)) return;
    vec = true;
    rope_vec_kernel<Backward, T, V><<<blocks, 128, shared, s>>>(
        static_cast<const T*>(in), static_cast<T*>(out), seq, heads_total, rot_heads, head_dim,
        rope, rows, positions);
  });
  if (!vec)
    rope_kernel<Backward><<<blocks, 128, shared, s>>>(in, out, code, seq, heads_total, rot_heads,
                                                     head_dim, rope, rows, positions);
  TROUPE_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {

std::int64_t check_rope(const tensor& x, const char* xn, const tensor& y, const char* yn, int seq,
                        int heads_total, int rot_heads, int head_dim, const char* op) {
  require_float(x, op, xn);
  require_type(y, x.type(), op, yn);
  require(head_dim > 0 && head_dim % 2 == 0, op,
          "head_dim must be even and positive, got " + std::to_string(head_dim));
  require(heads_total > 0 && rot_heads >= 0 && rot_heads <= heads_total, op,
          "0 <= rot_heads <= heads_total is required, got rot_heads = " +
              std::to_string(rot_heads) + ", heads_total = " + std::to_string(heads_total));
  const std::int64_t width = static_cast<std::int64_t>(heads_total) * head_dim;
  require(x.rank() >= 1 && x.dim(-1) == width, op,
          std::string(xn) + " " + core::shape_string(x.shape()) +
              " must be [N, heads_total * head_dim] = [N, " + std::to_string(width) + "]");
  const std::int64_t rows = x.numel() / width;
  require(seq > 0 && rows % seq == 0, op,
          "the row count must be a multiple of seq = " + std::to_string(seq));
  require_numel(y, x.numel(), op, yn);
  return rows;
}

}  // namespace

void cuda_backend::rope_forward(const tensor& x, int seq, int heads_total, int rot_heads,
                                int head_dim, const rope_spec& rope, tensor& y) {
  activate();
  cudaStream_t s = ctx_->stream;
  const std::int64_t rows =
      check_rope(x, "x", y, "y", seq, heads_total, rot_heads, head_dim, "cuda rope_forward");
  const std::int64_t n = rows * heads_total * (head_dim / 2);
  if (n == 0) return;
  launch_rope<false>(x.raw(), y.raw(), code_of(x.type()), seq, heads_total, rot_heads, head_dim,
                     rope, rows, nullptr, s);
}

void cuda_backend::rope_forward_at(const tensor& x, const tensor& positions, int heads_total,
                                   int rot_heads, int head_dim, const rope_spec& rope, tensor& y) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda rope_forward_at";
  const std::int64_t rows = check_rope(x, "x", y, "y", 1, heads_total, rot_heads, head_dim, op);
  require_type(positions, dtype::i32, op, "positions");
  require_numel(positions, rows, op, "positions");
  const std::int64_t n = rows * heads_total * (head_dim / 2);
  if (n == 0) return;
  launch_rope<false>(x.raw(), y.raw(), code_of(x.type()), 1, heads_total, rot_heads, head_dim,
                     rope, rows, positions.data<int>(), s);
}

void cuda_backend::rope_backward(const tensor& dy, int seq, int heads_total, int rot_heads,
                                 int head_dim, const rope_spec& rope, tensor& dx) {
  activate();
  cudaStream_t s = ctx_->stream;
  const std::int64_t rows =
      check_rope(dy, "dy", dx, "dx", seq, heads_total, rot_heads, head_dim, "cuda rope_backward");
  const std::int64_t n = rows * heads_total * (head_dim / 2);
  if (n == 0) return;
  launch_rope<true>(dy.raw(), dx.raw(), code_of(dy.type()), seq, heads_total, rot_heads, head_dim,
                    rope, rows, nullptr, s);
}

void cuda_backend::rope_backward_at(const tensor& dy, const tensor& positions, int heads_total,
                                    int rot_heads, int head_dim, const rope_spec& rope,
                                    tensor& dx) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda rope_backward_at";
  const std::int64_t rows = check_rope(dy, "dy", dx, "dx", 1, heads_total, rot_heads, head_dim, op);
  require_type(positions, dtype::i32, op, "positions");
  require_numel(positions, rows, op, "positions");
  const std::int64_t n = rows * heads_total * (head_dim / 2);
  if (n == 0) return;
  launch_rope<true>(dy.raw(), dx.raw(), code_of(dy.type()), 1, heads_total, rot_heads, head_dim,
                    rope, rows, positions.data<int>(), s);
}

}  // namespace troupe::kernels::cuda
