// The clip decided on the device: the exact sum of the norm blocks (exact_sum_add), the norm and
// clip factor read from it (clip_factor), and AdamW reading that factor (adamw_params::grad_factor)
// — each on the GPU against the CPU backend, bit for bit. Skips without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/exact_sum.hpp"
#include "tests/kernels/cuda_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cuda_test {
namespace {

struct backends {
  std::unique_ptr<backend> cpu = make_backend("cpu");
  std::unique_ptr<backend> gpu = make_backend("cuda");
};

/// n doubles over ~700 binades, subnormals and signs included when `signed_values`.
tensor wide_doubles(std::int64_t n, std::uint64_t seed, bool signed_values) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  tensor t = tensor::zeros({n}, dtype::f64);
  double* p = t.data<double>();
  for (std::int64_t i = 0; i < n; ++i) {
    const int e = static_cast<int>(rng() % 1400) - 1090;  // down into the subnormals
    p[i] = std::ldexp(mant(rng), e);
    if (signed_values && (rng() & 1)) p[i] = -p[i];
  }
  return t;
}

tensor gpu_sum(backend& gpu, const tensor& host_values, int pieces) {
  tensor values = gpu.from_host(host_values);
  tensor acc = gpu.empty({core::exact_sum_words}, dtype::i64);
  gpu.zero(acc);
  const std::int64_t n = values.numel();
  for (int k = 0; k < pieces; ++k) {
    const std::int64_t b = n * k / pieces, e = n * (k + 1) / pieces;
    gpu.exact_sum_add(values.slice(b, {e - b}), acc);
  }
  return gpu.to_host(acc);
}

tensor cpu_sum(backend& cpu, const tensor& host_values) {
  tensor acc = tensor::zeros({core::exact_sum_words}, dtype::i64);
  cpu.exact_sum_add(host_values, acc);
  return acc;
}

}  // namespace

TEST_CASE(
    "cuda exact_sum_add gives the CPU's accumulator bit for bit, in one "
    "call or several") {
  if (!gpu_or_skip()) return;
  backends be;
  for (bool signed_values : {false, true}) {
    CAPTURE(signed_values);
    // More values than one launch's threads hold, so blocks meet in the output's atomics.
    const tensor x = wide_doubles(700001, signed_values ? 91 : 90, signed_values);
    const tensor want = cpu_sum(*be.cpu, x);
    for (int pieces : {1, 3}) {
      CAPTURE(pieces);
      const tensor got = gpu_sum(*be.gpu, x, pieces);
      CHECK(same_bits(got, want));
      CHECK(core::exact_sum_value(got.data<std::int64_t>()) ==
            core::exact_sum_value(want.data<std::int64_t>()));
    }
  }
  // NaN and infinities are counted, not added.
  tensor special = tensor::zeros({5}, dtype::f64);
  const double vals[5] = {1.0, std::numeric_limits<double>::infinity(), -0.0,
                          -std::numeric_limits<double>::infinity(), std::nan("")};
  std::memcpy(special.data<double>(), vals, sizeof vals);
  const tensor got = gpu_sum(*be.gpu, special, 1);
  CHECK(same_bits(got, cpu_sum(*be.cpu, special)));
  CHECK(got.data<std::int64_t>()[core::exact_sum_nan] == 1);
  CHECK(got.data<std::int64_t>()[core::exact_sum_pinf] == 1);
  CHECK(got.data<std::int64_t>()[core::exact_sum_ninf] == 1);
}

TEST_CASE(
    "cuda clip_factor gives the CPU's norm and factor bit for bit, NaN "
    "when not finite") {
  if (!gpu_or_skip()) return;
  backends be;
  const tensor blocks = wide_doubles(5000, 92, false);
  std::vector<tensor> sums = {cpu_sum(*be.cpu, blocks)};
  tensor small = tensor::zeros({3}, dtype::f64);  // norm 0.5: below a clip of 1
  small.data<double>()[0] = 0.125;
  small.data<double>()[1] = 0.0625;
  small.data<double>()[2] = 0.0625;
  sums.push_back(cpu_sum(*be.cpu, small));
  tensor bad = small.clone();
  bad.data<double>()[1] = std::numeric_limits<double>::infinity();
  sums.push_back(cpu_sum(*be.cpu, bad));
  for (const tensor& s : sums)
    for (double clip : {0.0, 1.0, 1e300}) {
      CAPTURE(clip);
      tensor want = tensor::zeros({2}, dtype::f64);
      be.cpu->clip_factor(s, tensor{}, clip, want);
      tensor out = be.gpu->empty({2}, dtype::f64);
      be.gpu->clip_factor(be.gpu->from_host(s), tensor{}, clip, out);
      const tensor got = be.gpu->to_host(out);
      CHECK(same_bits(got, want));
      const double norm = std::sqrt(core::exact_sum_value(s.data<std::int64_t>()));
      CHECK(std::memcmp(&norm, got.data<double>(), sizeof norm) == 0);
      if (std::isfinite(norm)) {
        const float want_factor =
            clip > 0 && norm > clip ? static_cast<float>(clip / (norm + 1e-6)) : 1.0f;
        CHECK(got.data<double>()[1] == static_cast<double>(want_factor));
      } else
        CHECK(std::isnan(got.data<double>()[1]));
    }
}

TEST_CASE(
    "cuda adamw and adamw_runs take a device grad_factor as grad_scale, "
    "and skip on NaN") {
  if (!gpu_or_skip()) return;
  backends be;
  const std::int64_t n = 4 * 1024 + 13;
  const tensor p = random_host({n}, 80), g = random_host({n}, 81), m = random_host({n}, 82, 0.1f);
  tensor v = random_host({n}, 83, 0.1f);
  for (std::int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
  adamw_params ap;
  ap.lr = 1e-3f;
  ap.weight_decay = 0.1f;
  ap.step = 5;
  const float scale = 0.3701f;
  const std::vector<adamw_run> runs = {{0, 1000, true}, {1024, n, false}};
  for (bool use_runs : {false, true}) {
    CAPTURE(use_runs);
    auto run = [&](const adamw_params& q) {
      std::vector<tensor> t = {be.gpu->from_host(p), be.gpu->from_host(m), be.gpu->from_host(v),
                               poisoned(*be.gpu, {n}, dtype::bf16)};
      const tensor gg = be.gpu->from_host(g);
      if (use_runs)
        be.gpu->adamw_runs(t[0], gg, t[1], t[2], runs, q, t[3]);
      else
        be.gpu->adamw(t[0], gg, t[1], t[2], q, t[3]);
      return std::vector<tensor>{be.gpu->to_host(t[0]), be.gpu->to_host(t[1]),
                                 be.gpu->to_host(t[2]), be.gpu->to_host(t[3])};
    };
    adamw_params plain = ap;
    plain.grad_scale = scale;
    const auto want = run(plain);
    adamw_params dev = ap;
    dev.grad_scale = 7.0f;  // replaced by the factor
    tensor f = tensor::zeros({1}, dtype::f64);
    f.data<double>()[0] = static_cast<double>(scale);
    dev.grad_factor = be.gpu->from_host(f);
    const auto got = run(dev);
    for (int i = 0; i < 4; ++i) CHECK(same_bits(got[i], want[i]));

    f.data<double>()[0] = std::nan("");
    dev.grad_factor = be.gpu->from_host(f);
    const auto skipped = run(dev);
    CHECK(same_bits(skipped[0], p));
    CHECK(same_bits(skipped[1], m));
    CHECK(same_bits(skipped[2], v));
  }
}

}  // namespace troupe::kernels::cuda_test
