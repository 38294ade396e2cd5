// Attention against a key/value cache, for generation: kv_cache_write stores the key and value
// heads of new rows at their (slot, position), attention_decode lets each row's query heads attend
// to its slot's cached positions 0..position. A prompt's prefill is its rows at positions 0..L-1
// of one slot (causal because row t reads only positions <= t); a decode step is one row per
// slot. Scores, softmax and the weighted sum of values are fp32, one (row, head) per task:
//   s_j = q · k_j / sqrt(D),  out = Σ_j exp(s_j - max) v_j / Σ_j exp(s_j - max).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

struct cache_geometry {
  std::int64_t rows = 0;       // R
  std::int64_t slots = 0;      // S
  std::int64_t positions = 0;  // P
  std::int64_t kv_width = 0;   // Hkv * D
  std::int64_t qkv_width = 0;  // (H + 2 Hkv) * D
};

// The checks kv_cache_write and attention_decode share, including every slot and position.
cache_geometry check_cache(const op_check& c, const tensor& qkv, const tensor& slots,
                           const tensor& positions, const tensor& k_cache, const tensor& v_cache,
                           const attention_dims& d) {
  c.require(d.heads > 0 && d.kv_heads > 0 && d.head_dim > 0 && d.heads % d.kv_heads == 0,
            "dims must be positive with heads % kv_heads == 0, got H=" + std::to_string(d.heads) +
                " Hkv=" + std::to_string(d.kv_heads) + " D=" + std::to_string(d.head_dim));
  c.host(qkv, "qkv", core::dtype::f32);
  c.host(slots, "slots", core::dtype::i32);
  c.host(positions, "positions", core::dtype::i32);
  c.host(k_cache, "k_cache", core::dtype::f32);
  c.host(v_cache, "v_cache", core::dtype::f32);
  cache_geometry g;
  g.kv_width = static_cast<std::int64_t>(d.kv_heads) * d.head_dim;
  g.qkv_width = static_cast<std::int64_t>(d.heads + 2 * d.kv_heads) * d.head_dim;
  g.rows = slots.numel();
  c.matrix(qkv, "qkv", g.rows, g.qkv_width, "one row per slot entry, (H + 2 Hkv) * D columns");
  c.numel(positions, "positions", g.rows, "one position per row");
  c.require(k_cache.rank() == 3 && k_cache.dim(2) == g.kv_width,
            "k_cache must be [S, P, Hkv * D] = [S, P, " + std::to_string(g.kv_width) + "]");
  c.require(v_cache.shape() == k_cache.shape(), "v_cache must be shaped like k_cache");
  g.slots = k_cache.dim(0);
  g.positions = k_cache.dim(1);
  const std::int32_t* sl = slots.data<std::int32_t>();
  const std::int32_t* pos = positions.data<std::int32_t>();
  for (std::int64_t r = 0; r < g.rows; ++r)
    c.require(sl[r] >= 0 && sl[r] < g.slots && pos[r] >= 0 && pos[r] < g.positions,
              "row " + std::to_string(r) + " at slot " + std::to_string(sl[r]) + ", position " +
                  std::to_string(pos[r]) + " is outside the cache's " + std::to_string(g.slots) +
                  " slots × " + std::to_string(g.positions) + " positions");
  return g;
}

}  // namespace

void cpu_backend::kv_cache_write(const tensor& qkv, const tensor& slots, const tensor& positions,
                                 const attention_dims& d, tensor& k_cache, tensor& v_cache) {
  op_check c("kv_cache_write", {{"qkv", &qkv},
                                {"slots", &slots},
                                {"positions", &positions},
                                {"k_cache", &k_cache},
                                {"v_cache", &v_cache}});
  const cache_geometry g = check_cache(c, qkv, slots, positions, k_cache, v_cache, d);
  const std::int32_t* sl = slots.data<std::int32_t>();
  const std::int32_t* pos = positions.data<std::int32_t>();
  const float* src = qkv.data<float>();
  float* kc = k_cache.data<float>();
  float* vc = v_cache.data<float>();
  const std::int64_t k_off = static_cast<std::int64_t>(d.heads) * d.head_dim;
  for (std::int64_t r = 0; r < g.rows; ++r) {
    const std::int64_t at = (static_cast<std::int64_t>(sl[r]) * g.positions + pos[r]) * g.kv_width;
    const float* row = src + r * g.qkv_width;
    std::copy(row + k_off, row + k_off + g.kv_width, kc + at);
    std::copy(row + k_off + g.kv_width, row + k_off + 2 * g.kv_width, vc + at);
  }
}

void cpu_backend::attention_decode(const tensor& qkv, const tensor& slots,
                                   const tensor& positions, const tensor& k_cache,
                                   const tensor& v_cache, const attention_dims& d, tensor& out) {
  op_check c("attention_decode", {{"qkv", &qkv},
                                  {"slots", &slots},
                                  {"positions", &positions},
                                  {"k_cache", &k_cache},
                                  {"v_cache", &v_cache},
                                  {"out", &out}});
  const cache_geometry g = check_cache(c, qkv, slots, positions, k_cache, v_cache, d);
  c.host(out, "out", core::dtype::f32);
  const int H = d.heads, D = d.head_dim, group = d.heads / d.kv_heads;
  const std::int64_t ow = static_cast<std::int64_t>(H) * D;
  c.matrix(out, "out", g.rows, ow, "one row per qkv row, H * D columns");
  const std::int32_t* sl = slots.data<std::int32_t>();
  const std::int32_t* pos = positions.data<std::int32_t>();
  const float* q_all = qkv.data<float>();
  const float* kc = k_cache.data<float>();
  const float* vc = v_cache.data<float>();
  float* o_all = out.data<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  parallel_for(g.rows * H, 1, [&](std::int64_t i0, std::int64_t i1) {
    std::vector<float> p;
    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t r = i / H;
      const int h = static_cast<int>(i % H), kvh = h / group;
      const std::int64_t n = static_cast<std::int64_t>(pos[r]) + 1;
      const std::int64_t base = static_cast<std::int64_t>(sl[r]) * g.positions * g.kv_width +
                                static_cast<std::int64_t>(kvh) * D;
      const float* q = q_all + r * g.qkv_width + static_cast<std::int64_t>(h) * D;
      p.assign(static_cast<std::size_t>(n), 0.0f);
      float top = -INFINITY;
      for (std::int64_t j = 0; j < n; ++j) {
        const float* k = kc + base + j * g.kv_width;
        float s = 0;
        for (int e = 0; e < D; ++e) s += q[e] * k[e];
        p[static_cast<std::size_t>(j)] = s * scale;
        top = std::max(top, s * scale);
      }
      float sum = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        float& e = p[static_cast<std::size_t>(j)];
        e = std::exp(e - top);
        sum += e;
      }
      float* o = o_all + r * ow + static_cast<std::int64_t>(h) * D;
      std::fill(o, o + D, 0.0f);
      for (std::int64_t j = 0; j < n; ++j) {
        const float* v = vc + base + j * g.kv_width;
        const float w = p[static_cast<std::size_t>(j)];
        for (int e = 0; e < D; ++e) o[e] += w * v[e];
      }
      const float inv = 1.0f / sum;
      for (int e = 0; e < D; ++e) o[e] *= inv;
    }
  });
}

}  // namespace troupe::kernels::cpu
