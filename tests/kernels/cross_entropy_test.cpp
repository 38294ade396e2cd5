// cross_entropy (softmax cross-entropy fused with its backward) on the CPU backend.
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

// Per-row loss log Σ exp(x) - x_target in float64 (0 for a negative target).
vec ce_ref(const vec& x, const std::vector<int>& tgt, int vocab) {
  vec loss(tgt.size());
  for (std::size_t r = 0; r < tgt.size(); ++r) {
    if (tgt[r] < 0) continue;
    double m = -1e300, s = 0;
    for (int i = 0; i < vocab; ++i) m = std::max(m, x[r * vocab + i]);
    for (int i = 0; i < vocab; ++i) s += std::exp(x[r * vocab + i] - m);
    loss[r] = std::log(s) + m - x[r * vocab + tgt[r]];
  }
  return loss;
}

tensor targets_of(const std::vector<int>& t) {
  tensor out = tensor::zeros({static_cast<std::int64_t>(t.size())}, dtype::i32);
  std::copy(t.begin(), t.end(), out.data<std::int32_t>());
  return out;
}

}  // namespace

TEST_CASE(
    "cross_entropy losses match float64, gradients match central differences times grad_scale") {
  auto be = make_backend("cpu");
  const int vocab = 13;
  const std::vector<int> tgt = {3, 0, 12, 7, 5};
  const int n = static_cast<int>(tgt.size());
  tensor logits = randn({n, vocab}, 1, 3.0f), losses = be->empty({n}, dtype::f32);
  const vec xv = to_vec(logits);
  const float grad_scale = 0.2f;
  be->cross_entropy(logits, targets_of(tgt), losses, grad_scale);
  check_close(losses, ce_ref(xv, tgt, vocab), 1e-6, 1e-6, "losses");
  vec want = numeric_grad([&](const vec& v) { return ce_ref(v, tgt, vocab); }, xv, vec(n, 1.0));
  for (auto& g : want) g *= grad_scale;
  check_close(logits, want, 1e-5, 1e-7, "dlogits");
}

TEST_CASE("cross_entropy ignores negative targets: zero loss and a zero gradient row") {
  auto be = make_backend("cpu");
  const int vocab = 9;
  const std::vector<int> tgt = {2, -1, 4, -100};
  tensor logits = randn({4, vocab}, 2), losses = be->empty({4}, dtype::f32);
  const vec xv = to_vec(logits);
  be->cross_entropy(logits, targets_of(tgt), losses, 1.0f);
  CHECK(losses.data<float>()[1] == 0.0f);
  CHECK(losses.data<float>()[3] == 0.0f);
  CHECK(losses.data<float>()[0] > 0.0f);
  for (int i = 0; i < vocab; ++i) {
    CHECK(logits.data<float>()[1 * vocab + i] == 0.0f);
    CHECK(logits.data<float>()[3 * vocab + i] == 0.0f);
  }
  check_close(losses, ce_ref(xv, tgt, vocab), 1e-6, 1e-6, "losses");
}

TEST_CASE("cross_entropy with grad_scale 0 leaves the logits untouched") {
  auto be = make_backend("cpu");
  tensor logits = randn({3, 50}, 3), losses = be->empty({3}, dtype::f32);
  const tensor before = logits.clone();
  be->cross_entropy(logits, targets_of({1, 49, -1}), losses, 0.0f);
  CHECK(same_bits(logits, before));
  check_close(losses, ce_ref(to_vec(before), {1, 49, -1}, 50), 1e-6, 1e-6, "losses");
}

TEST_CASE("cross_entropy is stable for huge logits and exact at the GPT-2 vocabulary size") {
  auto be = make_backend("cpu");
  const int vocab = 50257;
  tensor logits = randn({2, vocab}, 4, 2.0f);
  for (int i = 0; i < vocab; ++i) logits.data<float>()[i] += 1000.0f;  // row 0 shifted far up
  const vec xv = to_vec(logits);
  tensor losses = be->empty({2}, dtype::f32);
  be->cross_entropy(logits, targets_of({17, 50256}), losses, 1.0f);
  check_close(losses, ce_ref(xv, {17, 50256}, vocab), 2e-6, 0, "losses");
  // Each gradient row sums to zero (softmax sums to one, minus the one-hot).
  for (int r = 0; r < 2; ++r) {
    double s = 0;
    for (int i = 0; i < vocab; ++i) s += logits.data<float>()[r * vocab + i];
    CHECK(std::abs(s) < 1e-5);
  }
}

TEST_CASE("cross_entropy gives the same bits with 1 or 2 threads") {
  auto be = make_backend("cpu");
  tensor logits = randn({64, 5000}, 5), tgt = random_tokens(64, 5000, 6);
  auto run = [&] {
    tensor x = logits.clone(), losses = be->empty({64}, dtype::f32);
    be->cross_entropy(x, tgt, losses, 1.0f / 64);
    return std::vector<tensor>{x, losses};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("cross_entropy propagates NaN logits into the loss") {
  auto be = make_backend("cpu");
  tensor logits = randn({1, 20}, 7), losses = be->empty({1}, dtype::f32);
  logits.data<float>()[11] = std::nanf("");
  be->cross_entropy(logits, targets_of({3}), losses, 1.0f);
  CHECK(std::isnan(losses.data<float>()[0]));
}

TEST_CASE("cross_entropy rejects targets past the vocabulary and mismatched shapes") {
  auto be = make_backend("cpu");
  tensor logits = randn({2, 10}, 8), losses = be->empty({2}, dtype::f32);
  CHECK(failure_message([&] {
          be->cross_entropy(logits, targets_of({1, 10}), losses, 1.0f);
        }).find("target 10 at row 1 is outside the vocabulary [0, 10)") != std::string::npos);
  tensor three = be->empty({3}, dtype::f32);
  const std::string msg = failure_message([&] {
    be->cross_entropy(logits, targets_of({1, 2}), three, 1.0f);
  });
  CHECK(msg.find("cross_entropy: losses must have 2 elements") != std::string::npos);
  CHECK(msg.find("logits fp32 [2, 10]") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
