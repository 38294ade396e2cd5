// Causal scaled-dot-product attention on fused qkv, flash-style: the forward keeps only the
// log-sum-exp of each query's scores, lse[b,h,t] = log Σ_{j<=t} exp(s_tj), s_tj = q_t·k_j /
// sqrt(D); the backward recomputes the probabilities p_tj = exp(s_tj - lse) from q, k and lse.
// Neither direction holds more than one row of T scores per thread; the T×T matrix never exists.
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
//
// Dropout of the probabilities (attention_dims::dropout): out_t = Σ_j p_tj m_tj v_j with m_tj =
// mask / (1 − p) redrawn from the keyed stream in both directions; lse stays that of the undropped
// scores. Then Δ_t = dO · out_t still equals Σ_j p_tj m_tj dp_tj, and
//   ds_tj = p_tj (m_tj dp_tj - Δ_t),  dv_j += Σ_t p_tj m_tj dO.
// With dropout off m = 1 and no mask is drawn.
//
// Packed documents (attention_dims::doc_start): query t sees keys doc_start(t) … t only, so every
// sum above runs over j from doc_start(t) instead of 0, in the same order: a document's outputs
// and gradients are the bits it gets alone at the start of a row.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

void check_dims(const op_check& c, const attention_dims& d) {
  c.require(d.dropout.p >= 0 && d.dropout.p < 1,
            "dropout p must be in [0, 1), got " + std::to_string(d.dropout.p));
  c.require(d.batch > 0 && d.seq > 0 && d.heads > 0 && d.kv_heads > 0 && d.head_dim > 0 &&
                d.heads % d.kv_heads == 0,
            "dims must be positive with heads % kv_heads == 0, got B=" + std::to_string(d.batch) +
                " T=" + std::to_string(d.seq) + " H=" + std::to_string(d.heads) +
                " Hkv=" + std::to_string(d.kv_heads) + " D=" + std::to_string(d.head_dim));
}

// The document starts, when given: int32 [B*T] on the host, each 0 <= start <= t.
const std::int32_t* check_docs(const op_check& c, const attention_dims& d) {
  if (!d.doc_start.defined()) return nullptr;
  c.host(d.doc_start, "doc_start", core::dtype::i32);
  c.numel(d.doc_start, "doc_start", static_cast<std::int64_t>(d.batch) * d.seq, "[B*T]");
  const std::int32_t* s = d.doc_start.data<std::int32_t>();
  for (std::int64_t r = 0; r < static_cast<std::int64_t>(d.batch) * d.seq; ++r)
    c.require(s[r] >= 0 && s[r] <= r % d.seq,
              "doc_start " + std::to_string(s[r]) + " at row " + std::to_string(r) +
                  " is not within [0, t = " + std::to_string(r % d.seq) + "]");
  return s;
}

std::int64_t qkv_width(const attention_dims& d) {
  return static_cast<std::int64_t>(d.heads + 2 * d.kv_heads) * d.head_dim;
}

std::string dims_note(const attention_dims& d) {
  return "B*T = " + std::to_string(static_cast<std::int64_t>(d.batch) * d.seq) +
         ", H = " + std::to_string(d.heads) + ", Hkv = " + std::to_string(d.kv_heads) +
         ", D = " + std::to_string(d.head_dim);
}

// What the per-task functions read and write; the backward leaves the forward-only fields null.
struct attn_view {
  const float* qkv = nullptr;
  const float* out = nullptr;  // forward output, read by the backward
  const float* dout = nullptr;
  const float* lse = nullptr;
  float* out_w = nullptr;
  float* lse_w = nullptr;
  float* dqkv = nullptr;
  int T = 0, D = 0, H = 0, Hkv = 0;
  std::int64_t w = 0, ow = 0;  // row widths of qkv and out
  float scale = 0;
  dropout_spec drop;           // of the probabilities
  int first_head = 0;          // global index of head 0 (tensor parallel)
  std::uint32_t threshold = 0;
  float drop_scale = 1;
  const std::int32_t* doc = nullptr;  // attention_dims::doc_start, or null (every start 0)

  /// The first key query t of sequence b sees.
  int first_key(int b, int t) const {
    return doc ? doc[static_cast<std::int64_t>(b) * T + t] : 0;
  }

  /// m_tj of query t, key j in head h of sequence b (1 without dropout).
  float mask(int b, int h, int t, int j) const {
    const auto sample = static_cast<std::uint64_t>(drop.first_sample + b);
    const auto within = (static_cast<std::uint64_t>(h + first_head) * T + t) * T + j;
    return core::dropout_bits(drop.key, sample, within) >= threshold ? drop_scale : 0.0f;
  }
};

/// The view's dimensions for `d` (the tensors are the caller's to set).
attn_view view_of(const attention_dims& d) {
  attn_view a;
  a.T = d.seq;
  a.D = d.head_dim;
  a.H = d.heads;
  a.Hkv = d.kv_heads;
  a.w = qkv_width(d);
  a.ow = static_cast<std::int64_t>(d.heads) * d.head_dim;
  a.scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  a.drop = d.dropout;
  a.first_head = d.dropout_first_head;
  if (a.drop.on()) {
    a.threshold = core::dropout_threshold(a.drop.p);
    a.drop_scale = core::dropout_scale(a.drop.p);
  }
  return a;
}

