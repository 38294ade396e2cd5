#include "core/exact_sum.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

using troupe::core::exact_sum;

// An independent reference: Shewchuk's exact expansion (non-overlapping partials), rounded at the
// end with the half-way correction — the algorithm of Python's math.fsum. Valid while no partial
// overflows, which the random cases below respect.
double fsum(const std::vector<double>& xs) {
  std::vector<double> partials;
  for (double x : xs) {
    std::size_t i = 0;
    for (double y : partials) {
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y;
      const double lo = y - (hi - x);
      if (lo != 0.0) partials[i++] = lo;
      x = hi;
    }
    partials.resize(i);
    partials.push_back(x);
  }
  std::size_t n = partials.size();
  if (n == 0) return 0.0;
  double hi = partials[--n], lo = 0;
  while (n > 0) {
    const double x = hi;
    const double y = partials[--n];
    hi = x + y;
    const double yr = hi - x;
    lo = y - yr;
    if (lo != 0.0) break;
  }
  if (n > 0 && ((lo < 0 && partials[n - 1] < 0) || (lo > 0 && partials[n - 1] > 0))) {
    const double y = lo * 2;
    const double x = hi + y;
    if (y == x - hi) hi = x;
  }
  return hi;
}

double sum_of(const std::vector<double>& xs) {
  exact_sum s;
  for (double x : xs) s.add(x);
  return s.value();
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST_CASE("exact_sum rounds the exact sum once, ties to even") {
  const double u = std::ldexp(1.0, -53);    // half an ulp of 1
  CHECK(same_bits(sum_of({1.0, u}), 1.0));  // tie, 1 is even
  CHECK(same_bits(sum_of({1.0, u, std::ldexp(1.0, -200)}),
                  1.0 + 2 * u));  // just above the tie
  CHECK(same_bits(sum_of({1.0 + 2 * u, u}),
                  1.0 + 4 * u));                        // tie, rounds up to even
  CHECK(same_bits(sum_of({1e100, 1.0, -1e100}), 1.0));  // no cancellation error
  CHECK(same_bits(sum_of({0.1, 0.2, 0.3}), fsum({0.1, 0.2, 0.3})));
  CHECK(same_bits(sum_of({}), 0.0));
  CHECK(same_bits(sum_of({-2.5, 2.5}), 0.0));
  CHECK(same_bits(sum_of({-2.5, -0.25}), -2.75));
}

TEST_CASE("exact_sum covers subnormals, the largest doubles and overflow") {
  const double tiny = std::numeric_limits<double>::denorm_min();
  CHECK(same_bits(sum_of({tiny}), tiny));
  CHECK(same_bits(sum_of({tiny, tiny, tiny}), 3 * tiny));
  CHECK(same_bits(sum_of({DBL_MIN, -tiny}),
                  DBL_MIN - tiny));  // a subnormal result
  CHECK(same_bits(sum_of({DBL_MAX}), DBL_MAX));
  CHECK(same_bits(sum_of({DBL_MAX, -DBL_MAX, DBL_MAX}), DBL_MAX));
  CHECK(sum_of({DBL_MAX, DBL_MAX}) == std::numeric_limits<double>::infinity());
  CHECK(sum_of({-DBL_MAX, -DBL_MAX}) == -std::numeric_limits<double>::infinity());
  // The last ulp below 2^1024 rounds up to infinity only past the half-way point.
  const double half_ulp = std::ldexp(1.0, 970);
  CHECK(same_bits(sum_of({DBL_MAX, half_ulp / 2}), DBL_MAX));
  CHECK(sum_of({DBL_MAX, half_ulp}) == std::numeric_limits<double>::infinity());
}

TEST_CASE("exact_sum: NaN and infinities dominate as in IEEE addition") {
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(sum_of({1.0, inf}) == inf);
  CHECK(sum_of({1.0, -inf}) == -inf);
  CHECK(std::isnan(sum_of({inf, -inf})));
  CHECK(std::isnan(sum_of({1.0, std::nan(""), 2.0})));
}

TEST_CASE(
    "exact_sum equals an exact expansion sum on random values, in any "
    "order and grouping") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    CAPTURE(trial);
    const int n = 1 + static_cast<int>(rng() % 3000);
    const int spread = 1 + static_cast<int>(rng() % 600);  // binades the values span
    const bool signed_values = trial % 2 == 1;
    std::uniform_real_distribution<double> mant(1.0, 2.0);
    std::vector<double> xs(n);
    for (double& x : xs) {
      const int e = static_cast<int>(rng() % spread) - spread / 2;
      x = std::ldexp(mant(rng), e);
      if (signed_values && (rng() & 1)) x = -x;
    }
    const double want = fsum(xs);
    CHECK(same_bits(sum_of(xs), want));

    std::vector<double> shuffled = xs;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    CHECK(same_bits(sum_of(shuffled), want));

    // Split into parts summed separately, then merged: what shards and the coordinator do.
    exact_sum merged;
    for (std::size_t at = 0; at < shuffled.size();) {
      const std::size_t len = std::min<std::size_t>(shuffled.size() - at, 1 + rng() % 500);
      exact_sum part;
      for (std::size_t i = at; i < at + len; ++i) part.add(shuffled[i]);
      merged.merge(part);
      at += len;
    }
    CHECK(same_bits(merged.value(), want));
  }
}
