// The built-in generators against the formulas they are known by: bubble fraction and peak
// in-flight activations, for p in {2, 4, 8} and m in {p, 2p, 4p}.
#include <doctest/doctest.h>

#include <map>

#include "schedules/generators.hpp"
#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"
#include "schedules/validate.hpp"
#include "tests/schedules/schedule_fixture.hpp"

using namespace troupe::schedules;
using namespace troupe::schedules::testing;

namespace {

cost_model f_equals_b() {
  cost_model c;
  c.f = 1;
  c.b = 1;
  return c;
}

cost_model unit_f_i_w() {
  cost_model c;
  c.f = c.i = c.w = 1;
  c.b = c.i + c.w;
  return c;
}

const int stage_counts[] = {2, 4, 8};

}  // namespace

TEST_CASE("1f1b bubble fraction is (p-1)/(m+p-1) on every rank when F = B") {
  for (int p : stage_counts)
    for (int m : {p, 2 * p, 4 * p}) {
      CAPTURE(p);
      CAPTURE(m);
      const auto sim = simulated(made("1f1b", p, m), f_equals_b());
      const double expected = double(p - 1) / (m + p - 1);
      CHECK(sim.bubble == doctest::Approx(expected));
      for (auto& rank : sim.ranks) CHECK(rank.bubble == doctest::Approx(expected));
      CHECK(sim.makespan == doctest::Approx(2.0 * (m + p - 1)));
    }
}

TEST_CASE("gpipe bubble fraction is (p-1)/(m+p-1), the same as 1f1b") {
  for (int p : stage_counts)
    for (int m : {p, 2 * p, 4 * p}) {
      CAPTURE(p);
      CAPTURE(m);
      const auto sim = simulated(made("gpipe", p, m), f_equals_b());
      CHECK(sim.bubble == doctest::Approx(double(p - 1) / (m + p - 1)));
      for (auto& rank : sim.ranks) CHECK(rank.bubble == doctest::Approx(double(p - 1) / (m + p - 1)));
    }
}

TEST_CASE("interleaved 1f1b bubble fraction is (p-1)/(v*m+p-1) when F = B per chunk") {
  for (int v : {2, 3})
    for (int p : stage_counts)
      for (int m : {p, 2 * p, 4 * p}) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(v);
        const auto sim = simulated(made("interleaved_1f1b", p, m, v), f_equals_b());
        const double expected = double(p - 1) / (v * m + p - 1);
        CHECK(sim.bubble == doctest::Approx(expected));
        for (auto& rank : sim.ranks) CHECK(rank.bubble == doctest::Approx(expected));
      }
}

TEST_CASE("zb_h1 idles (p-1)(F+I-W) per rank, a third of 1f1b's (p-1)(F+I+W), with F = I = W = 1") {
  const cost_model c = unit_f_i_w();
  for (int p : stage_counts)
    for (int m : {p, 2 * p, 4 * p}) {
      CAPTURE(p);
      CAPTURE(m);
      const auto zb = simulated(made("zb_h1", p, m), c);
      const auto ofob = simulated(made("1f1b", p, m), c);
      for (int r = 0; r < p; ++r) {
        CAPTURE(r);
        CHECK(zb.ranks[r].idle == doctest::Approx((p - 1) * (c.f + c.i - c.w)));
        CHECK(ofob.ranks[r].idle == doctest::Approx((p - 1) * (c.f + c.i + c.w)));
        CHECK(3 * zb.ranks[r].idle == doctest::Approx(ofob.ranks[r].idle));
      }
      CHECK(zb.makespan == doctest::Approx(m * (c.f + c.i + c.w) + (p - 1)));
    }
}

TEST_CASE("gpipe keeps all m micro-batches in flight on every rank") {
  for (int p : stage_counts)
    for (int m : {1, p, 3 * p}) {
      const auto peak = peak_activations(made("gpipe", p, m));
      for (int r = 0; r < p; ++r) CHECK(peak[r] == m);
    }
}

TEST_CASE("1f1b keeps at most min(p - rank, m) micro-batches in flight") {
  for (int p : stage_counts)
    for (int m : {1, p / 2, p, 4 * p}) {
      if (m < 1) continue;
      const auto peak = peak_activations(made("1f1b", p, m));
      for (int r = 0; r < p; ++r) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(r);
        CHECK(peak[r] == std::min(p - r, m));
      }
    }
}

TEST_CASE("zb_h1 never holds more activations than 1f1b's first rank, min(p, m)") {
  for (int p : stage_counts)
    for (int m : {1, p, 4 * p}) {
      const auto peak = peak_activations(made("zb_h1", p, m));
      CHECK(peak[0] == std::min(p, m));
      for (int r = 0; r < p; ++r) CHECK(peak[r] <= std::min(p, m));
    }
}

TEST_CASE("the simulator reports peak activations per rank as peak_activations does") {
  const auto s = made("1f1b", 4, 8);
  const auto sim = simulated(s, cost_model{});
  const auto peak = peak_activations(s);
  for (int r = 0; r < 4; ++r) CHECK(sim.ranks[r].peak_activations == peak[r]);
}

TEST_CASE("every built-in runs each chunk's backwards in micro-batch order") {
  for (auto name : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"}) {
    const bool two = std::string(name) == "interleaved_1f1b" || std::string(name) == "zb_v";
    const auto s = made(name, 4, 8, two ? 2 : 1);
    for (auto& list : s.ranks) {
      std::map<std::pair<int, op_kind>, int> next;
      for (auto& op : list)
        if (op.kind == op_kind::B || op.kind == op_kind::I || op.kind == op_kind::W) {
          CAPTURE(to_string(op));
          CHECK(op.mb == next[{op.chunk, op.kind}]++);
        }
    }
  }
}

TEST_CASE("interleaved 1f1b rejects m that is not a multiple of p, saying which m would do") {
  schedule_options o;
  o.virtual_stages = 2;
  auto s = make_interleaved_1f1b(4, 6, o);
  REQUIRE_FALSE(s.ok());
  CHECK(s.err().message.find("multiple of pipeline_stage p") != std::string::npos);
  CHECK(s.err().hint.find("m = 4 or 8") != std::string::npos);
}

TEST_CASE("one-chunk generators reject v > 1 and point at interleaved_1f1b") {
  schedule_options o;
  o.virtual_stages = 2;
  for (auto gen : {make_gpipe, make_1f1b, make_zb_h1}) {
    auto s = gen(4, 8, o);
    REQUIRE_FALSE(s.ok());
    CHECK(s.err().hint.find("interleaved_1f1b") != std::string::npos);
  }
}

TEST_CASE("generators reject p < 1 and m < 1") {
  CHECK_FALSE(make_1f1b(0, 4, {}).ok());
  CHECK_FALSE(make_gpipe(2, 0, {}).ok());
  CHECK_FALSE(make_zb_h1(-1, 3, {}).ok());
}

TEST_CASE("interleaved places chunk c on rank c % p") {
  const auto s = made("interleaved_1f1b", 4, 8, 2);
  for (int r = 0; r < 4; ++r)
    for (auto& op : s.ranks[r]) CHECK(op.chunk % 4 == r);
  CHECK(s.chunks() == 8);
}