// Forward of query head h of sequence b: out and lse of its T queries.
TROUPE_SIMD_CLONES void forward_head(const attn_view& a, int b, int h) {
  const int T = a.T, D = a.D, g = h / (a.H / a.Hkv);
  const std::int64_t w = a.w;
  const float* rows_b = a.qkv + static_cast<std::int64_t>(b) * T * w;
  const std::int64_t q_off = static_cast<std::int64_t>(h) * D;
  const std::int64_t k_off = static_cast<std::int64_t>(a.H + g) * D;
  const std::int64_t v_off = static_cast<std::int64_t>(a.H + a.Hkv + g) * D;
  std::vector<float> p(static_cast<std::size_t>(T)), acc(static_cast<std::size_t>(D));
  for (int t = 0; t < T; ++t) {
    const float* q = rows_b + t * w + q_off;
    float m = -std::numeric_limits<float>::infinity();
    const int j0 = a.first_key(b, t);
    for (int j = j0; j <= t; ++j) {
      p[j] = dot(q, rows_b + j * w + k_off, D) * a.scale;
      m = std::max(m, p[j]);
    }
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = j0; j <= t; ++j) {
      float e = fast_exp(p[j] - m);
      l += e;
      if (a.drop.on()) e *= a.mask(b, h, t, j);
      const float* v = rows_b + j * w + v_off;
      for (int k = 0; k < D; ++k) acc[k] += e * v[k];
    }
    const float inv_l = 1.0f / l;
    float* o = a.out_w + (static_cast<std::int64_t>(b) * T + t) * a.ow + q_off;
    for (int k = 0; k < D; ++k) o[k] = acc[k] * inv_l;
    a.lse_w[(static_cast<std::int64_t>(b) * a.H + h) * T + t] = m + std::log(l);
  }
}

// Backward of kv head g of sequence b: its query heads in order, then its dk and dv.
TROUPE_SIMD_CLONES void backward_group(const attn_view& a, int b, int g) {
  const int T = a.T, D = a.D, group = a.H / a.Hkv;
  const std::int64_t w = a.w, ow = a.ow, row0 = static_cast<std::int64_t>(b) * T;
  const float scale = a.scale;
  const float* rows_b = a.qkv + row0 * w;
  const std::int64_t k_off = static_cast<std::int64_t>(a.H + g) * D;
  const std::int64_t v_off = static_cast<std::int64_t>(a.H + a.Hkv + g) * D;
  std::vector<float> dk(static_cast<std::size_t>(T) * D, 0.0f), dv(dk.size(), 0.0f);
  std::vector<float> dq(static_cast<std::size_t>(D));
  for (int h = g * group; h < (g + 1) * group; ++h) {
    const std::int64_t q_off = static_cast<std::int64_t>(h) * D;
    const float* lse_bh = a.lse + (static_cast<std::int64_t>(b) * a.H + h) * T;
    for (int t = 0; t < T; ++t) {
      const float* q = rows_b + t * w + q_off;
      const float* dO = a.dout + (row0 + t) * ow + q_off;
      const float delta = dot(dO, a.out + (row0 + t) * ow + q_off, D);
      const float l = lse_bh[t];
      std::fill(dq.begin(), dq.end(), 0.0f);
      for (int j = a.first_key(b, t); j <= t; ++j) {
        const float* k = rows_b + j * w + k_off;
        const float* v = rows_b + j * w + v_off;
        const float p = fast_exp(dot(q, k, D) * scale - l);
        float dp = dot(dO, v, D), pm = p;
        if (a.drop.on()) {
          const float m = a.mask(b, h, t, j);
          dp *= m;
          pm *= m;
        }
        const float ds = p * (dp - delta);
        const float ds_scaled = ds * scale;
        float* dkj = dk.data() + static_cast<std::int64_t>(j) * D;
        float* dvj = dv.data() + static_cast<std::int64_t>(j) * D;
        for (int e = 0; e < D; ++e) {
          dq[e] += ds * k[e];
          dkj[e] += ds_scaled * q[e];
          dvj[e] += pm * dO[e];
        }
      }
      float* dq_out = a.dqkv + (row0 + t) * w + q_off;
      for (int e = 0; e < D; ++e) dq_out[e] += dq[e] * scale;
    }
  }
  for (int j = 0; j < T; ++j) {
    float* dk_out = a.dqkv + (row0 + j) * w + k_off;
    float* dv_out = a.dqkv + (row0 + j) * w + v_off;
    for (int e = 0; e < D; ++e) {
      dk_out[e] += dk[static_cast<std::size_t>(j) * D + e];
      dv_out[e] += dv[static_cast<std::size_t>(j) * D + e];
    }
  }
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

  attn_view a = view_of(d);
  a.doc = check_docs(c, d);
  a.qkv = qkv.data<float>();
  a.out_w = out.data<float>();
  a.lse_w = lse.data<float>();
  parallel_tasks(static_cast<std::int64_t>(d.batch) * d.heads, [&](std::int64_t task) {
    forward_head(a, static_cast<int>(task / d.heads), static_cast<int>(task % d.heads));
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

  attn_view a = view_of(d);
  a.doc = check_docs(c, d);
  a.qkv = qkv.data<float>();
  a.out = out.data<float>();
  a.dout = dout.data<float>();
  a.lse = lse.data<float>();
  a.dqkv = dqkv.data<float>();
  parallel_tasks(static_cast<std::int64_t>(d.batch) * d.kv_heads, [&](std::int64_t task) {
    backward_group(a, static_cast<int>(task / d.kv_heads), static_cast<int>(task % d.kv_heads));
  });
}

}  // namespace troupe::kernels::cpu
