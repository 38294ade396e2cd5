// Helpers of the schedule tests: a built-in schedule and its simulation, failing the test case
// with the error when either cannot be made.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"

namespace troupe::schedules::testing {

/// Built-in schedule `name` for p stages, m micro-batches and v virtual stages per rank.
inline schedule made(const std::string& name, int p, int m, int v = 1) {
  schedule_options o;
  o.virtual_stages = v;
  auto s = make_schedule(name, p, m, o);
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
  return *s;
}

inline simulation simulated(const schedule& s, const cost_model& c) {
  auto sim = simulate(s, c);
  REQUIRE_MESSAGE(sim.ok(), (sim.ok() ? "" : sim.err().to_string()));
  return *sim;
}

}  // namespace troupe::schedules::testing
