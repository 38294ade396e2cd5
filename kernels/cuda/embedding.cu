// Token + position embedding: out[r] = wte[tok[r]] + wpe[r % T] (generation: + wpe[positions[r]]),
// and its backward
// dwte[tok] += Σ rows with that token, dwpe[t] += Σ_b dout[b·T + t].
//
// The backward is a scatter-add with collisions (a token appears many times in a batch). Atomics
// would make the order of additions, and so the bits, vary between runs; instead the rows are
// sorted by token with a stable radix sort (CUB), so each token's rows form one segment in row
// order, and one warp owns each segment: it adds the segment's rows in order and then adds the sum
// into dwte once. Only rows of tokens present are touched: O(N·C), independent of the vocabulary.
// The position gradient is a plain per-(t, c) sum over the batch in batch order; with explicit
// positions (packed documents: embedding_backward_at) the rows are sorted by position and summed
// per segment the same way as the token gradient.
//
// A token outside [0, V) (or a position outside wpe) makes the forward write NaN for its row (so the loss turns NaN and the
// coordinator stops the job) and is skipped by the backward; the kernel cannot throw.
#include <cub/device/device_radix_sort.cuh>

#include <limits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

/// Row r at position positions[r] when positions is given (generation), else r % seq.
__global__ void embedding_forward_kernel(const int* tokens, const void* wte, int wte_code,
                                         const void* wpe, int wpe_code, int seq, int vocab,
                                         void* out, int out_code, std::int64_t rows, int C,
                                         const int* positions, int wpe_rows) {
  const std::int64_t row = blockIdx.x;
  if (row >= rows) return;
  const int tok = tokens[row];
  const std::int64_t t = positions ? positions[row] : row % seq;
  const bool valid = tok >= 0 && tok < vocab && (!wpe || !positions || (t >= 0 && t < wpe_rows));
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float v = valid ? load_f(wte, wte_code, static_cast<std::int64_t>(tok) * C + c) : __int_as_float(0x7fc00000);
    if (wpe && valid) v += load_f(wpe, wpe_code, t * C + c);
    store_f(out, out_code, row * C + c, v);
  }
}

__global__ void iota_kernel(int* v, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) v[i] = static_cast<int>(i);
}

/// One warp per sorted position; the warp at the first position of a token's segment owns it.
__global__ void embedding_segments_kernel(const int* sorted_tokens, const int* sorted_rows,
                                          const void* dout, int dout_code, void* dwte,
                                          int dwte_code, int vocab, std::int64_t rows, int C) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) +
                         threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= rows) return;
  const int tok = sorted_tokens[i];
  if (i > 0 && sorted_tokens[i - 1] == tok) return;
  if (tok < 0 || tok >= vocab) return;
  std::int64_t end = i + 1;
  while (end < rows && sorted_tokens[end] == tok) ++end;
  for (int c = lane; c < C; c += 32) {
    float acc = 0.0f;
    for (std::int64_t j = i; j < end; ++j)
      acc += load_f(dout, dout_code, static_cast<std::int64_t>(sorted_rows[j]) * C + c);
    const std::int64_t o = static_cast<std::int64_t>(tok) * C + c;
    store_f(dwte, dwte_code, o, load_f(dwte, dwte_code, o) + acc);
  }
}

__global__ void embedding_position_kernel(const void* dout, int dout_code, void* dwpe,
                                          int dwpe_code, int seq, std::int64_t batch, int C) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(seq) * C) return;
  float acc = 0.0f;
  for (std::int64_t b = 0; b < batch; ++b)
    acc += load_f(dout, dout_code, b * seq * C + i);
  store_f(dwpe, dwpe_code, i, load_f(dwpe, dwpe_code, i) + acc);
}

/// Vocabulary-parallel lookup: out[r] = wte[tok − first] where this rank holds the token (rows
/// [first, first + valid)), else 0; + wpe[r % seq] when wpe is given. A token outside [0, vocab)
/// gives a NaN row.
__global__ void vp_embedding_forward_kernel(const int* tokens, const float* wte, std::int64_t first,
                                            std::int64_t valid, std::int64_t vocab,
                                            const float* wpe, int seq, float* out, int C) {
  const std::int64_t row = blockIdx.x;
  const int tok = tokens[row];
  const std::int64_t local = tok - first;
  const bool bad = tok < 0 || tok >= vocab, mine = !bad && local >= 0 && local < valid;
  const std::int64_t t = row % seq;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float v = bad ? __int_as_float(0x7fc00000) : mine ? wte[local * C + c] : 0.0f;
    if (wpe) v += wpe[t * C + c];
    out[row * C + c] = v;
  }
}

