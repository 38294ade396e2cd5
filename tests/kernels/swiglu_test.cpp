// swiglu_forward / swiglu_backward on the CPU backend.
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

vec swiglu_ref(const vec& gate, const vec& up) {
  vec y(gate.size());
  for (std::size_t i = 0; i < gate.size(); ++i) y[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
  return y;
}

}  // namespace

TEST_CASE("swiglu forward matches silu(gate) * up in float64, far tails included") {
  auto be = make_backend("cpu");
  tensor gate = randn({500}, 1, 3.0f), up = randn({500}, 2);
  const float tails[] = {-100.0f, -30.0f, -10.0f, 0.0f, 10.0f, 30.0f, 100.0f};
  std::copy(std::begin(tails), std::end(tails), gate.data<float>());
  tensor y = be->empty({500}, dtype::f32);
  be->swiglu_forward(gate, up, y);
  check_close(y, swiglu_ref(to_vec(gate), to_vec(up)), 2e-6, 1e-7, "y");
}

TEST_CASE("swiglu backward matches central differences and overwrites its outputs") {
  auto be = make_backend("cpu");
  tensor gate = randn({40}, 3, 2.0f), up = randn({40}, 4), dy = randn({40}, 5);
  tensor dgate = randn({40}, 6), dup = randn({40}, 7);
  const vec g = to_vec(gate), u = to_vec(up), d = to_vec(dy);
  be->swiglu_backward(dy, gate, up, dgate, dup);  // the random values there are overwritten
  check_close(dgate, numeric_grad([&](const vec& v) { return swiglu_ref(v, u); }, g, d), 1e-5, 1e-6,
              "dgate");
  check_close(dup, numeric_grad([&](const vec& v) { return swiglu_ref(g, v); }, u, d), 1e-5, 1e-6,
              "dup");
}

TEST_CASE("swiglu gives the same bits with 1 or 2 threads") {
  auto be = make_backend("cpu");
  tensor gate = randn({512, 344}, 8), up = randn({512, 344}, 9), dy = randn({512, 344}, 10);
  auto run = [&] {
    tensor y = be->empty({512, 344}, dtype::f32), dg = be->empty({512, 344}, dtype::f32),
           du = be->empty({512, 344}, dtype::f32);
    be->swiglu_forward(gate, up, y);
    be->swiglu_backward(dy, gate, up, dg, du);
    return std::vector<tensor>{y, dg, du};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("swiglu size errors name the op and the shapes") {
  auto be = make_backend("cpu");
  tensor gate = randn({2, 3}, 1), up = randn({2, 2}, 2), y = be->empty({2, 3}, dtype::f32);
  const std::string msg = failure_message([&] { be->swiglu_forward(gate, up, y); });
  CHECK(msg.find("swiglu_forward: up must have 6 elements") != std::string::npos);
  CHECK(msg.find("up fp32 [2, 2]") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
