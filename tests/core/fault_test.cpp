// TROUPE_FAULT's text (core/fault.hpp): each fault's form parses into its fields, and anything else
// is refused naming the variable, the text and the forms.
#include "core/fault.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>

using namespace troupe::core;

TEST_CASE("TROUPE_FAULT forms parse into kind, rank, step and factor") {
  auto drop = parse_fault("drop:1:3", "TROUPE_FAULT");
  REQUIRE(drop.ok());
  CHECK(drop->kind == fault_kind::drop);
  CHECK(drop->rank == 1);
  CHECK(drop->step == 3);
  CHECK(drop->label() == "TROUPE_FAULT=drop:1:3");
  auto full = parse_fault("enospc:4", "TROUPE_FAULT");
  REQUIRE(full.ok());
  CHECK(full->kind == fault_kind::enospc);
  CHECK(full->rank == -1);
  CHECK(full->step == 4);
  auto nan = parse_fault("nan:3:0", "TROUPE_FAULT");
  REQUIRE(nan.ok());
  CHECK(nan->kind == fault_kind::nan);
  CHECK(nan->rank == 3);
  CHECK(nan->step == 0);
  auto slow = parse_fault("slow:2:5", "TROUPE_FAULT");
  REQUIRE(slow.ok());
  CHECK(slow->kind == fault_kind::slow);
  CHECK(slow->rank == 2);
  CHECK(slow->factor == 5.0);
  CHECK(parse_fault("slow:0:2.5", "X")->factor == 2.5);
  auto stall = parse_fault("stall:1:2", "TROUPE_FAULT");
  REQUIRE(stall.ok());
  CHECK(stall->kind == fault_kind::stall);
  CHECK(stall->rank == 1);
  CHECK(stall->step == 2);
  auto poison = parse_fault("poison:2:5", "TROUPE_FAULT");
  REQUIRE(poison.ok());
  CHECK(poison->kind == fault_kind::poison);
  CHECK(poison->rank == -1);
  CHECK(poison->step == 2);
  CHECK(poison->sequence == 5);
  CHECK(std::isnan(poison->loss));
  CHECK(parse_fault("poison:2:5:1e4", "X")->loss == 1e4);
  CHECK(poison->attempt == 0);
}

TEST_CASE("TROUPE_FAULT=kill:RANK:STEP[:ATTEMPT] parses, in attempt 0 unless it names another") {
  auto first = parse_fault("kill:2:3", "TROUPE_FAULT");
  REQUIRE(first.ok());
  CHECK(first->kind == fault_kind::kill);
  CHECK(first->rank == 2);
  CHECK(first->step == 3);
  CHECK(first->attempt == 0);
  CHECK(first->label() == "TROUPE_FAULT=kill:2:3");
  auto later = parse_fault("kill:1:7:2", "TROUPE_FAULT");
  REQUIRE(later.ok());
  CHECK(later->rank == 1);
  CHECK(later->step == 7);
  CHECK(later->attempt == 2);
  for (const char* bad : {"kill", "kill:1", "kill:1:", "kill::3", "kill:a:3", "kill:1:-3",
                          "kill:1:3:", "kill:1:3:x", "kill:1:3:-1", "kill:1:3:1:1", "kill:-1:3"}) {
    CAPTURE(bad);
    auto r = parse_fault(bad, "TROUPE_FAULT");
    REQUIRE_FALSE(r.ok());
    CHECK(r.err().message == "TROUPE_FAULT='" + std::string(bad) +
                                 "' is not kill:RANK:STEP[:ATTEMPT] (ATTEMPT 0 for the first "
                                 "attempt, N for the one after the N-th restart)");
    CHECK(r.err().hint.find("kill:RANK:STEP[:ATTEMPT]") != std::string::npos);
  }
}

