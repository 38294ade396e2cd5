// sumsq_blocks and has_nonfinite on the CPU backend.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {

TEST_CASE(
    "sumsq_blocks sums squares per block of norm_block elements in fp64, last block partial") {
  auto be = make_backend("cpu");
  const std::int64_t n = 3 * norm_block + 100;
  tensor x = randn({n}, 1), out = be->empty({4}, dtype::f64);
  be->sumsq_blocks(x, out);
  const vec xv = to_vec(x);
  for (int b = 0; b < 4; ++b) {
    double want = 0;
    for (std::int64_t i = b * norm_block; i < std::min(n, (b + 1) * norm_block); ++i)
      want += xv[i] * xv[i];
    CAPTURE(b);
    CHECK(std::abs(out.data<double>()[b] - want) <= 1e-13 * want);
  }
}

TEST_CASE("sumsq_blocks of a buffer equals the sums of its block-aligned parts, bit for bit") {
  auto be = make_backend("cpu");
  const std::int64_t n = 200 * norm_block + 17;
  tensor x = randn({n}, 2), whole = be->empty({201}, dtype::f64);
  with_threads(2, [&] { be->sumsq_blocks(x, whole); });
  tensor first = be->empty({70}, dtype::f64), rest = be->empty({131}, dtype::f64);
  with_threads(1, [&] {
    be->sumsq_blocks(x.slice(0, {70 * norm_block}), first);
    be->sumsq_blocks(x.slice(70 * norm_block, {n - 70 * norm_block}), rest);
  });
  CHECK(std::memcmp(whole.data<double>(), first.data<double>(), 70 * sizeof(double)) == 0);
  CHECK(std::memcmp(whole.data<double>() + 70, rest.data<double>(), 131 * sizeof(double)) == 0);
}

TEST_CASE("sumsq_blocks checks the output size") {
  auto be = make_backend("cpu");
  tensor x = randn({norm_block + 1}, 3), out = be->empty({1}, dtype::f64);
  CHECK(failure_message([&] {
          be->sumsq_blocks(x, out);
        }).find("sumsq_blocks: out must have 2 elements") != std::string::npos);
}

TEST_CASE("sumsq_blocks_list puts each tensor's blocks after the last, bit for bit, and checks out") {
  auto be = make_backend("cpu");
  tensor x = randn({3 * norm_block + 5}, 5);
  // A partial block, an empty tensor, a view at an odd offset, a whole buffer.
  const std::vector<tensor> xs = {x.slice(0, {700}), x.slice(700, {0}),
                                  x.slice(701, {2 * norm_block + 3}), x};
  tensor out = be->empty({1 + 0 + 3 + 4}, dtype::f64);
  be->sumsq_blocks_list(xs, out);
  std::int64_t at = 0;
  for (const tensor& t : xs) {
    const std::int64_t nb = (t.numel() + norm_block - 1) / norm_block;
    if (nb == 0) continue;
    tensor one = be->empty({nb}, dtype::f64);
    be->sumsq_blocks(t, one);
    CAPTURE(at);
    CHECK(std::memcmp(out.data<double>() + at, one.data<double>(), nb * sizeof(double)) == 0);
    at += nb;
  }
  CHECK(at == 8);
  tensor wrong = be->empty({7}, dtype::f64);
  CHECK(failure_message([&] { be->sumsq_blocks_list(xs, wrong); })
            .find("sumsq_blocks_list: out must be f64 with 8 elements") != std::string::npos);
}

TEST_CASE(
    "has_nonfinite finds NaN and infinities in fp32, bf16 and fp16, and nothing in finite data") {
  auto be = make_backend("cpu");
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16}) {
    CAPTURE(core::dtype_name(t));
    tensor x32 = randn({300000}, 4, 100.0f);
    x32.data<float>()[0] = 65000.0f;  // large but finite in every type
    tensor x = be->empty({300000}, t);
    be->convert(x32, x);
    CHECK_FALSE(be->has_nonfinite(x));
    for (float b : bad) {
      tensor y = x32.clone();
      y.data<float>()[299999] = b;
      be->convert(y, x);
      CHECK(be->has_nonfinite(x));
    }
  }
}

}  // namespace troupe::kernels::cpu_test