/// The rows of the embedding a rank holds: tok − first, or −1 (skipped by scatter_rows).
__global__ void vp_local_tokens_kernel(const int* tokens, std::int64_t first, std::int64_t valid,
                                       int* local, std::int64_t n) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t l = tokens[i] - first;
    local[i] = l >= 0 && l < valid ? static_cast<int>(l) : -1;
  }
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {

void check_embedding(const tensor& tokens, const tensor& wte, const tensor& wpe, int seq,
                     const tensor& act, const char* op, const char* act_name) {
  require_type(tokens, dtype::i32, op, "tokens");
  require_float(wte, op, "wte");
  require(wte.rank() == 2, op, "wte must be [V, C], got " + core::shape_string(wte.shape()));
  const std::int64_t C = wte.dim(1), N = tokens.numel();
  require_float(act, op, act_name);
  require_numel(act, N * C, op, act_name);
  require(seq > 0 && N % seq == 0, op,
          "tokens (" + std::to_string(N) + ") are not a whole number of sequences of " +
              std::to_string(seq));
  if (wpe.defined()) {
    require_float(wpe, op, "wpe");
    require(wpe.rank() == 2 && wpe.dim(1) == C && wpe.dim(0) >= seq, op,
            "wpe " + core::shape_string(wpe.shape()) + " does not cover seq " +
                std::to_string(seq) + " x C " + std::to_string(C));
  }
}

}  // namespace

void cuda_backend::embedding_forward(const tensor& tokens, const tensor& wte, const tensor& wpe,
                                     int seq, tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  check_embedding(tokens, wte, wpe, seq, out, "cuda embedding_forward", "out");
  const std::int64_t N = tokens.numel();
  if (N == 0) return;
  const int C = static_cast<int>(wte.dim(1));
  embedding_forward_kernel<<<static_cast<unsigned>(N), 256, 0, s>>>(
      tokens.data<int>(), wte.raw(), code_of(wte.type()), wpe.defined() ? wpe.raw() : nullptr,
      wpe.defined() ? code_of(wpe.type()) : 0, seq, static_cast<int>(wte.dim(0)), out.raw(),
      code_of(out.type()), N, C, nullptr, 0);
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::embedding_forward_at(const tensor& tokens, const tensor& wte,
                                        const tensor& wpe, const tensor& positions, tensor& out) {
  activate();
  cudaStream_t s = ctx_->stream;
  const char* op = "cuda embedding_forward_at";
  const std::int64_t N = tokens.numel();
  check_embedding(tokens, wte, wpe, 1, out, op, "out");
  require_type(positions, dtype::i32, op, "positions");
  require_numel(positions, N, op, "positions");
  if (N == 0) return;
  const int C = static_cast<int>(wte.dim(1));
  embedding_forward_kernel<<<static_cast<unsigned>(N), 256, 0, s>>>(
      tokens.data<int>(), wte.raw(), code_of(wte.type()), wpe.defined() ? wpe.raw() : nullptr,
      wpe.defined() ? code_of(wpe.type()) : 0, 1, static_cast<int>(wte.dim(0)), out.raw(),
      code_of(out.type()), N, C, positions.data<int>(),
      wpe.defined() ? static_cast<int>(wpe.dim(0)) : 0);
  TROUPE_CUDA_CHECK_LAUNCH();
}

namespace {

/// table[keys[r]] += dout[r] over the N rows, each table row receiving its rows in row order (a
/// stable sort of the rows by key, then one warp per segment); keys outside the table are skipped.
void scatter_rows(context& ctx, const tensor& keys, const tensor& dout, tensor& table,
                  std::int64_t N, int C) {
  const int n = static_cast<int>(N);
  scratch rows_in(ctx, sizeof(int) * N), rows_out(ctx, sizeof(int) * N),
      keys_out(ctx, sizeof(int) * N);
  iota_kernel<<<(n + 255) / 256, 256, 0, ctx.stream>>>(rows_in.as<int>(), N);
  TROUPE_CUDA_CHECK_LAUNCH();
  std::size_t temp_bytes = 0;
  TROUPE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.data<int>(),
                                                    keys_out.as<int>(), rows_in.as<int>(),
                                                    rows_out.as<int>(), n, 0, 32, ctx.stream));
  scratch temp(ctx, temp_bytes);
  TROUPE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, keys.data<int>(),
                                                    keys_out.as<int>(), rows_in.as<int>(),
                                                    rows_out.as<int>(), n, 0, 32, ctx.stream));
  constexpr int warps = 8;
  embedding_segments_kernel<<<(n + warps - 1) / warps, warps * 32, 0, ctx.stream>>>(
      keys_out.as<int>(), rows_out.as<int>(), dout.raw(), code_of(dout.type()), table.raw(),
      code_of(table.type()), static_cast<int>(table.dim(0)), N, C);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void cuda_backend::embedding_backward(const tensor& dout, const tensor& tokens, int seq,
                                      tensor& dwte, tensor& dwpe) {
  activate();
  context& ctx = *ctx_;
  const char* op = "cuda embedding_backward";
  check_embedding(tokens, dwte, dwpe, seq, dout, op, "dout");
  const std::int64_t N = tokens.numel();
  if (N == 0) return;
  require(N <= std::numeric_limits<int>::max(), op, "more than 2^31 rows");
  const int C = static_cast<int>(dwte.dim(1));
  scatter_rows(ctx, tokens, dout, dwte, N, C);
  if (dwpe.defined()) {
    const std::int64_t cells = static_cast<std::int64_t>(seq) * C;
    embedding_position_kernel<<<static_cast<unsigned>((cells + 255) / 256), 256, 0, ctx.stream>>>(
        dout.raw(), code_of(dout.type()), dwpe.raw(), code_of(dwpe.type()), seq, N / seq, C);
    TROUPE_CUDA_CHECK_LAUNCH();
  }
}

