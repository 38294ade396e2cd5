// ZB-V (schedules/zb_v.cpp) and the V placement it runs on: validity over p and m, the bubble it
// leaves against 1f1b and zb_h1 with F = I = W = 1, its activation peak against 1f1b's, and the
// V in lowering and in the text form.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "schedules/generators.hpp"
#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/schedule_file.hpp"
#include "schedules/simulate.hpp"
#include "schedules/validate.hpp"
#include "tests/schedules/schedule_fixture.hpp"

using namespace troupe::schedules;
using namespace troupe::schedules::testing;

namespace {

cost_model unit_f_i_w() {
  cost_model c;
  c.f = c.i = c.w = 1;
  c.b = c.i + c.w;
  return c;
}

std::vector<int> microbatch_counts(int p) { return {1, p, 2 * p, 3 * p, 2 * p + 1}; }

}  // namespace

TEST_CASE("the v placement folds every second round of chunks back: rank r holds r and 2p-1-r") {
  for (int p : {1, 2, 4, 8}) {
    CAPTURE(p);
    for (int r = 0; r < p; ++r) {
      CHECK(chunk_rank(placement::v, p, r) == r);
      CHECK(chunk_rank(placement::v, p, 2 * p - 1 - r) == r);
      CHECK(chunk_at(placement::v, p, r, 0) == r);
      CHECK(chunk_at(placement::v, p, r, 1) == 2 * p - 1 - r);
      CHECK(chunk_at(placement::interleaved, p, r, 1) == p + r);
    }
    // Three rounds: down, back up, down again.
    for (int c = 0; c < 3 * p; ++c) {
      CAPTURE(c);
      CHECK(chunk_at(placement::v, p, chunk_rank(placement::v, p, c), c / p) == c);
    }
  }
}

TEST_CASE("zb_v is valid, lowered and not, for p 2/4/8 and m in {1, p, 2p, 3p, 2p+1}") {
  for (int p : {2, 4, 8})
    for (int m : microbatch_counts(p)) {
      CAPTURE(p);
      CAPTURE(m);
      const schedule s = made("zb_v", p, m, 2);  // made() fails the case when validation does
      CHECK(s.place == placement::v);
      for (int r = 0; r < p; ++r)
        for (auto& op : s.ranks[r]) CHECK(s.rank_of(op.chunk) == r);
      const schedule low = lower(s);
      CHECK(low.place == placement::v);
      const auto st = validate(low);
      CHECK_MESSAGE(st.ok(), (st.ok() ? "" : st.err().to_string()));
    }
}

TEST_CASE("zb_v runs every chunk's F, I and W in micro-batch order") {
  for (int p : {2, 4, 8})
    for (int m : microbatch_counts(p)) {
      const auto s = made("zb_v", p, m, 2);
      for (auto& list : s.ranks) {
        std::map<std::pair<int, op_kind>, int> next;
        for (auto& op : list) {
          CAPTURE(to_string(op));
          CHECK(op.mb == next[{op.chunk, op.kind}]++);
        }
      }
    }
}

TEST_CASE("zb_v hands chunk p-1 to chunk p on rank p-1 without a transfer, and reduces after each last W") {
  const int p = 4, m = 8;
  const schedule low = lower(made("zb_v", p, m, 2));
  for (int r = 0; r < p; ++r) {
    const auto& list = low.ranks[r];
    for (std::size_t k = 0; k < list.size(); ++k) {
      const auto& op = list[k];
      if (is_transfer(op.kind)) {
        CAPTURE(to_string(op));
        CHECK(op.peer != r);
        const bool crosses_bottom = (op.kind == op_kind::SEND_F && op.chunk == p - 1) ||
                                    (op.kind == op_kind::RECV_F && op.chunk == p) ||
                                    (op.kind == op_kind::SEND_B && op.chunk == p) ||
                                    (op.kind == op_kind::RECV_B && op.chunk == p - 1);
        CHECK_FALSE(crosses_bottom);
      }
      if (op.kind == op_kind::REDUCE_GRAD) {
        // The chunk's last W came before, and no W of it follows.
        auto last_w = std::find(list.begin(), list.end(), instruction{op.chunk, op_kind::W, m - 1});
        CHECK(last_w - list.begin() < static_cast<long>(k));
        CHECK(std::none_of(list.begin() + k, list.end(),
                           [&](const instruction& x) { return x.kind == op_kind::W && x.chunk == op.chunk; }));
      }
    }
    CHECK(std::count_if(list.begin(), list.end(),
                        [](const instruction& x) { return x.kind == op_kind::REDUCE_GRAD; }) == 2);
  }
  // Rank 0 holds the first and the last chunk: 0 and 2p-1.
  CHECK(low.rank_of(0) == 0);
  CHECK(low.rank_of(2 * p - 1) == 0);
}

