// Lowering, one pass at a time: insert_transfers, insert_reduction, and both together.
#include <doctest/doctest.h>

#include <algorithm>

#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/schedule_file.hpp"
#include "schedules/simulate.hpp"
#include "schedules/validate.hpp"
#include "tests/schedules/schedule_fixture.hpp"

using namespace troupe::schedules;
using namespace troupe::schedules::testing;

namespace {

std::vector<instruction> only(const std::vector<instruction>& list, bool (*keep)(op_kind)) {
  std::vector<instruction> out;
  std::copy_if(list.begin(), list.end(), std::back_inserter(out), [&](const instruction& op) { return keep(op.kind); });
  return out;
}

int index_of(const std::vector<instruction>& list, const instruction& op) {
  auto it = std::find(list.begin(), list.end(), op);
  return it == list.end() ? -1 : static_cast<int>(it - list.begin());
}

const char* const builtins[] = {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"};

}  // namespace

TEST_CASE("insert_transfers lowers 1f1b on two ranks to receive-before-send where the ranks would cross") {
  const schedule low = insert_transfers(made("1f1b", 2, 2));
  const auto expected = parse_schedule_text(
      "rank 0: 0F0 0SEND_F0->1 0F1 0SEND_F1->1 0RECV_B0<-1 0B0 0RECV_B1<-1 0B1\n"
      "rank 1: 1RECV_F0<-0 1F0 1B0 1RECV_F1<-0 1SEND_B0->0 1F1 1B1 1SEND_B1->0\n",
      "expected", false);
  REQUIRE(expected.ok());
  CHECK(low.ranks == expected->ranks);
}

TEST_CASE("insert_transfers keeps each rank's compute order and adds one send and one receive per crossing") {
  for (auto name : builtins) {
    const int v = std::string(name) == "interleaved_1f1b" ? 2 : 1;
    const schedule s = made(name, 4, 8, v);
    const schedule low = insert_transfers(s);
    CAPTURE(name);
    for (int r = 0; r < 4; ++r) CHECK(only(low.ranks[r], is_compute) == s.ranks[r]);
    // Every chunk boundary crosses ranks when p > 1: one SEND_F and one SEND_B per micro-batch.
    const std::size_t crossings = static_cast<std::size_t>(s.chunks() - 1) * s.microbatches * 2;
    std::size_t sends = 0, recvs = 0;
    for (auto& list : low.ranks)
      for (auto& op : list) {
        sends += is_send(op.kind);
        recvs += is_transfer(op.kind) && !is_send(op.kind);
      }
    CHECK(sends == crossings);
    CHECK(recvs == crossings);
    CHECK(validate(low).ok());
  }
}

TEST_CASE("insert_transfers adds nothing when every chunk lives on one rank") {
  const schedule s = made("interleaved_1f1b", 1, 4, 3);
  CHECK(insert_transfers(s).ranks == s.ranks);
}

TEST_CASE("zb_h1 sends the input gradient right after I, before W has run") {
  const schedule low = insert_transfers(made("zb_h1", 4, 8));
  for (int r = 1; r < 4; ++r)
    for (int j = 0; j < 8; ++j) {
      const auto& list = low.ranks[r];
      const int i = index_of(list, {r, op_kind::I, j});
      const int send = index_of(list, {r, op_kind::SEND_B, j, r - 1});
      const int w = index_of(list, {r, op_kind::W, j});
      REQUIRE(i >= 0);
      REQUIRE(send > i);
      for (int k = i + 1; k < send; ++k) CHECK(is_transfer(list[k].kind));
      CHECK(w > send);
    }
}

TEST_CASE("lowered built-ins run as fast as compute-only ones when transfers cost nothing") {
  cost_model f_equals_b;
  f_equals_b.b = 1;
  for (auto name : builtins)
    for (int p : {2, 3, 4, 8})
      for (int m : {p, 2 * p, 3 * p}) {
        const bool interleaved = std::string(name) == "interleaved_1f1b";
        // Interleaving with F != B leaves moments where no transfer finds both ranks idle.
        const cost_model costs = interleaved ? f_equals_b : cost_model{};
        const schedule s = made(name, p, m, interleaved ? 2 : 1);
        const auto plain = simulate(s, costs);
        const auto low = simulate(lower(s, costs), costs);
        REQUIRE(plain.ok());
        REQUIRE(low.ok());
        CAPTURE(name);
        CAPTURE(p);
        CAPTURE(m);
        CHECK(low->makespan == doctest::Approx(plain->makespan));
      }
}

TEST_CASE("insert_reduction adds REDUCE_GRAD once per chunk after its last backward, and STEP last") {
  const schedule low = insert_reduction(insert_transfers(made("interleaved_1f1b", 2, 4, 2)));
  for (int r = 0; r < 2; ++r) {
    const auto& list = low.ranks[r];
    CHECK(list.back().kind == op_kind::STEP);
    for (int c = r; c < 4; c += 2) {
      const int reduce = index_of(list, {c, op_kind::REDUCE_GRAD, -1});
      const int last_b = index_of(list, {c, op_kind::B, 3});
      REQUIRE(reduce > last_b);
      CHECK(std::count(list.begin(), list.end(), instruction{c, op_kind::REDUCE_GRAD, -1}) == 1);
      // Only transfers sit between the last backward and the reduction, the input gradient's send
      // among them (chunk 0 has nobody to send to).
      for (int k = last_b + 1; k < reduce; ++k) CHECK(is_transfer(list[k].kind));
      if (c > 0) CHECK(index_of(list, {c, op_kind::SEND_B, 3, (c - 1) % 2}) < reduce);
    }
  }
  CHECK(validate(low).ok());
}

TEST_CASE("insert_reduction puts REDUCE_GRAD after the last W of a split backward") {
  const schedule low = insert_reduction(made("zb_h1", 2, 4));
  for (int r = 0; r < 2; ++r)
    CHECK(index_of(low.ranks[r], {r, op_kind::REDUCE_GRAD, -1}) == index_of(low.ranks[r], {r, op_kind::W, 3}) + 1);
}

TEST_CASE("insert_reduction adds nothing to a schedule that already has it") {
  const schedule once = insert_reduction(made("1f1b", 2, 4));
  CHECK(insert_reduction(once).ranks == once.ranks);
}

TEST_CASE("lower keeps the transfers of a schedule written with them") {
  auto written = parse_schedule_text(
      "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
      "rank 1: 1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1SEND_B1\n",
      "written", false);
  REQUIRE(written.ok());
  const schedule low = lower(*written);
  for (int r = 0; r < 2; ++r) {
    std::vector<instruction> body(low.ranks[r].begin(), low.ranks[r].end() - 2);
    CHECK(body == written->ranks[r]);
  }
  CHECK(validate(low).ok());
}

TEST_CASE("insert_transfers refuses a schedule that cannot run") {
  auto cyclic = parse_schedule_text("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1\n", "cyclic", false);
  REQUIRE(cyclic.ok());
  CHECK_THROWS_AS(insert_transfers(*cyclic), troupe::core::failure);
}
