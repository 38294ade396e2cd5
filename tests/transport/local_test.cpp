#include <doctest/doctest.h>

#include <cstring>
#include <thread>

#include "core/error.hpp"
#include "transport/local.hpp"

using namespace troupe;
using transport::tag;

namespace {

core::tensor filled(std::int64_t n, float base) {
  auto t = core::tensor::zeros({n});
  for (std::int64_t i = 0; i < n; ++i) t.data<float>()[i] = base + 0.1f * static_cast<float>(i);
  return t;
}

// Runs fn(rank, transport) on one thread per rank, as the ranks of a job would.
template <class Fn>
void on_ranks(int n, Fn fn) {
  auto hub = std::make_shared<transport::local_hub>();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      transport::local_transport t(hub, r);
      fn(r, t);
    });
  for (auto& th : threads) th.join();
  CHECK(hub->in_flight() == 0);
}

}  // namespace

TEST_CASE("local transport moves the handle without copying and stashes early arrivals") {
  auto hub = std::make_shared<transport::local_hub>();
  transport::local_transport a(hub, 0), b(hub, 1);
  auto x = filled(8, 1.0f);
  void* bytes = x.raw();
  tag t1{3, 1, 0, 5, 0}, t2{3, 1, 0, 6, 0};
  a.send(1, x, t2);
  a.send(1, x, t1);
  CHECK(b.ready(0, t1));
  CHECK(b.recv(0, t1, std::chrono::milliseconds(10)).raw() == bytes);
  CHECK(b.recv(0, t2, std::chrono::milliseconds(10)).raw() == bytes);
  CHECK_FALSE(b.ready(0, t1));
}

TEST_CASE("recv of a tensor that never comes fails naming both ranks and the tag") {
  auto hub = std::make_shared<transport::local_hub>();
  transport::local_transport b(hub, 1);
  try {
    b.recv(0, tag{7, 2, 1, 3, 0}, std::chrono::milliseconds(20));
    FAIL("recv returned");
  } catch (const core::failure& e) {
    std::string m = e.what();
    CHECK(m.find("rank 1") != std::string::npos);
    CHECK(m.find("from rank 0") != std::string::npos);
    CHECK(m.find("step 7") != std::string::npos);
  }
}

TEST_CASE("all_reduce sums in group order and gives every rank the same bits") {
  const int n = 4;
  std::vector<core::tensor> results(n);
  on_ranks(n, [&](int r, transport::transport& t) {
    results[r] = transport::all_reduce(t, {0, 1, 2, 3}, filled(16, 1e7f * (r % 2 ? -1 : 1) + r),
                                       tag{0, 9, 0, 0, 0}, std::chrono::seconds(5));
  });
  std::vector<core::tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(filled(16, 1e7f * (r % 2 ? -1 : 1) + r));
  auto expect = transport::ordered_sum(parts);
  for (int r = 0; r < n; ++r)
    CHECK(std::memcmp(results[r].raw(), expect.raw(), expect.bytes()) == 0);
}

TEST_CASE("reduce_scatter then all_gather equals all_reduce; broadcast copies the root") {
  const int n = 2;
  std::vector<core::tensor> gathered(n), bcast(n);
  on_ranks(n, [&](int r, transport::transport& t) {
    auto mine = transport::reduce_scatter(t, {0, 1}, filled(8, float(r)), tag{1, 1, 0, 0, 0},
                                          std::chrono::seconds(5));
    CHECK(mine.numel() == 4);
    gathered[r] = transport::all_gather(t, {0, 1}, mine, tag{1, 2, 0, 0, 0}, std::chrono::seconds(5));
    bcast[r] = transport::broadcast(t, {0, 1}, 1, filled(3, 40.0f + r), tag{1, 3, 0, 0, 0},
                                    std::chrono::seconds(5));
  });
  auto expect = transport::ordered_sum({filled(8, 0), filled(8, 1)});
  for (int r = 0; r < n; ++r) {
    CHECK(std::memcmp(gathered[r].raw(), expect.raw(), expect.bytes()) == 0);
    CHECK(bcast[r].data<float>()[0] == 41.0f);
  }
}
