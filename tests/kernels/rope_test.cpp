// rope_forward / rope_backward on the CPU backend.
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

// Rotate-half RoPE in float64: heads [0, rot) of each row turn by t = row % seq.
vec rope_ref(const vec& x, int rows, int seq, int heads, int rot, int d, double theta) {
  vec y = x;
  const int half = d / 2;
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < rot; ++h)
      for (int i = 0; i < half; ++i) {
        const double a = (r % seq) * std::pow(theta, -2.0 * i / d);
        const std::size_t lo = static_cast<std::size_t>(r) * heads * d + h * d + i, hi = lo + half;
        y[lo] = x[lo] * std::cos(a) - x[hi] * std::sin(a);
        y[hi] = x[hi] * std::cos(a) + x[lo] * std::sin(a);
      }
  return y;
}

// Llama 3.1's scaled frequencies as Hugging Face's _compute_llama3_parameters states them: the
// unscaled frequency vector, divided by `factor` where the wavelength is long, then the band
// between the two wavelength limits replaced by the smooth blend.
std::vector<double> llama3_freqs(int d, double theta, double factor, double lo, double hi,
                                 double orig) {
  std::vector<double> out;
  const double pi = std::acos(-1.0);
  for (int j = 0; j < d; j += 2) {
    const double base = 1.0 / std::pow(theta, static_cast<double>(j) / d);
    const double wavelen = 2 * pi / base;
    double f = wavelen > orig / lo ? base / factor : base;
    const double smooth = (orig / wavelen - lo) / (hi - lo);
    const bool medium = !(wavelen < orig / hi) && !(wavelen > orig / lo);
    if (medium) f = (1 - smooth) * f / factor + smooth * f;
    out.push_back(f);
  }
  return out;
}

}  // namespace

TEST_CASE("rope with llama3 scaling turns pair i by t times Llama 3.1's scaled frequency") {
  auto be = make_backend("cpu");
  // theta 500000 and D = 64 put pairs in all three bands for original_max_positions = 64.
  const int seq = 96, d = 64;
  const double theta = 500000, factor = 8, lo = 1, hi = 4, orig = 64;
  const std::vector<double> f = llama3_freqs(d, theta, factor, lo, hi, orig);
  int stretched = 0, kept = 0, blended = 0;
  for (int i = 0; i < d / 2; ++i) {
    const double base = std::pow(theta, -2.0 * i / d);
    if (f[i] == base) ++kept;
    else if (f[i] == base / factor) ++stretched;
    else ++blended;
  }
  REQUIRE(stretched > 0);
  REQUIRE(kept > 0);
  REQUIRE(blended > 0);
  tensor x = randn({seq, d}, 8), y = be->empty({seq, d}, dtype::f32);
  rope_spec r{theta, factor, lo, hi, orig};
  be->rope_forward(x, seq, 1, 1, d, r, y);
  const vec xs = to_vec(x);
  vec want = xs;
  for (int t = 0; t < seq; ++t)
    for (int i = 0; i < d / 2; ++i) {
      const double a = t * f[i];
      const std::size_t p = static_cast<std::size_t>(t) * d + i, q = p + d / 2;
      want[p] = xs[p] * std::cos(a) - xs[q] * std::sin(a);
      want[q] = xs[q] * std::cos(a) + xs[p] * std::sin(a);
    }
  check_close(y, want, 1e-5, 1e-6, "y");
  // Scaling changes the result, and the unscaled table is not reused for it.
  tensor plain = be->empty({seq, d}, dtype::f32);
  be->rope_forward(x, seq, 1, 1, d, rope_spec{theta}, plain);
  CHECK_FALSE(same_bits(plain, y));
  tensor again = be->empty({seq, d}, dtype::f32);
  be->rope_forward(x, seq, 1, 1, d, r, again);
  CHECK(same_bits(again, y));
  // The backward is the inverse rotation.
  tensor back = be->empty({seq, d}, dtype::f32);
  be->rope_backward(y, seq, 1, 1, d, r, back);
  check_close(back, xs, 1e-5, 1e-6, "R^T R x");
}