void cuda_backend::embedding_backward_at(const tensor& dout, const tensor& tokens,
                                         const tensor& positions, tensor& dwte, tensor& dwpe) {
  activate();
  context& ctx = *ctx_;
  const char* op = "cuda embedding_backward_at";
  check_embedding(tokens, dwte, dwpe, 1, dout, op, "dout");
  const std::int64_t N = tokens.numel();
  require_type(positions, dtype::i32, op, "positions");
  require_numel(positions, N, op, "positions");
  if (N == 0) return;
  require(N <= std::numeric_limits<int>::max(), op, "more than 2^31 rows");
  const int C = static_cast<int>(dwte.dim(1));
  scatter_rows(ctx, tokens, dout, dwte, N, C);
  if (dwpe.defined()) scatter_rows(ctx, positions, dout, dwpe, N, C);
}

void cuda_backend::vp_embedding_forward(const tensor& tokens, const tensor& wte,
                                        std::int64_t first, std::int64_t valid,
                                        std::int64_t vocab, const tensor& wpe, int seq,
                                        tensor& out) {
  activate();
  const char* op = "cuda vp_embedding_forward";
  check_embedding(tokens, wte, wpe, seq, out, op, "out");
  require_type(wte, dtype::f32, op, "wte");
  require_type(out, dtype::f32, op, "out");
  if (wpe.defined()) require_type(wpe, dtype::f32, op, "wpe");
  require(valid >= 0 && valid <= wte.dim(0), op,
          std::to_string(valid) + " real rows of wte " + core::shape_string(wte.shape()));
  const std::int64_t N = tokens.numel();
  if (N == 0) return;
  vp_embedding_forward_kernel<<<static_cast<unsigned>(N), 256, 0, ctx_->stream>>>(
      tokens.data<int>(), wte.data<float>(), first, valid, vocab,
      wpe.defined() ? wpe.data<float>() : nullptr, seq, out.data<float>(),
      static_cast<int>(wte.dim(1)));
  TROUPE_CUDA_CHECK_LAUNCH();
}

void cuda_backend::vp_embedding_backward(const tensor& dout, const tensor& tokens,
                                         std::int64_t first, std::int64_t valid, int seq,
                                         tensor& dwte, tensor& dwpe) {
  activate();
  context& ctx = *ctx_;
  const char* op = "cuda vp_embedding_backward";
  require_type(tokens, dtype::i32, op, "tokens");
  require_float(dout, op, "dout");
  const std::int64_t N = tokens.numel();
  if (N == 0) return;
  require(N <= std::numeric_limits<int>::max(), op, "more than 2^31 rows");
  require(dout.numel() % N == 0, op, "dout " + core::shape_string(dout.shape()) + " for " +
                                         std::to_string(N) + " tokens");
  const int C = static_cast<int>(dout.numel() / N);
  require(seq > 0 && N % seq == 0, op,
          "tokens (" + std::to_string(N) + ") are not a whole number of sequences of " +
              std::to_string(seq));
  if (dwte.defined()) {
    require_float(dwte, op, "dwte");
    require(dwte.rank() == 2 && dwte.dim(1) == C && valid <= dwte.dim(0), op,
            "dwte " + core::shape_string(dwte.shape()) + " for " + std::to_string(valid) +
                " rows of " + std::to_string(C));
    tensor local = empty({N}, dtype::i32);
    vp_local_tokens_kernel<<<grid_for(N, 256), 256, 0, ctx.stream>>>(tokens.data<int>(), first,
                                                                    valid, local.data<int>(), N);
    TROUPE_CUDA_CHECK_LAUNCH();
    scatter_rows(ctx, local, dout, dwte, N, C);
  }
  if (dwpe.defined()) {
    require_float(dwpe, op, "dwpe");
    require(dwpe.rank() == 2 && dwpe.dim(1) == C && dwpe.dim(0) >= seq, op,
            "dwpe " + core::shape_string(dwpe.shape()) + " does not cover seq " +
                std::to_string(seq) + " x C " + std::to_string(C));
    const std::int64_t cells = static_cast<std::int64_t>(seq) * C;
    embedding_position_kernel<<<static_cast<unsigned>((cells + 255) / 256), 256, 0, ctx.stream>>>(
        dout.raw(), code_of(dout.type()), dwpe.raw(), code_of(dwpe.type()), seq, N / seq, C);
    TROUPE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace troupe::kernels::cuda
