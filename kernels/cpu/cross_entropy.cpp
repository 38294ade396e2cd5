// Softmax cross-entropy fused with its backward, one row of logits at a time:
//   m = max_i x_i,  s = Σ_i exp(x_i - m),  loss = log s + m - x_target
//   dlogits_i = (exp(x_i - m) / s - [i == target]) * grad_scale      (written over the logits)
// A negative target marks a padded position: zero loss and, when the gradient is asked for, a zero
// row.
//
// This is the hottest non-GEMM op of the GPT-2 demo (1024 rows × 50257 per micro-batch), so each
// row is three vectorised passes that stay in the L2 cache: the max; exp (fast_exp) stored in place
// and summed in eight fp64 lanes; the scaling. Rows are independent, so threads take rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

// sum_lanes floats as one GCC vector: the per-lane select below then compiles to vector max
// instructions, which the loop over a float array did not (GCC kept it scalar, a quarter of the
// op's time).
typedef float float_lanes __attribute__((vector_size(sizeof(float) * sum_lanes)));
static_assert(sum_lanes == 8, "row_max starts its lanes from eight values");

// Lane j takes max over the elements i with i % sum_lanes == j, in index order, as
// l = x > l ? x : l (a NaN element leaves its lane as it was); then the lanes in order.
inline float row_max(const float* x, std::int64_t n) {
  const float inf = std::numeric_limits<float>::infinity();
  float_lanes l = {-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf};
  std::int64_t i = 0;
  for (; i + sum_lanes <= n; i += sum_lanes) {
    float_lanes v;
    std::memcpy(&v, x + i, sizeof v);
    l = v > l ? v : l;
  }
  float t[sum_lanes];
  std::memcpy(t, &l, sizeof t);
  for (int j = 0; i + j < n; ++j) t[j] = x[i + j] > t[j] ? x[i + j] : t[j];
  float m = t[0];
  for (int j = 1; j < sum_lanes; ++j) m = t[j] > m ? t[j] : m;
  return m;
}

// Σ exp(x_i - m) in fp64 lanes; when `store`, x_i is replaced by exp(x_i - m).
template <bool store>
inline double exp_sum(float* x, float m, std::int64_t n) {
  double l[sum_lanes] = {};
  std::int64_t i = 0;
  for (; i + sum_lanes <= n; i += sum_lanes)
    for (int j = 0; j < sum_lanes; ++j) {
      const float e = fast_exp(x[i + j] - m);
      if constexpr (store) x[i + j] = e;
      l[j] += static_cast<double>(e);
    }
  for (int j = 0; i + j < n; ++j) {
    const float e = fast_exp(x[i + j] - m);
    if constexpr (store) x[i + j] = e;
    l[j] += static_cast<double>(e);
  }
  return combine_lanes(l);
}

// Loss (and, unless grad_scale is 0, the gradient in place) of rows [r0, r1).
TROUPE_SIMD_CLONES void ce_rows(float* xp, const std::int32_t* tgt, float* lp, std::int64_t r0,
                                std::int64_t r1, std::int64_t vocab, float grad_scale) {
  for (std::int64_t r = r0; r < r1; ++r) {
    float* x = xp + r * vocab;
    const std::int32_t t = tgt[r];
    if (t < 0) {
      lp[r] = 0.0f;
      if (grad_scale != 0.0f) std::fill(x, x + vocab, 0.0f);
      continue;
    }
    const float m = row_max(x, vocab);
    const float x_t = x[t];
    if (grad_scale == 0.0f) {
      lp[r] = static_cast<float>(std::log(exp_sum<false>(x, m, vocab)) +
                                 (static_cast<double>(m) - x_t));
      continue;
    }
    const double s = exp_sum<true>(x, m, vocab);
    lp[r] = static_cast<float>(std::log(s) + (static_cast<double>(m) - x_t));
    const float f = static_cast<float>(grad_scale / s);
    for (std::int64_t i = 0; i < vocab; ++i) x[i] *= f;
    x[t] -= grad_scale;
  }
}

}  // namespace

void cpu_backend::cross_entropy(tensor& logits, const tensor& targets, tensor& losses,
                                float grad_scale) {
  op_check c("cross_entropy", {{"logits", &logits}, {"targets", &targets}, {"losses", &losses}});
  c.host(logits, "logits", core::dtype::f32);
  c.host(targets, "targets", core::dtype::i32);
  c.host(losses, "losses", core::dtype::f32);
  c.require(logits.rank() >= 1 && logits.dim(-1) > 0, "logits must be [N, V] with V > 0");
  const std::int64_t vocab = logits.dim(-1), n = rows_of(logits);
  c.numel(targets, "targets", n, "one per row of logits");
  c.numel(losses, "losses", n, "one per row of logits");
  const std::int32_t* tgt = targets.data<std::int32_t>();
  for (std::int64_t r = 0; r < n; ++r)
    if (tgt[r] >= vocab)
      throw core::failure("cross_entropy: target " + std::to_string(tgt[r]) + " at row " +
                          std::to_string(r) + " is outside the vocabulary [0, " +
                          std::to_string(vocab) +
                          ") (hint: negative targets are ignored; others must index a logit)");
  float* xp = logits.data<float>();
  float* lp = losses.data<float>();
  parallel_for(
      n, std::max<std::int64_t>(1, (1 << 16) / vocab),
      [&](std::int64_t r0, std::int64_t r1) { ce_rows(xp, tgt, lp, r0, r1, vocab, grad_scale); });
}

}  // namespace troupe::kernels::cpu
