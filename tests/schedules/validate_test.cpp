// validate: each kind of broken schedule is rejected with the reason and the bad cell marked in
// the step x rank grid; good schedules pass.
#include <doctest/doctest.h>

#include "schedules/schedule_file.hpp"
#include "schedules/validate.hpp"

using namespace troupe::schedules;

namespace {

schedule from(const char* text) {
  auto s = parse_schedule_text(text, "test", false);
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
  return *s;
}

// The error text of validating `text`; fails the test when it validates.
std::string rejected(const char* text, const validate_options& options = {}) {
  auto st = validate(from(text), options);
  REQUIRE_FALSE(st.ok());
  return st.err().message + "\n" + st.err().hint;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("a hand-written 1f1b for two ranks validates") {
  CHECK(validate(from("rank 0: 0F0 0F1 0B0 0B1\n"
                      "rank 1: 1F0 1B0 1F1 1B1\n"))
            .ok());
}

TEST_CASE("a missing backward is rejected with the forward's cell marked") {
  const auto e = rejected("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1\n");
  CHECK(has(e, "never backwarded"));
  CHECK(has(e, ">1F1<"));
  CHECK(has(e, "step | rank 0"));
}

TEST_CASE("a micro-batch a chunk never runs marks the end of that rank's list") {
  const auto e = rejected("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0\n");
  CHECK(has(e, "chunk 1 never runs micro-batch 1"));
  CHECK(has(e, ">(end)<"));
}

TEST_CASE("an instruction that appears twice marks both cells") {
  const auto e = rejected("rank 0: 0F0 0F0 0B0\nrank 1: 1F0 1B0\n");
  CHECK(has(e, "appears twice"));
  CHECK(e.find(">0F0<") != e.rfind(">0F0<"));
}

TEST_CASE("a backward before its forward is rejected") {
  const auto e = rejected("rank 0: 0F0 0B0\nrank 1: 1B0 1F0\n");
  CHECK(has(e, "runs before its forward"));
  CHECK(has(e, ">1B0<"));
}

TEST_CASE("a chunk on the wrong rank or beyond p*v is rejected") {
  CHECK(has(rejected("rank 0: 1F0 0F0 0B0\nrank 1: 1B0\n"), "chunk 1 lives on rank 1, not on rank 0"));
  auto s = from("rank 0: 0F0 0B0\nrank 1: 1F0 1B0\n");
  s.ranks[1].push_back({5, op_kind::F, 0});
  auto st = validate(s);
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().message, "chunk 5 does not exist"));
}

TEST_CASE("backwards out of micro-batch order are rejected unless allowed") {
  const char* text = "rank 0: 0F0 0F1 0B1 0B0\nrank 1: 1F0 1F1 1B1 1B0\n";
  const auto e = rejected(text);
  CHECK(has(e, "micro-batch order"));
  CHECK(has(e, ">0B0<"));
  validate_options any;
  any.require_microbatch_order = false;
  CHECK(validate(from(text), any).ok());
}

TEST_CASE("a split backward needs both I and W, I first") {
  CHECK(has(rejected("rank 0: 0F0 0I0 0W0\nrank 1: 1F0 1I0\n"), "has no 1W0"));
  CHECK(has(rejected("rank 0: 0F0 0I0 0W0\nrank 1: 1F0 1W0 1I0\n"), ">1W0<"));
  CHECK(has(rejected("rank 0: 0F0 0B0 0W0\nrank 1: 1F0 1B0\n"), "both whole (B) and split"));
}

TEST_CASE("a compute-only cycle is reported as a deadlock naming both ranks and the cycle") {
  // Rank 0 waits in 0B0 for 1B0; rank 1 waits in 1F1 for 0F1, which comes after 0B0.
  const auto e = rejected("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1\n");
  CHECK(has(e, "deadlock"));
  CHECK(has(e, "rank 0 is stuck at step 1: waits for 1B0 on rank 1"));
  CHECK(has(e, "rank 1 is stuck at step 1: waits for 0F1 on rank 0"));
  CHECK(has(e, "cycle: rank 0 -> rank 1 -> rank 0"));
  CHECK(has(e, ">0B0<"));
  CHECK(has(e, ">1F1<"));
}

