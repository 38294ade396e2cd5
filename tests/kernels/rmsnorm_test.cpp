// rmsnorm_forward / rmsnorm_backward on the CPU backend.
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

std::pair<vec, vec> rmsnorm_ref(const vec& x, const vec& w, int n, int ch, double eps) {
  vec y(x.size()), rstd(n);
  for (int r = 0; r < n; ++r) {
    double ss = 0;
    for (int j = 0; j < ch; ++j) ss += x[r * ch + j] * x[r * ch + j];
    const double s = 1.0 / std::sqrt(ss / ch + eps);
    for (int j = 0; j < ch; ++j) y[r * ch + j] = x[r * ch + j] * s * w[j];
    rstd[r] = s;
  }
  return {y, rstd};
}

}  // namespace

TEST_CASE("rmsnorm forward matches a float64 reference and saves rstd") {
  auto be = make_backend("cpu");
  const int n = 6, ch = 45;
  tensor x = randn({n, ch}, 1, 3.0f), w = randn({ch}, 2);
  tensor y = be->empty({n, ch}, dtype::f32), rstd = be->empty({n}, dtype::f32);
  be->rmsnorm_forward(x, w, 1e-6f, y, rstd);
  const auto [want_y, want_rstd] = rmsnorm_ref(to_vec(x), to_vec(w), n, ch, 1e-6);
  check_close(y, want_y, 1e-5, 1e-5, "y");
  check_close(rstd, want_rstd, 1e-5, 0, "rstd");
}

TEST_CASE("rmsnorm backward matches central differences and accumulates") {
  auto be = make_backend("cpu");
  const int n = 4, ch = 9;
  const double eps = 1e-6;
  tensor x = randn({n, ch}, 3), w = randn({ch}, 4), dy = randn({n, ch}, 5);
  const vec xv = to_vec(x), wv = to_vec(w), dyv = to_vec(dy);
  tensor y = be->empty({n, ch}, dtype::f32), rstd = be->empty({n}, dtype::f32);
  be->rmsnorm_forward(x, w, static_cast<float>(eps), y, rstd);
  tensor dx = randn({n, ch}, 6), dw = randn({ch}, 7);
  const vec dx0 = to_vec(dx), dw0 = to_vec(dw);
  be->rmsnorm_backward(dy, x, w, rstd, dx, dw);
  auto f_x = [&](const vec& v) { return rmsnorm_ref(v, wv, n, ch, eps).first; };
  auto f_w = [&](const vec& v) { return rmsnorm_ref(xv, v, n, ch, eps).first; };
  check_close(dx, plus(dx0, numeric_grad(f_x, xv, dyv)), 1e-4, 1e-5, "dx");
  check_close(dw, plus(dw0, numeric_grad(f_w, wv, dyv)), 1e-4, 1e-5, "dw");
}

TEST_CASE("rmsnorm gives the same bits with 1 or 2 threads") {
  auto be = make_backend("cpu");
  const int n = 1024, ch = 96;
  tensor x = randn({n, ch}, 8), w = randn({ch}, 9), dy = randn({n, ch}, 10);
  auto run = [&] {
    tensor y = be->empty({n, ch}, dtype::f32), rstd = be->empty({n}, dtype::f32);
    tensor dx = be->empty({n, ch}, dtype::f32), dw = be->empty({ch}, dtype::f32);
    be->rmsnorm_forward(x, w, 1e-6f, y, rstd);
    be->rmsnorm_backward(dy, x, w, rstd, dx, dw);
    return std::vector<tensor>{y, rstd, dx, dw};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("rmsnorm shape errors name the op and the shapes") {
  auto be = make_backend("cpu");
  tensor x = randn({3, 4}, 1), w = randn({4}, 2), y = be->empty({3, 4}, dtype::f32);
  tensor rstd = be->empty({3}, dtype::f32), dx = be->empty({3, 5}, dtype::f32),
         dw = be->empty({4}, dtype::f32);
  const std::string msg = failure_message([&] { be->rmsnorm_backward(y, x, w, rstd, dx, dw); });
  CHECK(msg.find("rmsnorm_backward: dx must be [3, 4]") != std::string::npos);
  CHECK(msg.find("dx fp32 [3, 5]") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
