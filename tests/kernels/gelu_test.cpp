// gelu_forward / gelu_backward on the CPU backend.
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

vec gelu_ref(const vec& x) {
  vec y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    y[i] =
        0.5 * x[i] * (1 + std::tanh(std::sqrt(2 / M_PI) * (x[i] + 0.044715 * x[i] * x[i] * x[i])));
  return y;
}

}  // namespace

TEST_CASE("gelu forward matches the tanh formula in float64, far tails included") {
  auto be = make_backend("cpu");
  tensor x = randn({1000}, 1, 3.0f);
  const float tails[] = {-40.0f, -12.0f, -6.0f, 0.0f, 1e-8f, 6.0f, 12.0f, 40.0f};
  std::copy(std::begin(tails), std::end(tails), x.data<float>());
  tensor y = be->empty({1000}, dtype::f32);
  be->gelu_forward(x, y);
  check_close(y, gelu_ref(to_vec(x)), 2e-6, 1e-7, "y");
}

TEST_CASE("gelu backward matches central differences and accumulates") {
  auto be = make_backend("cpu");
  tensor x = randn({64}, 2, 2.0f), dy = randn({64}, 3), dx = randn({64}, 4);
  const vec dx0 = to_vec(dx);
  be->gelu_backward(dy, x, dx);
  check_close(dx, plus(dx0, numeric_grad(gelu_ref, to_vec(x), to_vec(dy))), 1e-5, 1e-6, "dx");
}

TEST_CASE("gelu gives the same bits with 1 or 2 threads") {
  auto be = make_backend("cpu");
  tensor x = randn({1024, 512}, 5), dy = randn({1024, 512}, 6);
  auto run = [&] {
    tensor y = be->empty({1024, 512}, dtype::f32), dx = be->empty({1024, 512}, dtype::f32);
    be->gelu_forward(x, y);
    be->gelu_backward(dy, x, dx);
    return std::vector<tensor>{y, dx};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("gelu size errors name the op and the shapes") {
  auto be = make_backend("cpu");
  tensor x = randn({4, 3}, 1), y = be->empty({4, 4}, dtype::f32);
  const std::string msg = failure_message([&] { be->gelu_forward(x, y); });
  CHECK(msg.find("gelu_forward: y must have 12 elements") != std::string::npos);
  CHECK(msg.find("y fp32 [4, 4]") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
