// Recording and replaying work on the CUDA backend (backend::graph_begin): replays redo the
// recorded ops on the same buffers, memory the recording used is not handed to anything else until
// graph_reset, and ops that would wait for the device refuse to be recorded. Skips without a GPU.
#include <doctest/doctest.h>

#include <set>
#include <string>

#include "tests/kernels/cuda_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cuda_test {

TEST_CASE("cuda graph: a replay redoes the recorded ops and the recording's memory stays its own") {
  if (!gpu_or_skip()) return;
  auto be = make_backend("cuda");
  const std::int64_t n = 4096;
  tensor x = be->from_host(random_host({n}, 5));
  tensor acc = be->empty({n}, dtype::f32);
  be->zero(acc);
  std::set<void*> recorded;
  const std::uint64_t id = be->graph_begin();
  REQUIRE(id != 0);
  {
    // A scratch tensor made and dropped inside the recording, then the accumulation.
    tensor tmp = be->empty({n}, dtype::f32);
    recorded.insert(tmp.raw());
    be->copy(x, tmp);
    be->accumulate(tmp, acc);
  }
  be->graph_end();
  CHECK(be->graph_current() == id);
  const tensor before = be->to_host(acc);
  for (std::int64_t i = 0; i < n; ++i) REQUIRE(before.data<float>()[i] == 0.0f);  // not run yet
  // Allocations between replays must not get the recording's block.
  std::vector<tensor> others;
  for (int i = 0; i < 8; ++i) {
    others.push_back(be->empty({n}, dtype::f32));
    CHECK(recorded.count(others.back().raw()) == 0);
    be->zero(others.back());
  }
  for (int r = 0; r < 3; ++r) be->graph_replay(id);
  const tensor got = be->to_host(acc);
  const tensor hx = be->to_host(x);
  for (std::int64_t i = 0; i < n; ++i)
    REQUIRE(got.data<float>()[i] == 3.0f * hx.data<float>()[i]);
  for (const tensor& o : others) {
    const tensor h = be->to_host(o);
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(h.data<float>()[i] == 0.0f);
  }
  be->graph_reset();
  CHECK(be->graph_current() == 0);
  CHECK_THROWS_WITH_AS(be->graph_replay(id), doctest::Contains("is not this backend's"),
                       core::failure);
}

TEST_CASE("cuda graph: host copies and waits refuse to be recorded, and the backend recovers") {
  if (!gpu_or_skip()) return;
  auto be = make_backend("cuda");
  tensor d = be->empty({16}, dtype::f32);
  tensor h = tensor::zeros({16}, dtype::f32);
  REQUIRE(be->graph_begin() != 0);
  CHECK_THROWS_WITH_AS(be->copy(d, h), doctest::Contains("cannot be recorded"), core::failure);
  CHECK_THROWS_AS(be->synchronize(), core::failure);
  CHECK_THROWS_AS(be->has_nonfinite(d), core::failure);
  be->graph_reset();
  // Working as before: a copy round trip.
  tensor src = random_host({16}, 6);
  be->copy(src, d);
  be->copy(d, h);
  CHECK(same_bits(h, src));
}

}  // namespace troupe::kernels::cuda_test
