// Shapes and element counts (core/tensor.hpp) for the shapes outside input can carry.
#include <doctest/doctest.h>

#include <cstdint>

#include "core/tensor.hpp"

using troupe::core::numel_of;
using troupe::core::tensor;

TEST_CASE("a shape with a zero dimension has no elements, however large the others are") {
  // Shapes a safetensors file or a tcp frame may announce (fuzz/regressions/): the product of the
  // dimensions before the 0 does not fit in 64 bits. Under UBSan (scripts/fuzz.sh runs test_core
  // so) computing it is an error.
  const std::int64_t big = std::int64_t{1} << 32;
  CHECK(numel_of({big, big, 0}) == 0);
  CHECK(numel_of({59, 217861631974047744, 0}) == 0);
  CHECK(numel_of({0, big, big}) == 0);
  CHECK(numel_of({}) == 1);
  CHECK(numel_of({3, 5}) == 15);
  tensor t = tensor::zeros({big, big, 0});
  CHECK(t.numel() == 0);
  CHECK(t.bytes() == 0);
}
