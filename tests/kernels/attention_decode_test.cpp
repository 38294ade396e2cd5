// The generation ops of the CPU backend against the training ops they stand in for: decode
// attention over a cache filled by kv_cache_write gives causal attention_forward's output, in one
// call or position by position; rope and the embedding at explicit positions give the bits of
// their row % T versions.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "tests/kernels/cpu_test_util.hpp"

using namespace troupe;
using namespace troupe::kernels::cpu_test;
using kernels::attention_dims;

namespace {

tensor ids(const std::vector<std::int32_t>& v) {
  tensor t = tensor::zeros({static_cast<std::int64_t>(v.size())}, dtype::i32);
  std::copy(v.begin(), v.end(), t.data<std::int32_t>());
  return t;
}

double max_rel_diff(const tensor& a, const tensor& b) {
  double worst = 0, scale = 0;
  for (std::int64_t i = 0; i < b.numel(); ++i) scale = std::max(scale, std::fabs(double(b.data<float>()[i])));
  for (std::int64_t i = 0; i < a.numel(); ++i)
    worst = std::max(worst, std::fabs(double(a.data<float>()[i]) - b.data<float>()[i]) / scale);
  return worst;
}

}  // namespace

TEST_CASE("decode attention over the cache equals causal attention, at once or token by token") {
  auto be = kernels::make_backend("cpu");
  const attention_dims d{2, 6, 4, 2, 8};  // B, T, H, Hkv, D
  const std::int64_t n = 12, w = (4 + 2 * 2) * 8, kvw = 2 * 8;
  const tensor qkv = randn({n, w}, 3);
  tensor want = tensor::zeros({n, 32}), lse = tensor::zeros({2, 4, 6});
  be->attention_forward(qkv, d, want, lse);

  std::vector<std::int32_t> slot, pos;
  for (int r = 0; r < n; ++r) slot.push_back(r / 6), pos.push_back(r % 6);
  // Slots reversed against the batch order, with room for more positions than used.
  std::vector<std::int32_t> rslot;
  for (int s : slot) rslot.push_back(1 - s);
  tensor k = tensor::zeros({2, 9, kvw}), v = tensor::zeros({2, 9, kvw});
  be->kv_cache_write(qkv, ids(rslot), ids(pos), d, k, v);
  tensor got = tensor::zeros({n, 32});
  be->attention_decode(qkv, ids(rslot), ids(pos), k, v, d, got);
  CHECK(max_rel_diff(got, want) < 1e-5);

  // Prefill of three positions, then one row per slot at a time: the same bits as all at once.
  tensor k2 = tensor::zeros({2, 9, kvw}), v2 = tensor::zeros({2, 9, kvw});
  tensor step = tensor::zeros({n, 32});
  auto run_rows = [&](const std::vector<std::int64_t>& rows) {
    tensor q = tensor::zeros({static_cast<std::int64_t>(rows.size()), w});
    std::vector<std::int32_t> s, p;
    for (std::size_t j = 0; j < rows.size(); ++j) {
      std::copy(qkv.data<float>() + rows[j] * w, qkv.data<float>() + (rows[j] + 1) * w,
                q.data<float>() + j * w);
      s.push_back(rslot[rows[j]]);
      p.push_back(pos[rows[j]]);
    }
    be->kv_cache_write(q, ids(s), ids(p), d, k2, v2);
    tensor o = tensor::zeros({static_cast<std::int64_t>(rows.size()), 32});
    be->attention_decode(q, ids(s), ids(p), k2, v2, d, o);
    for (std::size_t j = 0; j < rows.size(); ++j)
      std::copy(o.data<float>() + j * 32, o.data<float>() + (j + 1) * 32,
                step.data<float>() + rows[j] * 32);
  };
  run_rows({0, 1, 2, 6, 7, 8});
  for (int t = 3; t < 6; ++t) run_rows({t, 6 + t});
  CHECK(std::memcmp(step.raw(), got.raw(), got.bytes()) == 0);
}

TEST_CASE("rope and the embedding at explicit positions give the bits of their row % T forms") {
  auto be = kernels::make_backend("cpu");
  const int T = 5, heads = 3, D = 8;
  const tensor x = randn({10, heads * D}, 4);
  tensor want = tensor::zeros({10, heads * D}), got = tensor::zeros({10, heads * D});
  be->rope_forward(x, T, heads, 2, D, kernels::rope_spec{10000.0}, want);
  std::vector<std::int32_t> pos;
  for (int r = 0; r < 10; ++r) pos.push_back(r % T);
  be->rope_forward_at(x, ids(pos), heads, 2, D, kernels::rope_spec{10000.0}, got);
  CHECK(std::memcmp(got.raw(), want.raw(), want.bytes()) == 0);

  const tensor wte = randn({11, 6}, 5), wpe = randn({T, 6}, 6);
  const tensor tok = random_tokens(10, 11, 7);
  tensor e_want = tensor::zeros({10, 6}), e_got = tensor::zeros({10, 6});
  be->embedding_forward(tok, wte, wpe, T, e_want);
  be->embedding_forward_at(tok, wte, wpe, ids(pos), e_got);
  CHECK(std::memcmp(e_got.raw(), e_want.raw(), e_want.bytes()) == 0);
  pos[3] = T;  // one past wpe
  CHECK_THROWS_WITH(be->embedding_forward_at(tok, wte, wpe, ids(pos), e_got),
                    doctest::Contains("position 5 at row 3 is outside wpe's 5 rows"));
}

TEST_CASE("the cache ops refuse slots and positions outside the cache, naming the row") {
  auto be = kernels::make_backend("cpu");
  const attention_dims d{0, 0, 2, 1, 4};
  const tensor qkv = randn({2, 16}, 8);
  tensor k = tensor::zeros({1, 3, 4}), v = tensor::zeros({1, 3, 4}), out = tensor::zeros({2, 8});
  CHECK_THROWS_WITH(be->kv_cache_write(qkv, ids({0, 0}), ids({2, 3}), d, k, v),
                    doctest::Contains("row 1 at slot 0, position 3 is outside the cache's 1 slots × 3 positions"));
  CHECK_THROWS_WITH(be->attention_decode(qkv, ids({0, 1}), ids({0, 1}), k, v, d, out),
                    doctest::Contains("row 1 at slot 1, position 1 is outside"));
}
