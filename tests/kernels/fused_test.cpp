// The fused backend ops through their default compositions (kernels/fused_defaults.cpp) on the
// CPU backend, against float64 references written here: every output is overwritten (NaN-filled
// before the call), never accumulated.
#include <cmath>
#include <limits>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

constexpr std::int64_t N = 37, IC = 24, OC = 40;

double gelu(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

double gelu_grad(double x) {
  const double k = std::sqrt(2 / M_PI);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}

/// x[N,IC] · w[OC,IC]ᵀ + b in float64.
vec linear_ref(const tensor& x, const tensor& w, const tensor& b) {
  vec y(static_cast<std::size_t>(N * OC));
  for (std::int64_t r = 0; r < N; ++r)
    for (std::int64_t o = 0; o < OC; ++o) {
      double acc = b.data<float>()[o];
      for (std::int64_t i = 0; i < IC; ++i)
        acc += static_cast<double>(x.data<float>()[r * IC + i]) * w.data<float>()[o * IC + i];
      y[static_cast<std::size_t>(r * OC + o)] = acc;
    }
  return y;
}

/// dy[N,OC] · w[OC,IC] in float64.
vec input_grad_ref(const tensor& dy, const tensor& w) {
  vec dx(static_cast<std::size_t>(N * IC));
  for (std::int64_t r = 0; r < N; ++r)
    for (std::int64_t i = 0; i < IC; ++i) {
      double acc = 0;
      for (std::int64_t o = 0; o < OC; ++o)
        acc += static_cast<double>(dy.data<float>()[r * OC + o]) * w.data<float>()[o * IC + i];
      dx[static_cast<std::size_t>(r * IC + i)] = acc;
    }
  return dx;
}

tensor nan_filled(backend& be, const core::shape_t& shape) {
  tensor t = be.empty(shape, dtype::f32);
  std::fill(t.data<float>(), t.data<float>() + t.numel(), std::numeric_limits<float>::quiet_NaN());
  return t;
}

}  // namespace

TEST_CASE("linear_forward_residual writes x*w^T + b + r") {
  auto be = make_backend("cpu");
  tensor x = randn({N, IC}, 1), w = randn({OC, IC}, 2, 0.3f), b = randn({OC}, 3);
  tensor r = randn({N, OC}, 4);
  tensor y = nan_filled(*be, {N, OC});
  be->linear_forward_residual(x, w, b, r, y);
  vec want = linear_ref(x, w, b);
  for (std::size_t i = 0; i < want.size(); ++i) want[i] += r.data<float>()[i];
  check_close(y, want, 1e-5, 1e-6, "y");
}

TEST_CASE("linear_forward_residual refuses an output that aliases the residual") {
  auto be = make_backend("cpu");
  tensor x = randn({N, IC}, 1), w = randn({OC, IC}, 2), b = randn({OC}, 3);
  tensor r = randn({N, OC}, 4);
  const std::string msg = failure_message([&] { be->linear_forward_residual(x, w, b, r, r); });
  CHECK(msg.find("linear_forward_residual: y must not alias the residual r") != std::string::npos);
}

TEST_CASE("linear_gelu_forward writes the pre-activation and its tanh GELU") {
  auto be = make_backend("cpu");
  tensor x = randn({N, IC}, 5), w = randn({OC, IC}, 6, 0.4f), b = randn({OC}, 7);
  tensor pre = nan_filled(*be, {N, OC}), y = nan_filled(*be, {N, OC});
  be->linear_gelu_forward(x, w, b, pre, y);
  const vec want_pre = linear_ref(x, w, b);
  check_close(pre, want_pre, 1e-5, 1e-6, "pre");
  // GELU of the stored (float-rounded) pre-activation: y is computed from pre, not from want_pre.
  vec want_y(want_pre.size());
  for (std::size_t i = 0; i < want_y.size(); ++i) want_y[i] = gelu(pre.data<float>()[i]);
  check_close(y, want_y, 2e-6, 1e-7, "y");
}

