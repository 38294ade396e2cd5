// The vocabulary-parallel embedding and cross-entropy ops (kernels/backend.hpp) on host memory:
// the CPU backend's ops, and the reference the CUDA kernels (kernels/cuda/vocab_parallel.cu) are
// tested against. A backend whose tensors live elsewhere and that does not override an op gets
// this code on host copies of its tensors (slow, but the same numbers).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.hpp"
#include "kernels/backend.hpp"

namespace troupe::kernels {
namespace {

using core::dtype;

/// x itself on the host, else a host copy.
tensor on_host(backend& be, const tensor& x) {
  return !x.defined() || x.dev().is_cpu() ? x : be.to_host(x);
}

/// Writes host tensor h into dst (dst itself when dst is on the host).
void write_back(backend& be, const tensor& h, tensor& dst) {
  if (!dst.dev().is_cpu()) be.copy(h, dst);
}

void require(bool ok, const std::string& op, const std::string& what) {
  TROUPE_CHECK(ok, op + ": " + what);
}

void require_f32(const tensor& x, const std::string& op, const char* name) {
  require(x.type() == dtype::f32, op, std::string(name) + " must be fp32, got " +
                                          core::dtype_name(x.type()));
}

void require_i32(const tensor& x, const std::string& op, const char* name) {
  require(x.type() == dtype::i32, op, std::string(name) + " must be int32, got " +
                                          core::dtype_name(x.type()));
}

/// Checks z [n, cols] fp32 with valid <= cols; returns n.
std::int64_t check_block(const tensor& z, std::int64_t valid, const std::string& op) {
  require_f32(z, op, "z");
  require(z.shape().size() == 2, op, "z must be [n, cols], got " + core::shape_string(z.shape()));
  require(valid >= 0 && valid <= z.dim(1), op, std::to_string(valid) + " real columns of " +
                                                   std::to_string(z.dim(1)));
  return z.dim(0);
}

/// m_i: the largest of every rank's row maximum (maxima [tp·n], rank after rank).
std::vector<float> global_max(const tensor& maxima, std::int64_t n, const std::string& op) {
  require_f32(maxima, op, "maxima");
  require(n > 0 ? maxima.numel() % n == 0 : maxima.numel() == 0, op,
          std::to_string(maxima.numel()) + " maxima for " + std::to_string(n) + " rows");
  const std::int64_t tp = n > 0 ? maxima.numel() / n : 0;
  std::vector<float> m(static_cast<std::size_t>(n), -std::numeric_limits<float>::infinity());
  const float* p = maxima.data<float>();
  for (std::int64_t k = 0; k < tp; ++k)
    for (std::int64_t i = 0; i < n; ++i) m[i] = std::max(m[i], p[k * n + i]);
  return m;
}

}  // namespace

void backend::vp_embedding_forward(const tensor& tokens_in, const tensor& wte_in,
                                   std::int64_t first, std::int64_t valid, std::int64_t vocab,
                                   const tensor& wpe_in, int seq, tensor& out) {
  const std::string op = name() + " vp_embedding_forward";
  const tensor tok = on_host(*this, tokens_in), wte = on_host(*this, wte_in),
               wpe = on_host(*this, wpe_in);
  require_i32(tok, op, "tokens");
  require_f32(wte, op, "wte");
  require(valid <= wte.dim(0), op, std::to_string(valid) + " real rows of wte [" +
                                       std::to_string(wte.dim(0)) + ", C]");
  const std::int64_t n = tok.numel(), c = wte.dim(1);
  require(out.numel() == n * c && out.type() == dtype::f32, op,
          "out must be fp32 [" + std::to_string(n) + ", " + std::to_string(c) + "]");
  tensor o = out.dev().is_cpu() ? out : tensor::zeros(out.shape());
  float* op_ = o.data<float>();
  std::fill(op_, op_ + n * c, 0.0f);
  const std::int32_t* t = tok.data<std::int32_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    TROUPE_CHECK(t[i] >= 0 && t[i] < vocab, "token " + std::to_string(t[i]) + " at row " +
                                                std::to_string(i) + " is outside the vocabulary [0, " +
                                                std::to_string(vocab) + ")");
    const std::int64_t local = t[i] - first;
    if (local >= 0 && local < valid)
      std::memcpy(op_ + i * c, wte.data<float>() + local * c, static_cast<std::size_t>(c) * sizeof(float));
  }
  if (wpe.defined()) {
    require_f32(wpe, op, "wpe");
    const float* w = wpe.data<float>();
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < c; ++j) op_[i * c + j] += w[(i % seq) * c + j];
  }
  write_back(*this, o, out);
}

void backend::vp_embedding_backward(const tensor& dout_in, const tensor& tokens_in,
                                    std::int64_t first, std::int64_t valid, int seq, tensor& dwte,
                                    tensor& dwpe) {
  const std::string op = name() + " vp_embedding_backward";
  const tensor d = on_host(*this, dout_in), tok = on_host(*this, tokens_in);
  require_i32(tok, op, "tokens");
  require_f32(d, op, "dout");
  const std::int64_t n = tok.numel();
  require(n > 0 ? d.numel() % n == 0 : true, op, "dout " + core::shape_string(d.shape()) +
                                                     " for " + std::to_string(n) + " tokens");
  const std::int64_t c = n > 0 ? d.numel() / n : 0;
  const std::int32_t* t = tok.data<std::int32_t>();
  const float* dp = d.data<float>();
  // Rows are added in row order, as embedding_backward adds them.
  if (dwte.defined()) {
    tensor dw = on_host(*this, dwte);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t local = t[i] - first;
      if (local < 0 || local >= valid) continue;
      float* row = dw.data<float>() + local * c;
      for (std::int64_t j = 0; j < c; ++j) row[j] += dp[i * c + j];
    }
    write_back(*this, dw, dwte);
  }
  if (dwpe.defined()) {
    tensor dw = on_host(*this, dwpe);
    for (std::int64_t i = 0; i < n; ++i) {
      float* row = dw.data<float>() + (i % seq) * c;
      for (std::int64_t j = 0; j < c; ++j) row[j] += dp[i * c + j];
    }
    write_back(*this, dw, dwpe);
  }
}

