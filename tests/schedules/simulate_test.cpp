// The simulator's accounting: makespan, compute / transfer / other / idle time per rank, bubble
// fractions, and the two semantics (dataflow for compute-only lists, blocking transfers for
// lowered ones).
#include <doctest/doctest.h>

#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/schedule_file.hpp"
#include "schedules/simulate.hpp"
#include "tests/schedules/schedule_fixture.hpp"

using namespace troupe::schedules;
using namespace troupe::schedules::testing;

TEST_CASE("gpipe and 1f1b take (m + p - 1)(F + B) for any F and B when transfers are free") {
  cost_model c;
  c.f = 1.5;
  c.b = 3.25;
  for (auto name : {"gpipe", "1f1b"})
    for (int p : {1, 3, 5})
      for (int m : {1, 4, 9}) {
        CAPTURE(name);
        CAPTURE(p);
        CAPTURE(m);
        const auto sim = simulated(made(name, p, m), c);
        CHECK(sim.makespan == doctest::Approx((m + p - 1) * (c.f + c.b)));
        for (auto& r : sim.ranks) CHECK(r.compute == doctest::Approx(m * (c.f + c.b)));
      }
}

TEST_CASE("in a compute-only list a transfer delays the consumer by its latency and occupies no rank") {
  cost_model c;
  c.comm = 0.5;
  const auto sim = simulated(made("1f1b", 2, 1), c);
  // 0F0 [0,1), 1F0 [1.5,2.5), 1B0 [2.5,4.5), 0B0 [5,7).
  CHECK(sim.makespan == doctest::Approx(7));
  CHECK(sim.timeline[1][0].start == doctest::Approx(1.5));
  CHECK(sim.timeline[0][1].start == doctest::Approx(5));
  for (auto& r : sim.ranks) CHECK(r.transfer == 0);
  CHECK(sim.ranks[0].idle == doctest::Approx(4));
}

TEST_CASE("in a lowered list a transfer holds both ranks for its latency") {
  cost_model c;
  c.comm = 0.5;
  const schedule low = insert_transfers(made("1f1b", 2, 1));
  const auto sim = simulated(low, c);
  CHECK(sim.makespan == doctest::Approx(7));
  for (auto& r : sim.ranks) {
    CHECK(r.transfer == doctest::Approx(1.0));
    CHECK(r.compute == doctest::Approx(3.0));
    CHECK(r.idle == doctest::Approx(3.0));
  }
}

TEST_CASE("REDUCE_GRAD and STEP costs count as other time") {
  cost_model c;
  c.reduce = 0.25;
  c.step = 0.5;
  const auto sim = simulated(lower(made("gpipe", 2, 2)), c);
  for (auto& r : sim.ranks) CHECK(r.other == doctest::Approx(0.75));
}

TEST_CASE("bubble fractions: per rank (makespan - compute) / makespan, overall 1 - compute / (p * makespan)") {
  const auto sim = simulated(made("1f1b", 3, 3), cost_model{});
  double compute = 0;
  for (auto& r : sim.ranks) {
    CHECK(r.bubble == doctest::Approx((sim.makespan - r.compute) / sim.makespan));
    compute += r.compute;
  }
  CHECK(sim.bubble == doctest::Approx(1 - compute / (3 * sim.makespan)));
}

TEST_CASE("one rank has no bubble") {
  const auto sim = simulated(made("zb_h1", 1, 5), cost_model{});
  CHECK(sim.bubble == doctest::Approx(0));
  CHECK(sim.ranks[0].idle == doctest::Approx(0));
}

TEST_CASE("the timeline keeps every rank's list order and never overlaps instructions") {
  const schedule s = made("zb_h1", 4, 8);
  const auto sim = simulated(s, cost_model{});
  for (int r = 0; r < 4; ++r) {
    REQUIRE(sim.timeline[r].size() == s.ranks[r].size());
    for (std::size_t k = 0; k < s.ranks[r].size(); ++k) {
      CHECK(sim.timeline[r][k].op == s.ranks[r][k]);
      if (k > 0) CHECK(sim.timeline[r][k].start >= sim.timeline[r][k - 1].end);
    }
  }
}

TEST_CASE("a list naming a chunk that does not exist is an error, not a crash") {
  schedule s = made("1f1b", 2, 2);
  s.ranks[0].push_back({6, op_kind::F, 0});
  auto sim = simulate(s);
  REQUIRE_FALSE(sim.ok());
  CHECK(sim.err().message.find("chunk 6 does not exist") != std::string::npos);
}

TEST_CASE("a missing forward upstream reads as a deadlock naming what never comes") {
  auto s = parse_schedule_text("rank 0: 0F0 0B0\nrank 1: 1F0 1F1 1B0 1B1\n", "missing", false);
  REQUIRE(s.ok());
  auto sim = simulate(*s);
  REQUIRE_FALSE(sim.ok());
  CHECK(sim.err().message.find("waits for 0F1, which no rank runs") != std::string::npos);
  CHECK(sim.err().message.find(">1F1<") != std::string::npos);
}

TEST_CASE("measured costs per chunk: each chunk's instructions take its own F and B") {
  // 1f1b, p = 2, m = 2: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1. Chunk 0 costs F 1, B 2;
  // chunk 1 F 3, B 6. Rank 1: F0 [1, 4], B0 [4, 10], F1 [10, 13], B1 [13, 19]; rank 0: F0 [0, 1],
  // F1 [1, 2], B0 [10, 12], B1 [19, 21].
  cost_model c;
  c.chunks = {{1, 2, 1, 1}, {3, 6, 3, 3}};
  const auto sim = simulated(made("1f1b", 2, 2), c);
  CHECK(sim.makespan == doctest::Approx(21));
  CHECK(sim.ranks[0].compute == doctest::Approx(6));
  CHECK(sim.ranks[1].compute == doctest::Approx(18));
  CHECK(sim.bubble == doctest::Approx(1 - 24.0 / 42));
  // Equal chunk costs are the uniform model's.
  cost_model same;
  same.chunks = {{same.f, same.b, same.i, same.w}, {same.f, same.b, same.i, same.w}};
  for (auto name : {"1f1b", "zb_h1"}) {
    CAPTURE(name);
    CHECK(simulated(made(name, 2, 4), same).makespan ==
          doctest::Approx(simulated(made(name, 2, 4), cost_model{}).makespan));
  }
  // A split backward takes the chunk's I and W.
  cost_model split;
  split.chunks = {{1, 5, 2, 3}, {1, 5, 2, 3}, {1, 5, 2, 3}};
  const auto zb = simulated(made("zb_h1", 3, 6), split);
  for (auto& r : zb.ranks) CHECK(r.compute == doctest::Approx(6 * (1 + 2 + 3)));
}

TEST_CASE("measured costs for another number of chunks are refused, naming both") {
  cost_model c;
  c.chunks = {{1, 2, 1, 1}, {1, 2, 1, 1}, {1, 2, 1, 1}};
  auto sim = simulate(made("1f1b", 2, 2), c);
  REQUIRE_FALSE(sim.ok());
  CHECK(sim.err().message.find("the costs name 3 chunks, schedule '1f1b' has 2") !=
        std::string::npos);
}
