// A schedule plugin for the dlopen tests: registers PyTorch's looped BFS schedule (every rank runs
// all micro-batches through one chunk before the next; backwards in reverse chunk order) under
// TEST_PLUGIN_NAME. Built twice by tests/CMakeLists.txt: once under a new name, once under
// "1f1b" to show that a clash with a built-in is refused. It uses only troupe headers, as a
// plugin must (the executable exports no troupe functions).
#include "schedules/plugin.hpp"

namespace {

troupe::core::result<troupe::schedules::schedule> looped_bfs(int p, int m,
                                                             const troupe::schedules::schedule_options& options) {
  using troupe::schedules::op_kind;
  const int v = options.virtual_stages;
  if (p < 1 || m < 1 || v < 1)
    return troupe::core::error::make("looped_bfs needs p, m and v of at least 1");
  troupe::schedules::schedule s;
  s.stages = p;
  s.microbatches = m;
  s.virtual_stages = v;
  s.name = TEST_PLUGIN_NAME;
  s.ranks.resize(p);
  for (int r = 0; r < p; ++r) {
    for (int local = 0; local < v; ++local)
      for (int j = 0; j < m; ++j) s.ranks[r].push_back({local * p + r, op_kind::F, j});
    for (int local = v - 1; local >= 0; --local)
      for (int j = 0; j < m; ++j) s.ranks[r].push_back({local * p + r, op_kind::B, j});
  }
  return s;
}

}  // namespace

TROUPE_SCHEDULE_PLUGIN(host) { return host.add(TEST_PLUGIN_NAME, looped_bfs); }
