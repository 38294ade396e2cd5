// layernorm_forward / layernorm_backward on the CPU backend.
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

struct ln_out {
  vec y, mean, rstd;
};

ln_out layernorm_ref(const vec& x, const vec& w, const vec* b, int n, int ch, double eps) {
  ln_out o{vec(x.size()), vec(n), vec(n)};
  for (int r = 0; r < n; ++r) {
    double m = 0, v = 0;
    for (int j = 0; j < ch; ++j) m += x[r * ch + j];
    m /= ch;
    for (int j = 0; j < ch; ++j) v += (x[r * ch + j] - m) * (x[r * ch + j] - m);
    const double s = 1.0 / std::sqrt(v / ch + eps);
    for (int j = 0; j < ch; ++j)
      o.y[r * ch + j] = (x[r * ch + j] - m) * s * w[j] + (b ? (*b)[j] : 0.0);
    o.mean[r] = m;
    o.rstd[r] = s;
  }
  return o;
}

}  // namespace

TEST_CASE("layernorm forward matches a float64 reference and saves mean and rstd") {
  auto be = make_backend("cpu");
  const int n = 9, ch = 37;
  // An offset mean tests the two-pass variance.
  tensor x = randn({n, ch}, 1, 2.0f), w = randn({ch}, 2), b = randn({ch}, 3);
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 5.0f;
  tensor y = be->empty({n, ch}, dtype::f32), mean = be->empty({n}, dtype::f32),
         rstd = be->empty({n}, dtype::f32);
  be->layernorm_forward(x, w, b, 1e-5f, y, mean, rstd);
  const vec bv = to_vec(b);
  const ln_out want = layernorm_ref(to_vec(x), to_vec(w), &bv, n, ch, 1e-5);
  check_close(y, want.y, 1e-5, 1e-5, "y");
  check_close(mean, want.mean, 1e-6, 1e-6, "mean");
  check_close(rstd, want.rstd, 1e-5, 0, "rstd");
  be->layernorm_forward(x, w, tensor(), 1e-5f, y, mean, rstd);
  check_close(y, layernorm_ref(to_vec(x), to_vec(w), nullptr, n, ch, 1e-5).y, 1e-5, 1e-5,
              "y without bias");
}

TEST_CASE("layernorm backward matches central differences and accumulates") {
  auto be = make_backend("cpu");
  const int n = 5, ch = 7;
  const double eps = 1e-5;
  tensor x = randn({n, ch}, 4), w = randn({ch}, 5), b = randn({ch}, 6), dy = randn({n, ch}, 7);
  const vec xv = to_vec(x), wv = to_vec(w), bv = to_vec(b), dyv = to_vec(dy);
  auto f_x = [&](const vec& v) { return layernorm_ref(v, wv, &bv, n, ch, eps).y; };
  auto f_w = [&](const vec& v) { return layernorm_ref(xv, v, &bv, n, ch, eps).y; };
  auto f_b = [&](const vec& v) { return layernorm_ref(xv, wv, &v, n, ch, eps).y; };
  tensor y = be->empty({n, ch}, dtype::f32), mean = be->empty({n}, dtype::f32),
         rstd = be->empty({n}, dtype::f32);
  be->layernorm_forward(x, w, b, static_cast<float>(eps), y, mean, rstd);
  tensor dx = randn({n, ch}, 8), dw = randn({ch}, 9), db = randn({ch}, 10);
  const vec dx0 = to_vec(dx), dw0 = to_vec(dw), db0 = to_vec(db);
  be->layernorm_backward(dy, x, w, mean, rstd, dx, dw, db);
  check_close(dx, plus(dx0, numeric_grad(f_x, xv, dyv)), 1e-4, 1e-5, "dx");
  check_close(dw, plus(dw0, numeric_grad(f_w, wv, dyv)), 1e-4, 1e-5, "dw");
  check_close(db, plus(db0, numeric_grad(f_b, bv, dyv)), 1e-4, 1e-5, "db");
}

TEST_CASE("layernorm gives the same bits with 1 or 2 threads") {
  auto be = make_backend("cpu");
  const int n = 1024, ch = 128;
  tensor x = randn({n, ch}, 11), w = randn({ch}, 12), b = randn({ch}, 13), dy = randn({n, ch}, 14);
  auto run = [&] {
    tensor y = be->empty({n, ch}, dtype::f32), mean = be->empty({n}, dtype::f32),
           rstd = be->empty({n}, dtype::f32);
    tensor dx = be->empty({n, ch}, dtype::f32), dw = be->empty({ch}, dtype::f32),
           db = be->empty({ch}, dtype::f32);
    be->layernorm_forward(x, w, b, 1e-5f, y, mean, rstd);
    be->layernorm_backward(dy, x, w, mean, rstd, dx, dw, db);
    return std::vector<tensor>{y, mean, rstd, dx, dw, db};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("layernorm shape errors name the op and the shapes") {
  auto be = make_backend("cpu");
  tensor x = randn({4, 8}, 1), w = randn({7}, 2), y = be->empty({4, 8}, dtype::f32);
  tensor mean = be->empty({4}, dtype::f32), rstd = be->empty({4}, dtype::f32);
  const std::string msg =
      failure_message([&] { be->layernorm_forward(x, w, tensor(), 1e-5f, y, mean, rstd); });
  CHECK(msg.find("layernorm_forward: w must be [8]") != std::string::npos);
  CHECK(msg.find("w fp32 [7]") != std::string::npos);
  tensor w8 = randn({8}, 3), short_rstd = be->empty({3}, dtype::f32);
  CHECK(failure_message([&] {
          be->layernorm_forward(x, w8, tensor(), 1e-5f, y, mean, short_rstd);
        }).find("rstd must have 4 elements") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
