// plan::meta_comm against the collectives it stands for: the real actors::tp_group, its device
// path, on meta backends that claim a GPU, over the in-process transport with one thread per rank.
// What each rank keeps afterwards must be the same bytes. Its peak inside the collective depends
// on when the peers take this rank's send buffers (the dry run holds them until the collective
// returns): the two may differ by at most one phase's send buffers.
#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actors/tp_group.hpp"
#include "kernels/meta_backend.hpp"
#include "plan/meta_comm.hpp"
#include "transport/local.hpp"

namespace {

using namespace troupe;
using core::tensor;

// One collective of a group as a function of the group's comm and the rank's backend; returns
// what the caller keeps.
using collective = std::function<tensor(model::layer_comm&, kernels::meta_backend&)>;

struct bytes {
  std::uint64_t peak = 0, live = 0;
};

/// Each rank's peak and what it holds afterwards, through the real tp_group.
std::vector<bytes> real(int n, bool sp, int kv_replicas, const collective& op) {
  auto hub = std::make_shared<transport::local_hub>();
  std::vector<bytes> out(static_cast<std::size_t>(n));
  std::vector<std::unique_ptr<kernels::meta_backend>> be;
  std::vector<tensor> kept(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    be.push_back(std::make_unique<kernels::meta_backend>());
    be.back()->set_device(core::device{core::device_kind::cuda, 0});
  }
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        transport::local_transport t(hub, r);
        actors::tp_group g(t, ranks, *be[r], sp, kv_replicas, std::chrono::seconds(20));
        g.begin(0, 0, 0, model::comm_op::forward);
        kept[r] = op(g, *be[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    INFO("rank ", r, ": ", errors[r]);
    REQUIRE(errors[r].empty());
    out[r].peak = be[r]->peak_bytes();
    out[r].live = be[r]->live_bytes();  // every peer has let go of this rank's send buffers
  }
  return out;
}

/// The same through meta_comm, one rank after another on this thread.
std::vector<bytes> planned(int n, bool sp, int kv_replicas, const collective& op) {
  std::vector<bytes> out(static_cast<std::size_t>(n));
  kernels::meta_backend uncounted;
  for (int r = 0; r < n; ++r) {
    kernels::meta_backend be;
    be.set_device(core::device{core::device_kind::cuda, 0});
    plan::meta_comm c(n, r, sp, kv_replicas, be, uncounted, true);
    const tensor kept = op(c, be);
    out[r].peak = be.peak_bytes();
    out[r].live = be.live_bytes();
  }
  return out;
}

}  // namespace

TEST_CASE("meta_comm allocates on a rank's GPU what tp_group's device collectives allocate") {
  const std::int64_t rows = 64, C = 48;
  struct named {
    const char* name;
    collective op;
    std::int64_t numel;  // elements of its input
  };
  // Each keeps its input alive, as the layers keep theirs.
  const std::vector<named> ops{
      {"reduce_rows",
       [&](model::layer_comm& c, kernels::meta_backend& be) {
         tensor x = be.empty({rows, C}, core::dtype::f32);
         tensor y = c.reduce_rows(x);
         return y;
       },
       rows * C},
      {"gather_rows",
       [&](model::layer_comm& c, kernels::meta_backend& be) {
         tensor x = be.empty({rows, C}, core::dtype::f32);
         return c.gather_rows(x);
       },
       rows * C},
      {"all_reduce",
       [&](model::layer_comm& c, kernels::meta_backend& be) {
         tensor x = be.empty({rows, C}, core::dtype::f32);
         return c.all_reduce(x);
       },
       rows * C},
      {"all_gather",
       [&](model::layer_comm& c, kernels::meta_backend& be) {
         tensor x = be.empty({rows}, core::dtype::f32);
         return c.all_gather(x);
       },
       rows},
      {"all_reduce_kv",
       [&](model::layer_comm& c, kernels::meta_backend& be) {
         tensor x = be.empty({rows, C}, core::dtype::f32);
         return c.all_reduce_kv(x);
       },
       rows * C},
  };
  for (int n : {2, 4})
    for (bool sp : {false, true})
      for (int kv : {1, 2})
        for (const auto& o : ops) {
          INFO(o.name, " over ", n, " ranks, sequence parallel ", sp, ", key/value replicas ", kv);
          const auto want = real(n, sp, kv, o.op);
          const auto got = planned(n, sp, kv, o.op);
          for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            // What the caller keeps (the result; the input went with the lambda's frame).
            CHECK(got[r].live == want[r].live);
            CHECK(got[r].live > 0);
            const auto diff = got[r].peak > want[r].peak ? got[r].peak - want[r].peak
                                                         : want[r].peak - got[r].peak;
            CHECK(diff <= static_cast<std::uint64_t>(4 * o.numel * (n - 1)));
          }
        }
}
