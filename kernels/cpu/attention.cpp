// Causal scaled-dot-product attention on fused qkv, flash-style: the forward keeps only the
// log-sum-exp of each query's scores, lse[b,h,t] = log Σ_{j<=t} exp(s_tj), s_tj = q_t·k_j / sqrt(D);
// the backward recomputes the probabilities p_tj = exp(s_tj - lse) from q, k and lse. Neither
// direction holds more than one row of T scores per thread; the T×T matrix never exists.
//
// Layout: qkv[B*T, (H + 2*Hkv)*D] holds, per row, H query heads, then Hkv key heads, then Hkv value
// heads; query head h reads kv head h / (H/Hkv) (grouped-query attention; Hkv = H is plain
// multi-head attention). out[B*T, H*D].
//
// Backward, with dO = dout_t and Δ_t = dO · out_t:
//   dp_tj = dO · v_j,  ds_tj = p_tj (dp_tj - Δ_t)
//   dq_t += scale Σ_j ds_tj k_j,  dk_j += scale Σ_t ds_tj q_t,  dv_j += Σ_t p_tj dO
// Threads take (batch, kv head) pairs: the query heads sharing a kv head add into the same dk, dv,
// so one task runs them in head order, which keeps the sums in a fixed order.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

void check_dims(const op_check& c, const attention_dims& d) {
  c.require(d.batch > 0 && d.seq > 0 && d.heads > 0 && d.kv_heads > 0 && d.head_dim > 0 &&
                d.heads % d.kv_heads == 0,
            "dims must be positive with heads % kv_heads == 0, got B=" + std::to_string(d.batch) +
                " T=" + std::to_string(d.seq) + " H=" + std::to_string(d.heads) +
                " Hkv=" + std::to_string(d.kv_heads) + " D=" + std::to_string(d.head_dim));
}

std::int64_t qkv_width(const attention_dims& d) {
  return static_cast<std::int64_t>(d.heads + 2 * d.kv_heads) * d.head_dim;
}

std::string dims_note(const attention_dims& d) {
  return "B*T = " + std::to_string(static_cast<std::int64_t>(d.batch) * d.seq) +
         ", H = " + std::to_string(d.heads) + ", Hkv = " + std::to_string(d.kv_heads) +
         ", D = " + std::to_string(d.head_dim);
}

}  // namespace

void cpu_backend::attention_forward(const tensor& qkv, const attention_dims& d, tensor& out,
                                    tensor& lse) {
  op_check c("attention_forward", {{"qkv", &qkv}, {"out", &out}, {"lse", &lse}});
  check_dims(c, d);
  c.host(qkv, "qkv", core::dtype::f32);
  c.host(out, "out", core::dtype::f32);
  c.host(lse, "lse", core::dtype::f32);
  const std::int64_t rows = static_cast<std::int64_t>(d.batch) * d.seq;
  const std::int64_t w = qkv_width(d), ow = static_cast<std::int64_t>(d.heads) * d.head_dim;
  c.matrix(qkv, "qkv", rows, w, "[B*T, (H + 2*Hkv)*D], " + dims_note(d));
  c.matrix(out, "out", rows, ow, "[B*T, H*D], " + dims_note(d));
  c.numel(lse, "lse", static_cast<std::int64_t>(d.batch) * d.heads * d.seq, "[B, H, T]");

  const int T = d.seq, D = d.head_dim, group = d.heads / d.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* base = qkv.data<float>();
  float* op = out.data<float>();
  float* lp = lse.data<float>();
  parallel_tasks(static_cast<std::int64_t>(d.batch) * d.heads, [&](std::int64_t task) {
    const int b = static_cast<int>(task / d.heads), h = static_cast<int>(task % d.heads);
    const int g = h / group;
    const float* rows_b = base + static_cast<std::int64_t>(b) * T * w;
    const std::int64_t q_off = static_cast<std::int64_t>(h) * D;
    const std::int64_t k_off = static_cast<std::int64_t>(d.heads + g) * D;
    const std::int64_t v_off = static_cast<std::int64_t>(d.heads + d.kv_heads + g) * D;
    std::vector<float> p(static_cast<std::size_t>(T)), acc(static_cast<std::size_t>(D));
    for (int t = 0; t < T; ++t) {
      const float* q = rows_b + t * w + q_off;
      float m = -std::numeric_limits<float>::infinity();
      for (int j = 0; j <= t; ++j) {
        p[j] = dot(q, rows_b + j * w + k_off, D) * scale;
        m = std::max(m, p[j]);
      }
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int j = 0; j <= t; ++j) {
        const float e = fast_exp(p[j] - m);
        l += e;
        const float* v = rows_b + j * w + v_off;
        for (int k = 0; k < D; ++k) acc[k] += e * v[k];
      }
      const float inv_l = 1.0f / l;
      float* o = op + (static_cast<std::int64_t>(b) * T + t) * ow + q_off;
      for (int k = 0; k < D; ++k) o[k] = acc[k] * inv_l;
      lp[(static_cast<std::int64_t>(b) * d.heads + h) * T + t] = m + std::log(l);
    }
  });
}