TEST_CASE("rope forward rotates the first rot_heads heads by position row % seq, copies the rest") {
  auto be = make_backend("cpu");
  const int batch = 2, seq = 9, heads = 5, rot = 3, d = 8;
  const float theta = 10000.0f;
  tensor x = randn({batch * seq, heads * d}, 1);
  tensor y = be->empty({batch * seq, heads * d}, dtype::f32);
  be->rope_forward(x, seq, heads, rot, d, rope_spec{theta}, y);
  const vec want = rope_ref(to_vec(x), batch * seq, seq, heads, rot, d, theta);
  check_close(y, want, 1e-6, 1e-6, "y");
  // Position 0 (rows 0 and seq) is the identity; the unrotated heads are exact copies.
  for (int r : {0, seq})
    for (int j = 0; j < heads * d; ++j)
      CHECK(y.data<float>()[r * heads * d + j] == x.data<float>()[r * heads * d + j]);
  for (int r = 0; r < batch * seq; ++r)
    for (int j = rot * d; j < heads * d; ++j)
      CHECK(y.data<float>()[r * heads * d + j] == x.data<float>()[r * heads * d + j]);
  // In place gives the same bits.
  tensor inplace = x.clone();
  be->rope_forward(inplace, seq, heads, rot, d, rope_spec{theta}, inplace);
  CHECK(same_bits(inplace, y));
}

TEST_CASE("rope uses theta^(-2i/D) per pair at long positions") {
  auto be = make_backend("cpu");
  const int seq = 2048, d = 64;
  tensor x = randn({seq, d}, 2), y = be->empty({seq, d}, dtype::f32);
  be->rope_forward(x, seq, 1, 1, d, rope_spec{500000.0f}, y);
  check_close(y, rope_ref(to_vec(x), seq, seq, 1, 1, d, 500000.0), 1e-5, 1e-5, "y");
}

TEST_CASE("rope backward matches central differences, overwrites dx, and runs in place") {
  auto be = make_backend("cpu");
  const int seq = 3, heads = 3, rot = 2, d = 4, rows = 6;
  tensor x = randn({rows, heads * d}, 3), dy = randn({rows, heads * d}, 4),
         dx = randn({rows, heads * d}, 5);  // its values are overwritten
  be->rope_backward(dy, seq, heads, rot, d, rope_spec{100.0f}, dx);
  auto f = [&](const vec& v) { return rope_ref(v, rows, seq, heads, rot, d, 100.0); };
  check_close(dx, numeric_grad(f, to_vec(x), to_vec(dy)), 1e-5, 1e-6, "dx");
  tensor inplace = dy.clone();
  be->rope_backward(inplace, seq, heads, rot, d, rope_spec{100.0f}, inplace);
  CHECK(same_bits(inplace, dx));
}

TEST_CASE("rope backward of rope forward returns the input (the rotation is orthogonal)") {
  auto be = make_backend("cpu");
  tensor x = randn({32, 64}, 6), y = be->empty({32, 64}, dtype::f32),
         back = be->empty({32, 64}, dtype::f32);
  be->rope_forward(x, 16, 2, 2, 32, rope_spec{10000.0f}, y);
  be->rope_backward(y, 16, 2, 2, 32, rope_spec{10000.0f}, back);
  check_close(back, to_vec(x), 1e-5, 1e-6, "Rᵀ R x");
}

TEST_CASE("rope gives the same bits with 1 or 2 threads") {
  auto be = make_backend("cpu");
  tensor x = randn({1024, 256}, 7);
  auto run = [&] {
    tensor y = be->empty({1024, 256}, dtype::f32), dx = be->empty({1024, 256}, dtype::f32);
    be->rope_forward(x, 64, 8, 6, 32, rope_spec{10000.0f}, y);
    be->rope_backward(x, 64, 8, 6, 32, rope_spec{10000.0f}, dx);
    return std::vector<tensor>{y, dx};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("rope rejects odd head_dim, too many rotated heads and wrong widths") {
  auto be = make_backend("cpu");
  tensor x = randn({4, 12}, 1), y = be->empty({4, 12}, dtype::f32);
  CHECK(failure_message([&] {
          be->rope_forward(x, 4, 4, 4, 3, rope_spec{1e4f}, y);
        }).find("head_dim must be even") != std::string::npos);
  CHECK(failure_message([&] {
          be->rope_forward(x, 4, 3, 4, 4, rope_spec{1e4f}, y);
        }).find("rot_heads <= heads_total") != std::string::npos);
  const std::string msg = failure_message([&] { be->rope_forward(x, 4, 2, 2, 4, rope_spec{1e4f}, y); });
  CHECK(msg.find("rope_forward: x must be [N, heads_total * head_dim] = [N, 8]") !=
        std::string::npos);
  CHECK(msg.find("x fp32 [4, 12]") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
