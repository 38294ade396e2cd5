// add / accumulate / scale on the CPU backend.
#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {

TEST_CASE("add writes a + b, also in place over a") {
  auto be = make_backend("cpu");
  tensor a = randn({300, 7}, 1), b = randn({300, 7}, 2), y = be->empty({300, 7}, dtype::f32);
  const vec av = to_vec(a), bv = to_vec(b);
  be->add(a, b, y);
  check_close(y, plus(av, bv), 1.2e-7, 0, "y");
  be->add(a, b, a);
  check_close(a, plus(av, bv), 1.2e-7, 0, "a after in-place add");
}

TEST_CASE("accumulate adds x into y and scale multiplies in place") {
  auto be = make_backend("cpu");
  tensor x = randn({200000}, 3), y = randn({200000}, 4);
  const vec xv = to_vec(x), yv = to_vec(y);
  be->accumulate(x, y);
  check_close(y, plus(xv, yv), 1.2e-7, 0, "y");
  be->scale(x, 0.25f);
  vec quarter = xv;
  for (auto& v : quarter) v *= 0.25;
  check_close(x, quarter, 0, 0, "x");
}

TEST_CASE("element-wise ops reject tensors of different sizes and types") {
  auto be = make_backend("cpu");
  tensor a = randn({4}, 1), b = randn({5}, 2), y = be->empty({4}, dtype::f32);
  const std::string msg = failure_message([&] { be->add(a, b, y); });
  CHECK(msg.find("add: b must have 4 elements") != std::string::npos);
  CHECK(msg.find("b fp32 [5]") != std::string::npos);
  tensor half = be->empty({4}, dtype::bf16);
  CHECK(failure_message([&] { be->accumulate(a, half); }).find("accumulate: y must be fp32") !=
        std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