TEST_CASE("linear_backward_input_write overwrites dx with dy*w") {
  auto be = make_backend("cpu");
  tensor dy = randn({N, OC}, 8), w = randn({OC, IC}, 9);
  tensor dx = nan_filled(*be, {N, IC});
  be->linear_backward_input_write(dy, w, dx);
  check_close(dx, input_grad_ref(dy, w), 1e-5, 1e-6, "dx");
}

TEST_CASE("layernorm_backward_residual writes residual + the norm's input gradient") {
  auto be = make_backend("cpu");
  tensor x = randn({N, IC}, 12), w = randn({IC}, 13), b = randn({IC}, 14), dy = randn({N, IC}, 15);
  tensor res = randn({N, IC}, 16), dw0 = randn({IC}, 17), db0 = randn({IC}, 18);
  tensor y = be->empty({N, IC}, dtype::f32), mean = be->empty({N}, dtype::f32),
         rstd = be->empty({N}, dtype::f32);
  be->layernorm_forward(x, w, b, 1e-5f, y, mean, rstd);
  // The accumulating op (checked against finite differences) onto a dx that holds the residual.
  tensor dx_acc = res.clone(), dw_acc = dw0.clone(), db_acc = db0.clone();
  be->layernorm_backward(dy, x, w, mean, rstd, dx_acc, dw_acc, db_acc);
  tensor dx = nan_filled(*be, {N, IC}), dw = dw0.clone(), db = db0.clone(), none;
  be->layernorm_backward_residual(dy, x, w, mean, rstd, res, dx, dw, db, none);
  CHECK(same_bits(dx, dx_acc));
  CHECK(same_bits(dw, dw_acc));
  CHECK(same_bits(db, db_acc));
  CHECK_THROWS(be->layernorm_backward_residual(dy, x, w, mean, rstd, res, res, dw, db, none));
  // The residual's column sums join rsum with the bits of a linear layer's bias gradient for an
  // output gradient equal to the residual (the projection whose output joined it).
  tensor rs0 = randn({IC}, 19), rsum = rs0.clone(), db_lin = rs0.clone();
  tensor dx2 = nan_filled(*be, {N, IC}), dw2 = dw0.clone(), db2 = db0.clone();
  be->layernorm_backward_residual(dy, x, w, mean, rstd, res, dx2, dw2, db2, rsum);
  CHECK(same_bits(dx2, dx_acc));
  CHECK(same_bits(dw2, dw_acc));
  CHECK(same_bits(db2, db_acc));
  tensor x_lin = randn({N, 3}, 20), dw_lin = tensor::zeros({IC, 3});
  be->linear_backward_weight(res, x_lin, dw_lin, db_lin);
  CHECK(same_bits(rsum, db_lin));
  tensor direct = rs0.clone();
  be->sum_rows(res, direct);
  CHECK(same_bits(direct, db_lin));
  // Against a plain sum in double.
  for (std::int64_t c = 0; c < IC; ++c) {
    double want = rs0.data<float>()[c];
    for (std::int64_t r = 0; r < N; ++r) want += res.data<float>()[r * IC + c];
    CHECK(rsum.data<float>()[c] == doctest::Approx(want).epsilon(1e-5));
  }
}

TEST_CASE("rmsnorm_backward_residual writes residual + the norm's input gradient") {
  auto be = make_backend("cpu");
  tensor x = randn({N, IC}, 22), w = randn({IC}, 23), dy = randn({N, IC}, 24);
  tensor res = randn({N, IC}, 25), dw0 = randn({IC}, 26);
  tensor y = be->empty({N, IC}, dtype::f32), rstd = be->empty({N}, dtype::f32);
  be->rmsnorm_forward(x, w, 1e-6f, y, rstd);
  tensor dx_acc = res.clone(), dw_acc = dw0.clone();
  be->rmsnorm_backward(dy, x, w, rstd, dx_acc, dw_acc);
  tensor dx = nan_filled(*be, {N, IC}), dw = dw0.clone();
  be->rmsnorm_backward_residual(dy, x, w, rstd, res, dx, dw);
  CHECK(same_bits(dx, dx_acc));
  CHECK(same_bits(dw, dw_acc));
  CHECK_THROWS(be->rmsnorm_backward_residual(dy, x, w, rstd, res, res, dw));
}