TEST_CASE("TROUPE_FAULT lists faults separated by ',', at most one per attempt") {
  auto two = parse_faults("kill:2:3,kill:1:7:1", "TROUPE_FAULT");
  REQUIRE(two.ok());
  REQUIRE(two->size() == 2);
  CHECK((*two)[0].text == "kill:2:3");
  CHECK((*two)[1].text == "kill:1:7:1");
  CHECK(fault_for_attempt(*two, 0)->rank == 2);
  CHECK(fault_for_attempt(*two, 1)->rank == 1);
  CHECK_FALSE(fault_for_attempt(*two, 2).has_value());
  auto mixed = parse_faults("nan:3:3,kill:0:5:2", "TROUPE_FAULT");
  REQUIRE(mixed.ok());
  CHECK(fault_for_attempt(*mixed, 0)->kind == fault_kind::nan);
  CHECK_FALSE(fault_for_attempt(*mixed, 1).has_value());
  CHECK(fault_for_attempt(*mixed, 2)->kind == fault_kind::kill);
  CHECK(parse_faults("", "TROUPE_FAULT")->empty());

  // Two faults for one attempt: refused naming both.
  auto same = parse_faults("kill:2:3,drop:1:4", "TROUPE_FAULT");
  REQUIRE_FALSE(same.ok());
  CHECK(same.err().message ==
        "TROUPE_FAULT='kill:2:3,drop:1:4' names two faults for attempt 0 (kill:2:3 and drop:1:4)");
  CHECK(same.err().hint.find("at most one fault per attempt") != std::string::npos);
  CHECK_FALSE(parse_faults("kill:2:3:1,kill:0:4:1", "TROUPE_FAULT").ok());
  // A bad item is refused naming that item; an empty one too.
  auto item = parse_faults("kill:2:3,kill:1:x:1", "TROUPE_FAULT");
  REQUIRE_FALSE(item.ok());
  CHECK(item.err().message.find("TROUPE_FAULT='kill:1:x:1' is not kill:RANK:STEP[:ATTEMPT]") == 0);
  for (const char* bad : {"kill:2:3,", ",kill:2:3", "kill:2:3,,kill:1:4:1"}) {
    CAPTURE(bad);
    auto r = parse_faults(bad, "TROUPE_FAULT");
    REQUIRE_FALSE(r.ok());
    CHECK(r.err().message == "TROUPE_FAULT='' names no known fault ''");
  }
}

TEST_CASE("a malformed TROUPE_FAULT is refused naming the text and the forms") {
  for (const char* bad : {"", "drop", "drop:1", "drop:1:2:3", "drop:-1:2", "drop:a:2", "nan:1:",
                          "enospc:0", "enospc:1:2", "slow:1:0.5", "slow:1:x", "slow:1:1e9",
                          "slow:1:nan", "melt:1:2", "drop:1234567890:1", "poison:1",
                          "poison:1:x", "poison:1:2:x", "poison:1:2:", "poison:1:2:3:4", "poison:-1:2",
                          "stall:1", "stall:1:2:3", "stall:x:2"}) {
    CAPTURE(bad);
    auto r = parse_fault(bad, "TROUPE_FAULT");
    REQUIRE_FALSE(r.ok());
    CHECK(r.err().message.find("TROUPE_FAULT='" + std::string(bad) + "'") == 0);
    CHECK(r.err().hint.find("drop:RANK:STEP, enospc:STEP, nan:RANK:STEP, slow:RANK:FACTOR") !=
          std::string::npos);
  }
}

TEST_CASE("fault_from_env reads TROUPE_FAULT, and nothing when it is unset or empty") {
  ::unsetenv("TROUPE_FAULT");
  auto none = fault_from_env();
  REQUIRE(none.ok());
  CHECK(none.value().empty());
  ::setenv("TROUPE_FAULT", "", 1);
  CHECK(fault_from_env().value().empty());
  ::setenv("TROUPE_FAULT", "nan:1:2", 1);
  auto one = fault_from_env();
  REQUIRE(one.ok());
  REQUIRE(one.value().size() == 1);
  CHECK(one.value()[0].kind == fault_kind::nan);
  ::setenv("TROUPE_FAULT", "kill:1:2,kill:0:5:1", 1);
  auto two = fault_from_env();
  REQUIRE(two.ok());
  CHECK(two.value().size() == 2);
  ::setenv("TROUPE_FAULT", "nan:1", 1);
  CHECK_FALSE(fault_from_env().ok());
  ::unsetenv("TROUPE_FAULT");
}
