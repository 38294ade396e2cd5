// fast_exp / fast_sigmoid and the fixed-order sums of kernels/cpu/fast_math.hpp.
#include "kernels/cpu/fast_math.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "tests/kernels/cpu_test_util.hpp"

namespace troupe::kernels::cpu_test {

TEST_CASE("fast_exp is within 3e-7 relative of exp over its whole normal range") {
  double worst = 0;
  float at = 0;
  for (float x = -87.0f; x <= 88.72f; x += 0.000731f) {
    const double want = std::exp(static_cast<double>(x));
    const double err = std::abs(cpu::fast_exp(x) - want) / want;
    if (err > worst) {
      worst = err;
      at = x;
    }
  }
  CAPTURE(at);
  CHECK(worst < 3e-7);
}

TEST_CASE("fast_exp flushes below -87, overflows above 88.72 and keeps NaN") {
  CHECK(cpu::fast_exp(-87.5f) == 0.0f);
  CHECK(cpu::fast_exp(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(cpu::fast_exp(0.0f) == 1.0f);
  CHECK(std::isinf(cpu::fast_exp(89.0f)));
  CHECK(std::isinf(cpu::fast_exp(std::numeric_limits<float>::infinity())));
  CHECK(std::isfinite(cpu::fast_exp(88.72f)));
  CHECK(std::isnan(cpu::fast_exp(std::nanf(""))));
}

TEST_CASE("fast_sigmoid saturates without NaN") {
  CHECK(cpu::fast_sigmoid(-200.0f) == 0.0f);
  CHECK(cpu::fast_sigmoid(200.0f) == 1.0f);
  CHECK(std::abs(cpu::fast_sigmoid(0.5f) - 1.0 / (1.0 + std::exp(-0.5))) < 1e-7);
}

TEST_CASE("fixed-order sums do not depend on the address the data starts at") {
  // The same 37 values at two alignments give the same bits: lanes follow the index, not memory.
  std::vector<float> a(64), b(64);
  tensor r = randn({37}, 1);
  std::copy(r.data<float>(), r.data<float>() + 37, a.begin());
  std::copy(r.data<float>(), r.data<float>() + 37, b.begin() + 3);
  CHECK(cpu::sum(a.data(), 37) == cpu::sum(b.data() + 3, 37));
  CHECK(cpu::dot(a.data(), a.data(), 37) == cpu::dot(b.data() + 3, b.data() + 3, 37));
  double want = 0;
  for (int i = 0; i < 37; ++i) want += a[i];
  CHECK(std::abs(cpu::sum(a.data(), 37) - want) < 1e-5);
}

}  // namespace troupe::kernels::cpu_test
