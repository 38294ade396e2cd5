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
  auto poison = parse_fault("poison:2:5", "TROUPE_FAULT");
  REQUIRE(poison.ok());
  CHECK(poison->kind == fault_kind::poison);
  CHECK(poison->rank == -1);
  CHECK(poison->step == 2);
  CHECK(poison->sequence == 5);
  CHECK(std::isnan(poison->loss));
  CHECK(parse_fault("poison:2:5:1e4", "X")->loss == 1e4);
}

TEST_CASE("a malformed TROUPE_FAULT is refused naming the text and the forms") {
  for (const char* bad : {"", "drop", "drop:1", "drop:1:2:3", "drop:-1:2", "drop:a:2", "nan:1:",
                          "enospc:0", "enospc:1:2", "slow:1:0.5", "slow:1:x", "slow:1:1e9",
                          "slow:1:nan", "melt:1:2", "drop:1234567890:1", "poison:1",
                          "poison:1:x", "poison:1:2:x", "poison:1:2:", "poison:1:2:3:4", "poison:-1:2"}) {
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
  CHECK_FALSE(none.value().has_value());
  ::setenv("TROUPE_FAULT", "", 1);
  CHECK_FALSE(fault_from_env().value().has_value());
  ::setenv("TROUPE_FAULT", "nan:1:2", 1);
  auto one = fault_from_env();
  REQUIRE(one.ok());
  REQUIRE(one.value().has_value());
  CHECK(one.value()->kind == fault_kind::nan);
  ::setenv("TROUPE_FAULT", "nan:1", 1);
  CHECK_FALSE(fault_from_env().ok());
  ::unsetenv("TROUPE_FAULT");
}
