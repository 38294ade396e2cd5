// Rotary position embedding, rotate-half convention (Hugging Face LLaMA): in each of the first
// rot_heads heads of a row, element i < D/2 pairs with i + D/2 and the pair turns by the angle
// a = t·f_i of position t = row % T (generation and packed documents: t = positions[row];
// f_i = theta^(-2i/D), or its llama3-scaled value: kernels/rope_freq.hpp); the other heads are
// copied. The backward applies the transpose (inverse rotation) and accumulates.
//
// The angle is computed exactly as the CPU reference does (kernels/cpu/rope.cpp): in double, with
// cos/sin rounded once to float. In fp32 the product t·inv_freq alone is off by up to ~1e-4 rad at
// t ~ 1000, which would break the 1e-5 agreement. One thread per (row, head, pair); the fp64 math is
// a small cost next to the memory traffic on Hopper's full-rate fp64 units.
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

/// Row r at position positions[r] when positions is given (generation, packed documents), else
/// r % seq.
__global__ void rope_forward_kernel(const void* x, void* y, int code, int seq, int heads_total,
                                    int rot_heads, int head_dim, rope_spec rope, std::int64_t rows,
                                    const int* positions) {
  const int half = head_dim / 2;
  const std::int64_t pairs_per_row = static_cast<std::int64_t>(heads_total) * half;
  const std::int64_t n = rows * pairs_per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += stride) {
    const std::int64_t row = idx / pairs_per_row;
    const int rem = static_cast<int>(idx % pairs_per_row);
    const int h = rem / half, i = rem % half;
    const std::int64_t base = row * heads_total * head_dim + static_cast<std::int64_t>(h) * head_dim;
    const float x1 = load_f(x, code, base + i), x2 = load_f(x, code, base + i + half);
    if (h < rot_heads) {
      float c, s;
      rope_angle(positions ? positions[row] : row % seq, i, head_dim, rope, c, s);
      store_f(y, code, base + i, x1 * c - x2 * s);
      store_f(y, code, base + i + half, x2 * c + x1 * s);
    } else if (x != y) {
      store_f(y, code, base + i, x1);
      store_f(y, code, base + i + half, x2);
    }
  }
}

__global__ void rope_backward_kernel(const void* dy, void* dx, int code, int seq, int heads_total,
                                     int rot_heads, int head_dim, rope_spec rope, std::int64_t rows,
                                     const int* positions) {
  const int half = head_dim / 2;
  const std::int64_t pairs_per_row = static_cast<std::int64_t>(heads_total) * half;
  const std::int64_t n = rows * pairs_per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += stride) {
    const std::int64_t row = idx / pairs_per_row;
    const int rem = static_cast<int>(idx % pairs_per_row);
    const int h = rem / half, i = rem % half;
    const std::int64_t base = row * heads_total * head_dim + static_cast<std::int64_t>(h) * head_dim;
    const float g1 = load_f(dy, code, base + i), g2 = load_f(dy, code, base + i + half);
    const float d1 = load_f(dx, code, base + i), d2 = load_f(dx, code, base + i + half);
    if (h < rot_heads) {
      float c, s;
      rope_angle(positions ? positions[row] : row % seq, i, head_dim, rope, c, s);
      store_f(dx, code, base + i, d1 + (g1 * c + g2 * s));
      store_f(dx, code, base + i + half, d2 + (g2 * c - g1 * s));
    } else {
      store_f(dx, code, base + i, d1 + g1);
      store_f(dx, code, base + i + half, d2 + g2);
    }
  }
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
  rope_forward_kernel<<<grid_for(n, 256), 256, 0, s>>>(x.raw(), y.raw(), code_of(x.type()), seq,
                                                       heads_total, rot_heads, head_dim,
                                                       rope, rows,
                                                       nullptr);
  TROUPE_CUDA_CHECK_LAUNCH();
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
  rope_forward_kernel<<<grid_for(n, 256), 256, 0, s>>>(x.raw(), y.raw(), code_of(x.type()), 1,
                                                       heads_total, rot_heads, head_dim,
                                                       rope, rows,
                                                       positions.data<int>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::rope_backward(const tensor& dy, int seq, int heads_total, int rot_heads,
                                 int head_dim, const rope_spec& rope, tensor& dx) {
  activate();
  cudaStream_t s = ctx_->stream;
  const std::int64_t rows =
      check_rope(dy, "dy", dx, "dx", seq, heads_total, rot_heads, head_dim, "cuda rope_backward");
  const std::int64_t n = rows * heads_total * (head_dim / 2);
  if (n == 0) return;
  rope_backward_kernel<<<grid_for(n, 256), 256, 0, s>>>(dy.raw(), dx.raw(), code_of(dy.type()),
                                                        seq, heads_total, rot_heads, head_dim,
                                                        rope, rows, nullptr);
  TROUPE_CUDA_CHECK_LAUNCH();
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
  rope_backward_kernel<<<grid_for(n, 256), 256, 0, s>>>(dy.raw(), dx.raw(), code_of(dy.type()), 1,
                                                        heads_total, rot_heads, head_dim, rope,
                                                        rows, positions.data<int>());
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::kernels::cuda
