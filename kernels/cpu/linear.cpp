// Linear layer: y = x·wᵀ + b and its two backward GEMMs, through OpenBLAS cblas_sgemm.
//
// OpenBLAS runs single-threaded (cpu_backend.cpp says why); each GEMM is cut into blocks of the
// output along its longer side, never along the reduction, and the cut depends only on (M, N, K).
// Each block is one single-threaded sgemm whose bits do not depend on the thread that runs it, so
// the result is the same with any number of threads. Cutting the longer side keeps the operand
// that every block repacks the small one (for the GPT-2 head, the activations, not the 50257-row
// embedding).
#include <cblas.h>

#include <algorithm>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

// Blocks are at least this long along the cut side and at least this much work (~0.2 ms on one
// core), and at most max_blocks of them: enough to keep 2-16 threads busy without repacking the
// other operand often. With these, the demo's qkv weight gradient (C[384,128]) gets 3 blocks.
constexpr std::int64_t min_block_len = 128;
constexpr double min_block_flops = 16e6;
constexpr std::int64_t max_blocks = 16;

// C[M,N] = op(A)·op(B) + beta·C, row-major, op(A) = A or Aᵀ; cut into blocks as above.
void blocked_sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                   const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta,
                   float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  const bool cut_rows = m >= n;
  const std::int64_t len = cut_rows ? m : n;
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  std::int64_t blocks = std::min<std::int64_t>(
      {max_blocks, std::max<std::int64_t>(1, len / min_block_len),
       std::max<std::int64_t>(1, static_cast<std::int64_t>(flops / min_block_flops))});
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  parallel_tasks(blocks, [&](std::int64_t i) {
    const std::int64_t begin = len * i / blocks, end = len * (i + 1) / blocks;
    if (cut_rows) {
      // Rows [begin, end) of C use rows (or, transposed, columns) [begin, end) of A.
      const float* a_blk = trans_a ? a + begin : a + begin * lda;
      cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(end - begin), static_cast<int>(n),
                  static_cast<int>(k), 1.0f, a_blk, static_cast<int>(lda), b, static_cast<int>(ldb),
                  beta, c + begin * ldc, static_cast<int>(ldc));
    } else {
      const float* b_blk = trans_b ? b + begin * ldb : b + begin;
      cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(end - begin),
                  static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b_blk, static_cast<int>(ldb),
                  beta, c + begin, static_cast<int>(ldc));
    }
  });
}

}  // namespace

void cpu_backend::linear_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y) {
  op_check c("linear_forward", {{"x", &x}, {"w", &w}, {"b", &b}, {"y", &y}});
  c.host(x, "x", core::dtype::f32);
  c.host(w, "w", core::dtype::f32);
  c.optional(b, "b", core::dtype::f32);
  c.host(y, "y", core::dtype::f32);
  c.require(w.rank() == 2, "w must be [OC, IC]");
  const std::int64_t oc = w.dim(0), ic = w.dim(1);
  c.require(x.rank() >= 1 && x.dim(-1) == ic, "x must be [N, IC] with IC = w.dim(1)");
  const std::int64_t n = rows_of(x);
  c.matrix(y, "y", n, oc, "N rows of x, OC = w.dim(0)");
  if (b.defined()) c.shape(b, "b", {oc}, "OC = w.dim(0)");
  float* yp = y.data<float>();
  float beta = 0.0f;
  if (b.defined()) {
    // Start from the bias and let the GEMM add to it: y = fl(b + x·wᵀ), one pass over y.
    const float* bp = b.data<float>();
    parallel_for(n, std::max<std::int64_t>(1, (1 << 16) / std::max<std::int64_t>(oc, 1)),
                 [&](std::int64_t r0, std::int64_t r1) {
                   for (std::int64_t r = r0; r < r1; ++r) std::copy(bp, bp + oc, yp + r * oc);
                 });
    beta = 1.0f;
  }
  blocked_sgemm(false, true, n, oc, ic, x.data<float>(), ic, w.data<float>(), ic, beta, yp, oc);
}

