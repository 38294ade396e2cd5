// Helpers for the CUDA backend tests: every GPU op is checked against the CPU reference on fresh
// random inputs. Inputs of a bf16 test are rounded to bf16 first, so both backends see the same
// values (the CPU computes in fp32 on them). Outputs are poisoned with NaN before each GPU call, so
// an element the kernel forgets to write fails the comparison.
//
// Tolerance: |got − want| <= rtol·(|want| + rms(want)). The rms term is the absolute floor: a
// float sum's rounding error scales with the size of its terms, which is the typical size of the
// outputs, not the size of one output that happens to cancel to near zero. rtol is 1e-5 for fp32
// and 1e-2 for bf16 (docs/design.md, rule 3).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cuda_test {

using core::dtype;
using core::tensor;

inline constexpr double fp32_rtol = 1e-5;
inline constexpr double bf16_rtol = 1e-2;

inline double rtol_for(dtype t) { return t == dtype::f32 ? fp32_rtol : bf16_rtol; }

/// True when a GPU is usable; otherwise records why the test is skipped.
inline bool gpu_or_skip() {
  if (cuda_available()) return true;
  MESSAGE("skipped: no CUDA device in this build or on this machine");
  return false;
}

/// Host fp32 tensor of N(0, scale²) values from stream `seed`.
inline tensor random_host(const core::shape_t& shape, std::uint64_t seed, float scale = 1.0f) {
  tensor t = tensor::zeros(shape, dtype::f32);
  core::rng_stream r(core::stream_key(seed, 7));
  float* p = t.data<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = scale * r.normal();
  return t;
}

/// Host int32 tensor of values in [0, n).
inline tensor random_tokens(std::int64_t count, std::int64_t n, std::uint64_t seed) {
  tensor t = tensor::zeros({count}, dtype::i32);
  core::rng_stream r(core::stream_key(seed, 11));
  for (std::int64_t i = 0; i < count; ++i) t.data<std::int32_t>()[i] = static_cast<std::int32_t>(r.below(n));
  return t;
}

/// The host fp32 values rounded through dtype t (identity for fp32).
inline tensor rounded(const tensor& host, dtype t) {
  tensor out = host.clone();
  if (t == dtype::f32) return out;
  float* p = out.data<float>();
  for (std::int64_t i = 0; i < out.numel(); ++i)
    p[i] = t == dtype::bf16 ? core::bf16_to_f32(core::f32_to_bf16(p[i]))
                            : core::f16_to_f32(core::f32_to_f16(p[i]));
  return out;
}

/// Host tensor of dtype t holding the fp32 values of `host` (rounded).
inline tensor host_as(const tensor& host, dtype t) {
  if (t == dtype::f32) return host.clone();
  tensor out = tensor::zeros(host.shape(), t);
  const float* p = host.data<float>();
  auto* q = out.data<std::uint16_t>();
  for (std::int64_t i = 0; i < host.numel(); ++i)
    q[i] = t == dtype::bf16 ? core::f32_to_bf16(p[i]) : core::f32_to_f16(p[i]);
  return out;
}

/// Host fp32 copy of a host tensor of any float dtype.
inline tensor host_f32(const tensor& host) {
  if (host.type() == dtype::f32) return host.clone();
  tensor out = tensor::zeros(host.shape(), dtype::f32);
  const auto* q = host.data<std::uint16_t>();
  for (std::int64_t i = 0; i < host.numel(); ++i)
    out.data<float>()[i] =
        host.type() == dtype::bf16 ? core::bf16_to_f32(q[i]) : core::f16_to_f32(q[i]);
  return out;
}

/// start[c] + Σ_r rows[r, c] (host fp32 [N, C] and [C]) summed in double, as fp32: a reference
/// for column sums that the GPU adds in another order (an fp32 sum in row order of thousands of
/// terms is itself off by about the tolerance).
inline tensor column_sums_f64(const tensor& rows, const tensor& start) {
  const std::int64_t cols = start.numel(), n = cols ? rows.numel() / cols : 0;
  tensor out = tensor::zeros({cols});
  for (std::int64_t c = 0; c < cols; ++c) {
    double s = start.data<float>()[c];
    for (std::int64_t r = 0; r < n; ++r) s += rows.data<float>()[r * cols + c];
    out.data<float>()[c] = static_cast<float>(s);
  }
  return out;
}

/// Device tensor of dtype t with the values of host fp32 tensor `host`.
inline tensor upload(backend& gpu, const tensor& host, dtype t) {
  return gpu.from_host(host_as(host, t));
}

/// Host fp32 copy of a device tensor.
inline tensor download(backend& gpu, const tensor& dev) { return host_f32(gpu.to_host(dev)); }

/// Device tensor of shape/dtype filled with NaN.
inline tensor poisoned(backend& gpu, const core::shape_t& shape, dtype t) {
  tensor h = tensor::zeros(shape, dtype::f32);
  std::fill(h.data<float>(), h.data<float>() + h.numel(), std::numeric_limits<float>::quiet_NaN());
  return upload(gpu, h, t);
}

/// Checks got ≈ want elementwise (see the file comment); reports the worst element.
inline void check_close(const tensor& got, const tensor& want, double rtol, const std::string& what) {
  REQUIRE(got.numel() == want.numel());
  const float* g = got.data<float>();
  const float* w = want.data<float>();
  double ss = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) ss += static_cast<double>(w[i]) * w[i];
  const double rms = want.numel() ? std::sqrt(ss / want.numel()) : 0.0;
  std::int64_t bad = 0, worst = -1;
  double worst_ratio = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    const double err = std::fabs(static_cast<double>(g[i]) - w[i]);
    const double tol = rtol * (std::fabs(w[i]) + rms);
    const double ratio = std::isnan(err) ? std::numeric_limits<double>::infinity() : err / tol;
    if (!(err <= tol)) ++bad;
    if (ratio > worst_ratio || worst < 0) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  INFO(what << ": " << bad << " of " << want.numel() << " elements out of tolerance; worst at "
            << worst << ": got " << (worst >= 0 ? g[worst] : 0.0f) << ", want "
            << (worst >= 0 ? w[worst] : 0.0f) << " (error / tolerance = " << worst_ratio
            << ", rtol " << rtol << ", rms " << rms << ")");
  CHECK(bad == 0);
}

/// Bitwise equality of two host tensors.
inline bool same_bits(const tensor& a, const tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

/// Runs `op(out)` twice on the GPU, each time into a fresh output from `make()`, checks both
/// results have the same bits and returns the first as host fp32.
template <class Make, class Op>
tensor twice_same_bits(backend& gpu, Make&& make, Op&& op, const std::string& what) {
  tensor a = make();
  op(a);
  tensor b = make();
  op(b);
  tensor ha = gpu.to_host(a), hb = gpu.to_host(b);
  INFO(what);
  CHECK(same_bits(ha, hb));
  return host_f32(ha);
}

/// twice_same_bits into fresh copies of `init_host` (the initial value of an accumulated output).
template <class Op>
tensor run_twice(backend& gpu, const tensor& init_host, dtype t, Op&& op, const std::string& what) {
  return twice_same_bits(gpu, [&] { return upload(gpu, init_host, t); }, op, what);
}

/// twice_same_bits into fresh NaN-filled outputs (ops that write their whole output).
template <class Op>
tensor written_twice(backend& gpu, const core::shape_t& shape, dtype t, Op&& op,
                     const std::string& what) {
  return twice_same_bits(gpu, [&] { return poisoned(gpu, shape, t); }, op, what);
}

}  // namespace troupe::kernels::cuda_test