void backend::vp_row_max(const tensor& z_in, std::int64_t valid, tensor& row_max) {
  const std::string op = name() + " vp_row_max";
  const tensor z = on_host(*this, z_in);
  const std::int64_t n = check_block(z, valid, op), cols = z.dim(1);
  require(row_max.numel() == n && row_max.type() == dtype::f32, op,
          "row_max must be fp32 [" + std::to_string(n) + "]");
  tensor out = row_max.dev().is_cpu() ? row_max : tensor::zeros({n});
  const float* zp = z.data<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = 0; j < valid; ++j) m = std::max(m, zp[i * cols + j]);
    out.data<float>()[i] = m;
  }
  write_back(*this, out, row_max);
}

void backend::vp_row_stats(const tensor& z_in, std::int64_t valid, const tensor& maxima_in,
                           const tensor& targets_in, std::int64_t first, std::int64_t vocab,
                           tensor& stats) {
  const std::string op = name() + " vp_row_stats";
  const tensor z = on_host(*this, z_in), tgt = on_host(*this, targets_in);
  const std::int64_t n = check_block(z, valid, op), cols = z.dim(1);
  const std::vector<float> m = global_max(on_host(*this, maxima_in), n, op);
  require_i32(tgt, op, "targets");
  require(tgt.numel() == n, op, std::to_string(tgt.numel()) + " targets for " +
                                    std::to_string(n) + " rows");
  require(stats.numel() == 2 * n && stats.type() == dtype::f32, op,
          "stats must be fp32 [" + std::to_string(2 * n) + "]");
  tensor out = stats.dev().is_cpu() ? stats : tensor::zeros({2 * n});
  float* sp = out.data<float>();
  std::fill(sp, sp + 2 * n, 0.0f);
  const float* zp = z.data<float>();
  const std::int32_t* t = tgt.data<std::int32_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    if (t[i] < 0) continue;
    TROUPE_CHECK(t[i] < vocab, "target " + std::to_string(t[i]) + " at row " + std::to_string(i) +
                                   " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    double s = 0;
    for (std::int64_t j = 0; j < valid; ++j) s += std::exp(static_cast<double>(zp[i * cols + j]) - m[i]);
    sp[i] = static_cast<float>(s);
    const std::int64_t local = t[i] - first;
    if (local >= 0 && local < valid) sp[n + i] = zp[i * cols + local];
  }
  write_back(*this, out, stats);
}

void backend::vp_losses(const tensor& maxima_in, const tensor& sums_in, const tensor& targets_in,
                        tensor& losses) {
  const std::string op = name() + " vp_losses";
  const tensor tgt = on_host(*this, targets_in), sums = on_host(*this, sums_in);
  require_i32(tgt, op, "targets");
  const std::int64_t n = tgt.numel();
  const std::vector<float> m = global_max(on_host(*this, maxima_in), n, op);
  require_f32(sums, op, "sums");
  require(sums.numel() == 2 * n, op, std::to_string(sums.numel()) + " sums for " +
                                         std::to_string(n) + " rows");
  require(losses.numel() == n && losses.type() == dtype::f32, op,
          "losses must be fp32 [" + std::to_string(n) + "]");
  tensor out = losses.dev().is_cpu() ? losses : tensor::zeros({n});
  const float* s = sums.data<float>();
  const std::int32_t* t = tgt.data<std::int32_t>();
  for (std::int64_t i = 0; i < n; ++i)
    out.data<float>()[i] =
        t[i] < 0 ? 0.0f
                 : static_cast<float>(std::log(static_cast<double>(s[i])) +
                                      (static_cast<double>(m[i]) - s[n + i]));
  write_back(*this, out, losses);
}

void backend::vp_softmax_grad(tensor& z_inout, std::int64_t valid, const tensor& maxima_in,
                              const tensor& sums_in, const tensor& targets_in, std::int64_t first,
                              float grad_scale) {
  const std::string op = name() + " vp_softmax_grad";
  tensor z = on_host(*this, z_inout);
  const tensor tgt = on_host(*this, targets_in), sums = on_host(*this, sums_in);
  const std::int64_t n = check_block(z, valid, op), cols = z.dim(1);
  const std::vector<float> m = global_max(on_host(*this, maxima_in), n, op);
  require_i32(tgt, op, "targets");
  require(tgt.numel() == n && sums.numel() == 2 * n, op,
          std::to_string(tgt.numel()) + " targets and " + std::to_string(sums.numel()) +
              " sums for " + std::to_string(n) + " rows");
  const float* sum_p = sums.data<float>();
  const std::int32_t* t = tgt.data<std::int32_t>();
  float* zp = z.data<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    float* row = zp + i * cols;
    if (t[i] < 0) {
      std::fill(row, row + cols, 0.0f);
      continue;
    }
    const double f = grad_scale / static_cast<double>(sum_p[i]);
    for (std::int64_t j = 0; j < valid; ++j)
      row[j] = static_cast<float>(std::exp(static_cast<double>(row[j]) - m[i]) * f);
    std::fill(row + valid, row + cols, 0.0f);
    const std::int64_t local = t[i] - first;
    if (local >= 0 && local < valid) row[local] -= grad_scale;
  }
  write_back(*this, z, z_inout);
}

}  // namespace troupe::kernels