void cpu_backend::attention_backward(const tensor& dout, const tensor& qkv, const tensor& out,
                                     const tensor& lse, const attention_dims& d, tensor& dqkv) {
  op_check c("attention_backward",
             {{"dout", &dout}, {"qkv", &qkv}, {"out", &out}, {"lse", &lse}, {"dqkv", &dqkv}});
  check_dims(c, d);
  c.host(dout, "dout", core::dtype::f32);
  c.host(qkv, "qkv", core::dtype::f32);
  c.host(out, "out", core::dtype::f32);
  c.host(lse, "lse", core::dtype::f32);
  c.host(dqkv, "dqkv", core::dtype::f32);
  const std::int64_t rows = static_cast<std::int64_t>(d.batch) * d.seq;
  const std::int64_t w = qkv_width(d), ow = static_cast<std::int64_t>(d.heads) * d.head_dim;
  c.matrix(qkv, "qkv", rows, w, "[B*T, (H + 2*Hkv)*D], " + dims_note(d));
  c.matrix(dqkv, "dqkv", rows, w, "the shape of qkv");
  c.matrix(out, "out", rows, ow, "[B*T, H*D], " + dims_note(d));
  c.matrix(dout, "dout", rows, ow, "the shape of out");
  c.numel(lse, "lse", static_cast<std::int64_t>(d.batch) * d.heads * d.seq, "[B, H, T]");

  const int T = d.seq, D = d.head_dim, group = d.heads / d.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* base = qkv.data<float>();
  const float* dbase = dout.data<float>();
  const float* obase = out.data<float>();
  const float* lp = lse.data<float>();
  float* gbase = dqkv.data<float>();
  parallel_tasks(static_cast<std::int64_t>(d.batch) * d.kv_heads, [&](std::int64_t task) {
    const int b = static_cast<int>(task / d.kv_heads), g = static_cast<int>(task % d.kv_heads);
    const std::int64_t row0 = static_cast<std::int64_t>(b) * T;
    const float* rows_b = base + row0 * w;
    const std::int64_t k_off = static_cast<std::int64_t>(d.heads + g) * D;
    const std::int64_t v_off = static_cast<std::int64_t>(d.heads + d.kv_heads + g) * D;
    std::vector<float> dk(static_cast<std::size_t>(T) * D, 0.0f), dv(dk.size(), 0.0f);
    std::vector<float> dq(static_cast<std::size_t>(D));
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const std::int64_t q_off = static_cast<std::int64_t>(h) * D;
      const float* lse_bh = lp + (static_cast<std::int64_t>(b) * d.heads + h) * T;
      for (int t = 0; t < T; ++t) {
        const float* q = rows_b + t * w + q_off;
        const float* dO = dbase + (row0 + t) * ow + q_off;
        const float delta = dot(dO, obase + (row0 + t) * ow + q_off, D);
        const float l = lse_bh[t];
        std::fill(dq.begin(), dq.end(), 0.0f);
        for (int j = 0; j <= t; ++j) {
          const float* k = rows_b + j * w + k_off;
          const float* v = rows_b + j * w + v_off;
          const float p = fast_exp(dot(q, k, D) * scale - l);
          const float ds = p * (dot(dO, v, D) - delta);
          const float ds_scaled = ds * scale;
          float* dkj = dk.data() + static_cast<std::int64_t>(j) * D;
          float* dvj = dv.data() + static_cast<std::int64_t>(j) * D;
          for (int e = 0; e < D; ++e) {
            dq[e] += ds * k[e];
            dkj[e] += ds_scaled * q[e];
            dvj[e] += p * dO[e];
          }
        }
        float* dq_out = gbase + (row0 + t) * w + q_off;
        for (int e = 0; e < D; ++e) dq_out[e] += dq[e] * scale;
      }
    }
    for (int j = 0; j < T; ++j) {
      float* dk_out = gbase + (row0 + j) * w + k_off;
      float* dv_out = gbase + (row0 + j) * w + v_off;
      for (int e = 0; e < D; ++e) {
        dk_out[e] += dk[static_cast<std::size_t>(j) * D + e];
        dv_out[e] += dv[static_cast<std::size_t>(j) * D + e];
      }
    }
  });
}

}  // namespace troupe::kernels::cpu
