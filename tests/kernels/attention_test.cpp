// attention_forward / attention_backward on the CPU backend: causal, GQA, flash-style (lse only).
#include <algorithm>
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

struct attn_out {
  vec out, lse;
};

// Naive causal attention in float64 with the full T×T score matrix.
attn_out attention_ref(const vec& qkv, const attention_dims& d) {
  const int B = d.batch, T = d.seq, H = d.heads, G = d.kv_heads, D = d.head_dim;
  const int W = (H + 2 * G) * D;
  attn_out r{vec(static_cast<std::size_t>(B) * T * H * D),
             vec(static_cast<std::size_t>(B) * H * T)};
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / G);
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(t + 1);
        double m = -1e300;
        for (int j = 0; j <= t; ++j) {
          double dot = 0;
          for (int e = 0; e < D; ++e)
            dot += qkv[(b * T + t) * W + h * D + e] * qkv[(b * T + j) * W + (H + g) * D + e];
          s[j] = dot / std::sqrt(static_cast<double>(D));
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (int j = 0; j <= t; ++j) l += std::exp(s[j] - m);
        for (int e = 0; e < D; ++e) {
          double o = 0;
          for (int j = 0; j <= t; ++j)
            o += std::exp(s[j] - m) / l * qkv[(b * T + j) * W + (H + G + g) * D + e];
          r.out[((b * T + t) * H + h) * D + e] = o;
        }
        r.lse[(b * H + h) * T + t] = m + std::log(l);
      }
    }
  return r;
}

tensor make_out(backend& be, const attention_dims& d) {
  return be.empty({d.batch * d.seq, d.heads * d.head_dim}, dtype::f32);
}

tensor make_lse(backend& be, const attention_dims& d) {
  return be.empty({d.batch, d.heads, d.seq}, dtype::f32);
}

}  // namespace

TEST_CASE("attention forward matches naive causal attention, for MHA and GQA") {
  auto be = make_backend("cpu");
  for (attention_dims d : {attention_dims{2, 7, 3, 3, 8}, attention_dims{2, 9, 4, 2, 6},
                           attention_dims{1, 5, 4, 1, 4}}) {
    CAPTURE(d.heads);
    CAPTURE(d.kv_heads);
    tensor qkv = randn({d.batch * d.seq, (d.heads + 2 * d.kv_heads) * d.head_dim}, 1);
    tensor out = make_out(*be, d), lse = make_lse(*be, d);
    be->attention_forward(qkv, d, out, lse);
    const attn_out want = attention_ref(to_vec(qkv), d);
    check_close(out, want.out, 1e-5, 1e-6, "out");
    check_close(lse, want.lse, 1e-5, 1e-6, "lse");
  }
}

TEST_CASE("attention is causal: changing later tokens leaves earlier outputs unchanged") {
  auto be = make_backend("cpu");
  const attention_dims d{1, 8, 2, 2, 4};
  tensor qkv = randn({8, 24}, 2), changed = qkv.clone();
  for (int j = 0; j < 24; ++j) changed.data<float>()[6 * 24 + j] += 1.0f;  // row 6 only
  tensor out_a = make_out(*be, d), out_b = make_out(*be, d), lse = make_lse(*be, d);
  be->attention_forward(qkv, d, out_a, lse);
  be->attention_forward(changed, d, out_b, lse);
  const float* a = out_a.data<float>();
  const float* b = out_b.data<float>();
  CHECK(std::equal(a, a + 6 * 8, b));
  CHECK_FALSE(std::equal(a + 6 * 8, a + 7 * 8, b + 6 * 8));
}

TEST_CASE("attention backward matches central differences of the forward, for MHA and GQA") {
  auto be = make_backend("cpu");
  for (attention_dims d : {attention_dims{2, 5, 2, 2, 4}, attention_dims{2, 5, 4, 2, 4}}) {
    CAPTURE(d.kv_heads);
    const int w = (d.heads + 2 * d.kv_heads) * d.head_dim;
    tensor qkv = randn({d.batch * d.seq, w}, 3),
           dout = randn({d.batch * d.seq, d.heads * d.head_dim}, 4);
    tensor out = make_out(*be, d), lse = make_lse(*be, d);
    be->attention_forward(qkv, d, out, lse);
    tensor dqkv = randn({d.batch * d.seq, w}, 5);
    const vec g0 = to_vec(dqkv);
    be->attention_backward(dout, qkv, out, lse, d, dqkv);
    auto f = [&](const vec& v) { return attention_ref(v, d).out; };
    check_close(dqkv, plus(g0, numeric_grad(f, to_vec(qkv), to_vec(dout))), 1e-4, 1e-5, "dqkv");
  }
}

TEST_CASE("attention gives the same bits with 1 or 2 threads at the tiny demo's shape") {
  auto be = make_backend("cpu");
  const attention_dims d{16, 64, 4, 4, 32};
  tensor qkv = randn({1024, 384}, 6), dout = randn({1024, 128}, 7);
  auto run = [&] {
    tensor out = make_out(*be, d), lse = make_lse(*be, d),
           dqkv = be->empty({1024, 384}, dtype::f32);
    be->attention_forward(qkv, d, out, lse);
    be->attention_backward(dout, qkv, out, lse, d, dqkv);
    return std::vector<tensor>{out, lse, dqkv};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("attention shape errors name the op, the dims and the shapes") {
  auto be = make_backend("cpu");
  const attention_dims d{2, 4, 4, 2, 8};
  tensor qkv = randn({8, 64}, 1), out = make_out(*be, d), lse = make_lse(*be, d);
  CHECK(failure_message([&] { be->attention_forward(qkv, d, out, lse); }).empty());
  tensor narrow = randn({8, 48}, 2);
  const std::string narrow_msg =
      failure_message([&] { be->attention_forward(narrow, d, out, lse); });
  CHECK(narrow_msg.find("attention_forward: qkv must be [8, 64]") != std::string::npos);
  CHECK(narrow_msg.find("qkv fp32 [8, 48]") != std::string::npos);
  const attention_dims bad{2, 4, 3, 2, 8};
  CHECK(failure_message([&] {
          be->attention_forward(qkv, bad, out, lse);
        }).find("heads % kv_heads == 0") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