TEST_CASE("zb_v's bubble with F = I = W = 1 is near zero, below zb_h1's and 1f1b's at the same p and m") {
  // Costs per chunk for zb_v, per stage for the others: a chunk is half a stage, but bubble
  // fractions do not depend on the time unit, so the comparison is fair. No zb_v rank can finish
  // before 6m + p - 1: rank p-1 waits p - 1 for its first input, then has 6m units of work.
  const cost_model c = unit_f_i_w();
  for (int p : {2, 4, 8})
    for (int m : {p, 2 * p, 3 * p, 2 * p + 1, 4 * p}) {
      CAPTURE(p);
      CAPTURE(m);
      const auto zv = simulated(made("zb_v", p, m, 2), c);
      const auto zh = simulated(made("zb_h1", p, m), c);
      const auto ob = simulated(made("1f1b", p, m), c);
      std::printf("bubble p=%d m=%-3d  zb_v %.4f (bound %.4f)  zb_h1 %.4f  1f1b %.4f\n", p, m, zv.bubble,
                  double(p - 1) / (6 * m + p - 1), zh.bubble, ob.bubble);
      const double bound = 6.0 * m + p - 1;
      CHECK(zv.makespan >= bound);
      if (p <= 4) CHECK(zv.makespan == bound);
      CHECK(zv.makespan <= bound + p / 2);
      CHECK(zv.bubble < zh.bubble);
      CHECK(zv.bubble < ob.bubble);
    }
}

TEST_CASE("zb_v finds a valid order within its memory budget for every p <= 16 and m <= 3p") {
  for (int p = 1; p <= 16; ++p)
    for (int m = 1; m <= 3 * p; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      schedule_options o;
      o.virtual_stages = 2;
      auto s = make_zb_v(p, m, o);
      REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
      CHECK(validate(*s).ok());
      for (int peak : peak_activations(*s)) CHECK(peak <= 2 * std::min(p, m));
    }
}

TEST_CASE("zb_v holds at most 2p chunk activations per rank: half a stage each, 1f1b's peak of p") {
  for (int p : {2, 4, 8})
    for (int m : microbatch_counts(p)) {
      CAPTURE(p);
      CAPTURE(m);
      const auto zv = peak_activations(made("zb_v", p, m, 2));
      const auto ob = peak_activations(made("1f1b", p, m));
      const int ob_peak = *std::max_element(ob.begin(), ob.end());
      for (int r = 0; r < p; ++r) {
        CAPTURE(r);
        CHECK(zv[r] <= 2 * ob_peak);
      }
    }
}

TEST_CASE("zb_v refuses v other than 2 and names the key to set") {
  for (int v : {1, 3}) {
    schedule_options o;
    o.virtual_stages = v;
    auto s = make_schedule("zb_v", 4, 8, o);
    REQUIRE_FALSE(s.ok());
    CHECK(s.err().message.find("v = " + std::to_string(v)) != std::string::npos);
    CHECK(s.err().hint.find("parallel.virtual_pipeline = 2") != std::string::npos);
  }
}

TEST_CASE("the text form carries the v placement and reads back; files without it stay interleaved") {
  const schedule s = made("zb_v", 4, 8, 2);
  for (const schedule& form : {s, lower(s)}) {
    const std::string text = format_schedule_text(form);
    CHECK(text.find("\nplacement v\n") != std::string::npos);
    auto back = parse_schedule_text(text, "round-trip", false);
    REQUIRE(back.ok());
    CHECK(back->place == placement::v);
    CHECK(back->ranks == form.ranks);
    CHECK(back->virtual_stages == 2);
    CHECK(validate(*back).ok());
  }
  auto old = parse_schedule_text("rank 0: 0F0 2F0 2B0 0B0\nrank 1: 1F0 3F0 3B0 1B0\n", "old", false);
  REQUIRE(old.ok());
  CHECK(old->place == placement::interleaved);
  CHECK(format_schedule_text(*old).find("placement") == std::string::npos);
  // A V by hand: rank 0 holds 0 and 3, rank 1 holds 1 and 2 (a local hand-off 1 -> 2).
  auto hand = parse_schedule_text("placement v\nrank 0: 0F0 3F0 3B0 0B0\nrank 1: 1F0 2F0 2B0 1B0\n", "v.txt", false);
  REQUIRE(hand.ok());
  CHECK(validate(*hand).ok());
  // The same lines under the interleaved placement put chunk 3 on rank 1.
  auto wrong = parse_schedule_text("rank 0: 0F0 3F0 3B0 0B0\nrank 1: 1F0 2F0 2B0 1B0\n", "i.txt", false);
  REQUIRE(wrong.ok());
  CHECK_FALSE(validate(*wrong).ok());
}

TEST_CASE("a bad or late placement line names file and line") {
  auto bad = parse_schedule_text("placement w\nrank 0: 0F0 0B0\n", "p.txt", false);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.err().to_string().find("p.txt:1") != std::string::npos);
  auto late = parse_schedule_text("rank 0: 0F0 0B0\nplacement v\n", "q.txt", false);
  REQUIRE_FALSE(late.ok());
  CHECK(late.err().to_string().find("q.txt:2") != std::string::npos);
}
