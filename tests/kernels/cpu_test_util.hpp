// Helpers for the CPU backend tests. Each op is checked three ways:
//  - its forward against a plain float64 reference written in the test;
//  - its backward against central differences (float64) of that reference: for an upstream
//    gradient dy, dL/dx of L(x) = Σ dy · f(x), one input element at a time;
//  - its contracts: accumulation into non-zero gradients, identical bits on a repeated call and
//    with 1 or 2 threads, shape errors that name the op and the shapes.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {

using core::dtype;
using core::tensor;
using vec = std::vector<double>;

/// Host fp32 tensor of N(0, scale²) values from the stream keyed by `seed`.
inline tensor randn(const core::shape_t& shape, std::uint64_t seed, float scale = 1.0f) {
  tensor t = tensor::zeros(shape, dtype::f32);
  core::rng_stream r(core::stream_key(seed, 1));
  float* p = t.data<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = scale * r.normal();
  return t;
}

/// Host int32 tensor of values in [0, n).
inline tensor random_tokens(std::int64_t count, std::int64_t n, std::uint64_t seed) {
  tensor t = tensor::zeros({count}, dtype::i32);
  core::rng_stream r(core::stream_key(seed, 2));
  for (std::int64_t i = 0; i < count; ++i)
    t.data<std::int32_t>()[i] = static_cast<std::int32_t>(r.below(static_cast<std::uint64_t>(n)));
  return t;
}

/// The fp32 values of `t` as doubles.
inline vec to_vec(const tensor& t) {
  const float* p = t.data<float>();
  return vec(p, p + t.numel());
}

/// A host fp32 tensor holding `v` rounded to float.
inline tensor from_vec(const vec& v, const core::shape_t& shape) {
  tensor t = tensor::zeros(shape, dtype::f32);
  REQUIRE(static_cast<std::int64_t>(v.size()) == t.numel());
  for (std::size_t i = 0; i < v.size(); ++i) t.data<float>()[i] = static_cast<float>(v[i]);
  return t;
}

/// True when two tensors hold the same bytes.
inline bool same_bits(const tensor& a, const tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

/// Checks |got - want| <= atol + rtol·|want| element-wise (exact equality when both are 0) and
/// reports the worst element.
inline void check_close(const tensor& got, const vec& want, double rtol, double atol,
                        const std::string& what) {
  REQUIRE(got.numel() == static_cast<std::int64_t>(want.size()));
  const float* g = got.data<float>();
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double diff = std::abs(g[i] - want[i]);
    const double excess = diff == 0 ? 0 : diff / (atol + rtol * std::abs(want[i]));
    if (!(excess <= worst)) {
      worst = excess;
      at = i;
    }
  }
  INFO(what << ": worst element " << at << " got " << g[at] << " want " << want[at] << " (rtol "
            << rtol << ", atol " << atol << ")");
  CHECK(worst <= 1.0);
}

/// Central-difference gradient of L(x) = Σ dy · f(x) with respect to every element of x.
inline vec numeric_grad(const std::function<vec(const vec&)>& f, vec x, const vec& dy,
                        double h = 1e-5) {
  vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const vec up = f(x);
    x[i] = keep - h;
    const vec down = f(x);
    x[i] = keep;
    double s = 0;
    for (std::size_t j = 0; j < dy.size(); ++j) s += dy[j] * (up[j] - down[j]);
    g[i] = s / (2 * h);
  }
  return g;
}

/// a + b element-wise (the expected value of a gradient accumulated onto a).
inline vec plus(const vec& a, const vec& b) {
  vec r(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

/// Runs `fn` with set_cpu_threads(n) and restores the default (all cores) after.
template <class Fn>
void with_threads(int n, Fn&& fn) {
  set_cpu_threads(n);
  try {
    fn();
  } catch (...) {
    set_cpu_threads(0);
    throw;
  }
  set_cpu_threads(0);
}

/// Checks that `run` (an op's calls, returning their outputs) gives the same bits with 1 thread as
/// with 2.
template <class Fn>
void check_same_bits_any_threads(Fn&& run) {
  std::vector<tensor> one, two;
  with_threads(1, [&] { one = run(); });
  with_threads(2, [&] { two = run(); });
  REQUIRE(one.size() == two.size());
  for (std::size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    CHECK(same_bits(one[i], two[i]));
  }
}

/// The message of the core::failure that `fn` throws ("" when it throws none).
template <class Fn>
std::string failure_message(Fn&& fn) {
  try {
    fn();
  } catch (const core::failure& e) {
    return e.what();
  }
  return "";
}

}  // namespace troupe::kernels::cpu_test
