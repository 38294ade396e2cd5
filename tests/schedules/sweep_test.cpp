// Every built-in schedule validates, lowers and simulates without deadlock for p in 1..8 and m in
// 1..32; interleaving refuses m that is not a multiple of p with a clear error.
#include <doctest/doctest.h>

#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"
#include "schedules/validate.hpp"

using namespace troupe::schedules;

namespace {

// Empty when `s` validates, simulates and lowers to a schedule that does too; else what failed.
std::string problems(const schedule& s) {
  if (auto st = validate(s); !st) return "validate: " + st.err().to_string();
  if (auto sim = simulate(s); !sim) return "simulate: " + sim.err().to_string();
  const schedule low = lower(s);
  if (auto st = validate(low); !st) return "validate lowered: " + st.err().to_string();
  if (auto sim = simulate(low); !sim) return "simulate lowered: " + sim.err().to_string();
  return {};
}

void sweep(const std::string& name, int v) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 32; ++m) {
      schedule_options o;
      o.virtual_stages = v;
      auto s = make_schedule(name, p, m, o);
      CAPTURE(name);
      CAPTURE(p);
      CAPTURE(m);
      CAPTURE(v);
      if (v > 1 && m % p != 0) {
        REQUIRE_FALSE(s.ok());
        CHECK(s.err().message.find("multiple of pipeline_stage p") != std::string::npos);
        continue;
      }
      REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
      const std::string found = problems(*s);
      CHECK_MESSAGE(found.empty(), found);
    }
}

}  // namespace

TEST_CASE("gpipe validates and simulates for p 1..8, m 1..32") { sweep("gpipe", 1); }
TEST_CASE("1f1b validates and simulates for p 1..8, m 1..32") { sweep("1f1b", 1); }
TEST_CASE("zb_h1 validates and simulates for p 1..8, m 1..32") { sweep("zb_h1", 1); }
TEST_CASE("interleaved_1f1b (v = 2) validates and simulates for p 1..8, m 1..32 multiples of p") {
  sweep("interleaved_1f1b", 2);
}
TEST_CASE("interleaved_1f1b (v = 3) validates and simulates for p 1..8, m 1..32 multiples of p") {
  sweep("interleaved_1f1b", 3);
}
