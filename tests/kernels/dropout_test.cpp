// The dropout op and its generator on the CPU backend: Philox-4x32-10 against the published
// known-answer vectors, the mask's rate and scaling, and the mask as a pure function of (key,
// sample, position) — what lets any split of a batch redraw the same masks.
#include "core/philox.hpp"
#include "kernels/select.hpp"
#include "tests/kernels/cpu_test_util.hpp"

namespace troupe::kernels::cpu_test {
namespace {

std::vector<std::uint32_t> philox(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2,
                                  std::uint32_t c3, std::uint32_t k0, std::uint32_t k1) {
  std::uint32_t c[4] = {c0, c1, c2, c3};
  core::philox4x32(c, static_cast<std::uint64_t>(k1) << 32 | k0);
  return {c[0], c[1], c[2], c[3]};
}

}  // namespace

// The known-answer vectors of Random123 (kat_vectors, philox4x32 with 10 rounds).
TEST_CASE("philox4x32-10 reproduces the Random123 known-answer vectors") {
  CHECK(philox(0, 0, 0, 0, 0, 0) ==
        std::vector<std::uint32_t>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(philox(0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff) ==
        std::vector<std::uint32_t>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(philox(0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0) ==
        std::vector<std::uint32_t>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
}

TEST_CASE("dropout keeps 1 - p of the elements, scaled by 1 / (1 - p), and zeroes the rest") {
  auto be = make_backend("cpu");
  const float p = 0.3f;
  tensor x = randn({400, 500}, 1);
  tensor y = be->empty(x.shape(), dtype::f32);
  const dropout_spec s{p, 0x1234567890abcdefull, 7};
  be->dropout(x, s, 1000, y);
  const float scale = 1.0f / (1.0f - p);
  std::int64_t kept = 0;
  bool exact = true;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const float yi = y.data<float>()[i], xi = x.data<float>()[i];
    if (yi != 0.0f) {
      ++kept;
      exact = exact && yi == xi * scale;
    }
  }
  CHECK(exact);
  const double rate = static_cast<double>(kept) / static_cast<double>(x.numel());
  INFO("kept " << rate);
  CHECK(std::abs(rate - 0.7) < 0.005);  // 200k draws: one standard deviation is 0.001

  // In place gives the same bits.
  tensor z = be->empty(x.shape(), dtype::f32);
  be->copy(x, z);
  be->dropout(z, s, 1000, z);
  CHECK(same_bits(y, z));
}

TEST_CASE("an element's mask depends only on its key, sequence and position") {
  auto be = make_backend("cpu");
  const std::int64_t per = 6 * 5;  // T·C of a [3·6, 5] hidden state
  tensor x = randn({18, 5}, 2);
  tensor whole = be->empty(x.shape(), dtype::f32);
  const std::uint64_t key = 42;
  // Sequences 4, 5, 6 in one call; sequence 5 alone (another micro-batch split) must match.
  be->dropout(x, {0.5f, key, 4}, per, whole);
  tensor mid = x.rows(6, 12);
  tensor alone = be->empty(mid.shape(), dtype::f32);
  be->dropout(mid, {0.5f, key, 5}, per, alone);
  CHECK(same_bits(alone, whole.rows(6, 12)));
  // A sequence index beyond 32 bits and another key draw other masks.
  tensor far = be->empty(mid.shape(), dtype::f32);
  be->dropout(mid, {0.5f, key, 5 + (std::int64_t{1} << 32)}, per, far);
  CHECK_FALSE(same_bits(far, alone));
  tensor other = be->empty(mid.shape(), dtype::f32);
  be->dropout(mid, {0.5f, key + 1, 5}, per, other);
  CHECK_FALSE(same_bits(other, alone));
}

TEST_CASE("dropout rejects a rate outside [0, 1) and partial sequences") {
  auto be = make_backend("cpu");
  tensor x = randn({4, 3}, 3), y = be->empty({4, 3}, dtype::f32);
  CHECK(failure_message([&] { be->dropout(x, {1.0f, 1, 0}, 12, y); }).find("p must be in [0, 1)") !=
        std::string::npos);
  CHECK(failure_message([&] { be->dropout(x, {0.1f, 1, 0}, 5, y); })
            .find("whole samples of sample_elems = 5") != std::string::npos);
}

TEST_CASE("attention with dropout p = 0 is the attention without, and p > 0 changes out only") {
  auto be = make_backend("cpu");
  attention_dims d{2, 5, 2, 1, 4};
  const std::int64_t rows = 10, w = (2 + 2) * 4;
  tensor qkv = randn({rows, w}, 4);
  tensor out0 = be->empty({rows, 8}, dtype::f32), lse0 = be->empty({2, 2, 5}, dtype::f32);
  be->attention_forward(qkv, d, out0, lse0);
  attention_dims off = d;
  off.dropout = {0.0f, 99, 3};
  tensor out1 = be->empty({rows, 8}, dtype::f32), lse1 = be->empty({2, 2, 5}, dtype::f32);
  be->attention_forward(qkv, off, out1, lse1);
  CHECK(same_bits(out0, out1));
  attention_dims on = d;
  on.dropout = {0.4f, 99, 3};
  tensor out2 = be->empty({rows, 8}, dtype::f32), lse2 = be->empty({2, 2, 5}, dtype::f32);
  be->attention_forward(qkv, on, out2, lse2);
  CHECK(same_bits(lse0, lse2));  // the statistics are those of the undropped scores
  CHECK_FALSE(same_bits(out0, out2));
}

}  // namespace troupe::kernels::cpu_test