void cpu_backend::linear_backward_input(const tensor& dy, const tensor& w, tensor& dx) {
  op_check c("linear_backward_input", {{"dy", &dy}, {"w", &w}, {"dx", &dx}});
  c.host(dy, "dy", core::dtype::f32);
  c.host(w, "w", core::dtype::f32);
  c.host(dx, "dx", core::dtype::f32);
  c.require(w.rank() == 2, "w must be [OC, IC]");
  const std::int64_t oc = w.dim(0), ic = w.dim(1);
  c.require(dy.rank() >= 1 && dy.dim(-1) == oc, "dy must be [N, OC] with OC = w.dim(0)");
  const std::int64_t n = rows_of(dy);
  c.matrix(dx, "dx", n, ic, "N rows of dy, IC = w.dim(1)");
  blocked_sgemm(false, false, n, ic, oc, dy.data<float>(), oc, w.data<float>(), ic, 1.0f,
                dx.data<float>(), ic);
}

namespace {
/// out[c] += Σ_r x[r, c]: each column summed over rows in row order into a fresh fp32
/// accumulator, then added to out; threads take column ranges. The bias gradients' sum, wherever
/// it is computed (linear_backward_weight, sum_rows), so both give the same bits.
void add_column_sums(const float* x, std::int64_t n, std::int64_t cols, float* out) {
  parallel_for(cols, std::max<std::int64_t>(16, (1 << 16) / std::max<std::int64_t>(n, 1)),
               [&](std::int64_t c0, std::int64_t c1) {
                 std::vector<float> acc(static_cast<std::size_t>(c1 - c0), 0.0f);
                 for (std::int64_t r = 0; r < n; ++r) {
                   const float* row = x + r * cols + c0;
                   for (std::int64_t j = 0; j < c1 - c0; ++j) acc[j] += row[j];
                 }
                 for (std::int64_t j = 0; j < c1 - c0; ++j) out[c0 + j] += acc[j];
               });
}
}  // namespace

void cpu_backend::linear_backward_weight(const tensor& dy, const tensor& x, tensor& dw,
                                         tensor& db) {
  op_check c("linear_backward_weight", {{"dy", &dy}, {"x", &x}, {"dw", &dw}, {"db", &db}});
  c.host(dy, "dy", core::dtype::f32);
  c.host(x, "x", core::dtype::f32);
  c.host(dw, "dw", core::dtype::f32);
  c.optional(db, "db", core::dtype::f32);
  c.require(dw.rank() == 2, "dw must be [OC, IC]");
  const std::int64_t oc = dw.dim(0), ic = dw.dim(1);
  c.require(dy.rank() >= 1 && dy.dim(-1) == oc, "dy must be [N, OC] with OC = dw.dim(0)");
  const std::int64_t n = rows_of(dy);
  c.matrix(x, "x", n, ic, "N rows of dy, IC = dw.dim(1)");
  if (db.defined()) c.shape(db, "db", {oc}, "OC = dw.dim(0)");
  const float* dyp = dy.data<float>();
  blocked_sgemm(true, false, oc, ic, n, dyp, oc, x.data<float>(), ic, 1.0f, dw.data<float>(), ic);
  if (db.defined()) add_column_sums(dyp, n, oc, db.data<float>());
}

void cpu_backend::sum_rows(const tensor& x, tensor& out) {
  op_check c("sum_rows", {{"x", &x}, {"out", &out}});
  c.host(x, "x", core::dtype::f32);
  c.host(out, "out", core::dtype::f32);
  c.require(x.rank() >= 1, "x must be [N, C]");
  const std::int64_t cols = x.dim(-1);
  c.shape(out, "out", {cols}, "C = last dim of x");
  add_column_sums(x.data<float>(), rows_of(x), cols, out.data<float>());
}

}  // namespace troupe::kernels::cpu
