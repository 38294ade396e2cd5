// linear_forward / linear_backward_input / linear_backward_weight on the CPU backend.
#include <thread>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

// y[n,oc] = x[n,ic] · w[oc,ic]ᵀ + b in float64.
vec linear_ref(const vec& x, const vec& w, const vec* b, int n, int ic, int oc) {
  vec y(static_cast<std::size_t>(n) * oc);
  for (int r = 0; r < n; ++r)
    for (int o = 0; o < oc; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (int i = 0; i < ic; ++i) s += x[r * ic + i] * w[o * ic + i];
      y[r * oc + o] = s;
    }
  return y;
}

}  // namespace

TEST_CASE("linear forward matches a float64 reference, with and without bias") {
  auto be = make_backend("cpu");
  // The second shape is cut into 2 blocks (2·520·260·128 flops = 2.2 × 16 M; 520 rows >= 2 × 128).
  for (auto [n, ic, oc] : {std::tuple{7, 5, 6}, std::tuple{520, 128, 260}}) {
    tensor x = randn({n, ic}, 1), w = randn({oc, ic}, 2, 0.3f), b = randn({oc}, 3);
    tensor y = be->empty({n, oc}, dtype::f32);
    be->linear_forward(x, w, b, y);
    const vec bv = to_vec(b);
    check_close(y, linear_ref(to_vec(x), to_vec(w), &bv, n, ic, oc), 1e-5, 1e-5, "y with bias");
    be->linear_forward(x, w, tensor(), y);
    check_close(y, linear_ref(to_vec(x), to_vec(w), nullptr, n, ic, oc), 1e-5, 1e-5,
                "y without bias");
  }
}

TEST_CASE("linear backward matches central differences of the forward and accumulates") {
  auto be = make_backend("cpu");
  const int n = 6, ic = 5, oc = 4;
  tensor x = randn({n, ic}, 4), w = randn({oc, ic}, 5), b = randn({oc}, 6), dy = randn({n, oc}, 7);
  const vec xv = to_vec(x), wv = to_vec(w), bv = to_vec(b), dyv = to_vec(dy);
  const vec want_dx =
      numeric_grad([&](const vec& v) { return linear_ref(v, wv, &bv, n, ic, oc); }, xv, dyv);
  const vec want_dw =
      numeric_grad([&](const vec& v) { return linear_ref(xv, v, &bv, n, ic, oc); }, wv, dyv);
  const vec want_db =
      numeric_grad([&](const vec& v) { return linear_ref(xv, wv, &v, n, ic, oc); }, bv, dyv);
  // Start from non-zero gradients: every backward adds.
  tensor dx = randn({n, ic}, 8), dw = randn({oc, ic}, 9), db = randn({oc}, 10);
  const vec dx0 = to_vec(dx), dw0 = to_vec(dw), db0 = to_vec(db);
  be->linear_backward_input(dy, w, dx);
  be->linear_backward_weight(dy, x, dw, db);
  check_close(dx, plus(dx0, want_dx), 1e-5, 1e-5, "dx");
  check_close(dw, plus(dw0, want_dw), 1e-5, 1e-5, "dw");
  check_close(db, plus(db0, want_db), 1e-5, 1e-5, "db");
}

TEST_CASE("linear backward_weight without db leaves db alone and still adds dw") {
  auto be = make_backend("cpu");
  tensor x = randn({3, 2}, 11), dy = randn({3, 2}, 12), dw = randn({2, 2}, 13);
  const vec dw0 = to_vec(dw);
  tensor none;
  be->linear_backward_weight(dy, x, dw, none);
  const vec xv = to_vec(x), dyv = to_vec(dy);
  vec want = dw0;
  for (int o = 0; o < 2; ++o)
    for (int i = 0; i < 2; ++i)
      for (int r = 0; r < 3; ++r) want[o * 2 + i] += dyv[r * 2 + o] * xv[r * 2 + i];
  check_close(dw, want, 1e-6, 1e-6, "dw");
}

TEST_CASE("linear gives the same bits with 1 or 2 threads and on a repeated call") {
  auto be = make_backend("cpu");
  // The tiny demo's qkv projection (1024 rows cut into blocks) and a head-like wide output.
  for (auto shape : {std::tuple{1024, 128, 384}, std::tuple{256, 128, 3000}}) {
    const auto [n_, ic_, oc_] = shape;
    const int n = n_, ic = ic_, oc = oc_;  // plain names: the lambda below captures them
    tensor x = randn({n, ic}, 20), w = randn({oc, ic}, 21, 0.1f), b = randn({oc}, 22);
    tensor dy = randn({n, oc}, 23);
    auto run = [&] {
      tensor y = be->empty({n, oc}, dtype::f32), dx = randn({n, ic}, 24);
      tensor dw = randn({oc, ic}, 25), db = randn({oc}, 26);
      be->linear_forward(x, w, b, y);
      be->linear_backward_input(dy, w, dx);
      be->linear_backward_weight(dy, x, dw, db);
      return std::vector<tensor>{y, dx, dw, db};
    };
    std::vector<tensor> one, two, again;
    with_threads(1, [&] { one = run(); });
    with_threads(2, [&] {
      two = run();
      again = run();
    });
    for (std::size_t i = 0; i < one.size(); ++i) {
      CAPTURE(i);
      CHECK(same_bits(one[i], two[i]));
      CHECK(same_bits(two[i], again[i]));
    }
  }
}

TEST_CASE("linear called from four threads at once gives the serial bits") {
  auto be = make_backend("cpu");
  tensor x = randn({1024, 128}, 30), w = randn({384, 128}, 31, 0.1f);
  tensor serial = be->empty({1024, 384}, dtype::f32);
  be->linear_forward(x, w, tensor(), serial);
  std::vector<tensor> outs(4);
  std::vector<std::thread> threads;
  for (auto& out : outs) {
    out = be->empty({1024, 384}, dtype::f32);
    threads.emplace_back([&] {
      for (int rep = 0; rep < 3; ++rep) be->linear_forward(x, w, tensor(), out);
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& out : outs) CHECK(same_bits(out, serial));
}

TEST_CASE("linear shape errors name the op and the shapes") {
  auto be = make_backend("cpu");
  tensor x = randn({7, 4}, 1), w = randn({6, 5}, 2), y = be->empty({7, 6}, dtype::f32);
  const std::string msg = failure_message([&] { be->linear_forward(x, w, tensor(), y); });
  CHECK(msg.find("linear_forward") != std::string::npos);
  CHECK(msg.find("x fp32 [7, 4]") != std::string::npos);
  CHECK(msg.find("w fp32 [6, 5]") != std::string::npos);
  tensor dx = be->empty({7, 4}, dtype::f32), dy = randn({7, 5}, 3);
  CHECK(failure_message([&] {
          be->linear_backward_input(dy, w, dx);
        }).find("linear_backward_input") != std::string::npos);
  tensor dw = be->empty({6, 5}, dtype::f32), bad_db = be->empty({5}, dtype::f32);
  tensor dy_ok = randn({7, 6}, 4), x_ok = randn({7, 5}, 5);
  CHECK(failure_message([&] {
          be->linear_backward_weight(dy_ok, x_ok, dw, bad_db);
        }).find("db must be [6]") != std::string::npos);
  tensor half = be->empty({7, 5}, dtype::bf16);
  CHECK(failure_message([&] { be->linear_forward(half, w, tensor(), y); }).find("x must be fp32") !=
        std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