TEST_CASE("two ranks that both send first deadlock under blocking transfers") {
  const char* naive =
      "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
      "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1\n";
  const auto e = rejected(naive);
  CHECK(has(e, "deadlock"));
  CHECK(has(e, ">0SEND_F1->1<"));
  CHECK(has(e, ">1SEND_B0->0<"));
  CHECK(has(e, "cycle: rank 0 -> rank 1 -> rank 0"));
  // Receiving before sending on one side breaks the cycle.
  CHECK(validate(from("rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
                      "rank 1: 1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1SEND_B1\n"))
            .ok());
}

TEST_CASE("a send without its receive is rejected at the send") {
  const auto e = rejected("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\nrank 1: 1F0 1B0 1SEND_B0\n");
  CHECK(has(e, "a send without its receive"));
  CHECK(has(e, ">0SEND_F0->1<"));
  CHECK(has(e, "add 1RECV_F0<-0 to rank 1"));
}

TEST_CASE("a receive without its send, and a dependency with no transfer, are rejected") {
  CHECK(has(rejected("rank 0: 0F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n"),
            "a receive without its send"));
  CHECK(has(rejected("rank 0: 0F0 0SEND_F0 0B0\nrank 1: 1RECV_F0 1F0 1B0\n"), "no transfer carries it"));
}

TEST_CASE("a send placed before its producer is rejected") {
  CHECK(has(rejected("rank 0: 0SEND_F0 0F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n"),
            "sends before 0F0 has produced the data"));
}

TEST_CASE("transfers between two ranks that meet out of order are rejected with both cells marked") {
  const auto e = rejected(
      "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
      "rank 1: 1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1\n");
  CHECK(has(e, "meet in order"));
  CHECK(has(e, ">0SEND_F0->1<"));
  CHECK(has(e, ">1RECV_F1<-0<"));
}

TEST_CASE("a transfer's peer must be the rank of the neighbouring chunk") {
  const auto e = rejected("rank 0: 0F0 0SEND_F0->3 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n");
  CHECK(has(e, "the peer is rank 3, but chunk 1 lives on rank 1"));
}

TEST_CASE("transfers between chunks of one rank are rejected") {
  auto s = from("rank 0: 0F0 1F0 1B0 0B0\n");
  REQUIRE(s.virtual_stages == 2);
  CHECK(validate(s).ok());
  s.ranks[0].insert(s.ranks[0].begin() + 1, instruction{0, op_kind::SEND_F, 0, 0});
  auto st = validate(s);
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().message, "both live on rank 0"));
}

TEST_CASE("REDUCE_GRAD before the chunk's last backward is rejected") {
  const auto e = rejected("rank 0: 0F0 0F1 0B0 0REDUCE_GRAD 0B1 STEP\nrank 1: 1F0 1B0 1F1 1B1 1REDUCE_GRAD STEP\n");
  CHECK(has(e, "before 0B1 has added to them"));
  CHECK(has(e, ">0REDUCE_GRAD<"));
}

TEST_CASE("STEP must close every rank's list") {
  CHECK(has(rejected("rank 0: 0F0 STEP 0B0\nrank 1: 1F0 1B0 STEP\n"), "STEP must be the rank's last"));
  CHECK(has(rejected("rank 0: 0F0 0B0 STEP\nrank 1: 1F0 1B0\n"), "rank 1 has no STEP"));
}

TEST_CASE("a long schedule's error grid shows the rows around the mark and elides the rest") {
  std::string text = "rank 0:";
  for (int j = 0; j < 40; ++j) text += " 0F" + std::to_string(j) + " 0B" + std::to_string(j);
  text += " 0F40";
  const auto e = rejected(text.c_str());
  CHECK(has(e, ">0F40<"));
  CHECK(has(e, "..."));
  CHECK_FALSE(has(e, " 0F3 "));
}