TEST_CASE("attention_backward_write overwrites dqkv with the gradient attention_backward adds") {
  auto be = make_backend("cpu");
  const attention_dims d{2, 5, 4, 2, 4};
  const std::int64_t rows = d.batch * d.seq, width = (d.heads + 2 * d.kv_heads) * d.head_dim;
  tensor qkv = randn({rows, width}, 10), dout = randn({rows, d.heads * d.head_dim}, 11);
  tensor out = be->empty({rows, d.heads * d.head_dim}, dtype::f32);
  tensor lse = be->empty({d.batch, d.heads, d.seq}, dtype::f32);
  be->attention_forward(qkv, d, out, lse);
  tensor added = tensor::zeros({rows, width});  // the accumulating op, checked against finite differences
  be->attention_backward(dout, qkv, out, lse, d, added);
  tensor written = nan_filled(*be, {rows, width}), none;
  be->attention_backward_write(dout, qkv, out, lse, d, written, none);
  CHECK(same_bits(written, added));
  // dsum: written over NaN, sum_rows' bits of the written gradient.
  tensor again = nan_filled(*be, {rows, width}), dsum = nan_filled(*be, {width});
  be->attention_backward_write(dout, qkv, out, lse, d, again, dsum);
  CHECK(same_bits(again, added));
  tensor want = tensor::zeros({width});
  be->sum_rows(added, want);
  CHECK(same_bits(dsum, want));
}

TEST_CASE("linear_backward_input_gelu overwrites dx with (dy*w) times gelu'(pre)") {
  auto be = make_backend("cpu");
  tensor dy = randn({N, OC}, 10), w = randn({OC, IC}, 11), pre = randn({N, IC}, 12, 2.0f);
  tensor dx = nan_filled(*be, {N, IC});
  be->linear_backward_input_gelu(dy, w, pre, dx);
  vec want = input_grad_ref(dy, w);
  for (std::size_t i = 0; i < want.size(); ++i) want[i] *= gelu_grad(pre.data<float>()[i]);
  check_close(dx, want, 1e-5, 1e-6, "dx");
}

TEST_CASE("fused defaults give the same bits as the unfused op sequence") {
  // The model switched to these ops; on the CPU its numbers must stay those of the plain ops.
  auto be = make_backend("cpu");
  tensor x = randn({N, IC}, 13), w = randn({OC, IC}, 14), b = randn({OC}, 15);
  tensor pre = be->empty({N, OC}, dtype::f32), y = be->empty({N, OC}, dtype::f32);
  be->linear_gelu_forward(x, w, b, pre, y);
  tensor pre2 = be->empty({N, OC}, dtype::f32), y2 = be->empty({N, OC}, dtype::f32);
  be->linear_forward(x, w, b, pre2);
  be->gelu_forward(pre2, y2);
  CHECK(same_bits(pre, pre2));
  CHECK(same_bits(y, y2));

  tensor dy = randn({N, IC}, 16), w2 = randn({IC, OC}, 17);  // next layer: [IC, OC] weight
  tensor dfc = nan_filled(*be, {N, OC});
  be->linear_backward_input_gelu(dy, w2, pre, dfc);
  tensor dact = be->empty({N, OC}, dtype::f32), dfc2 = be->empty({N, OC}, dtype::f32);
  be->linear_backward_input(dy, w2, dact);
  be->gelu_backward(dact, pre, dfc2);
  CHECK(same_bits(dfc, dfc2));
}

}  // namespace troupe::kernels::cpu_test
