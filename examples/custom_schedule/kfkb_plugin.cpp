// A schedule plugin: kFkB, 1F1B generalised to groups of k micro-batches. Rank r first runs
// k·(p − r) forwards, then alternates k backwards and k forwards, then runs the backwards left.
// k = 1 is exactly 1F1B (p − r forwards before the first backward); a larger k holds up to
// k·(p − r) micro-batches' activations on rank r instead of p − r and hands each transfer k
// micro-batches of slack. The plugin registers k = 2 as "2f2b" and k = 1 as "1f1b_as_kfkb" (equal
// to the built-in 1f1b, a check the example runs).
//
// Built by examples/CMakeLists.txt as a MODULE library against troupe's headers only, as a plugin
// must be (the troupe executable exports no functions). A config names it as
// `schedule.name = "path/to/libkfkb_schedule.so:2f2b"`; `troupe schedule show|check|simulate`
// take the same name, or `--plugin LIB.so -s 2f2b`.
#include <algorithm>

#include "schedules/plugin.hpp"

namespace {

using troupe::core::result;
using troupe::schedules::op_kind;
using troupe::schedules::schedule;
using troupe::schedules::schedule_options;

result<schedule> kfkb(int k, const char* name, int p, int m, const schedule_options& options) {
  if (p < 1 || m < 1)
    return troupe::core::error::make(std::string(name) + " needs at least one stage and one micro-batch");
  if (options.virtual_stages != 1)
    return troupe::core::error::make(std::string(name) + " runs one chunk per rank (virtual_pipeline = 1)",
                                     "use interleaved_1f1b for virtual stages");
  schedule s;
  s.stages = p;
  s.microbatches = m;
  s.virtual_stages = 1;
  s.name = name;
  s.ranks.resize(p);
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    int f = 0, b = 0;
    const int warmup = std::min(k * (p - r), m);
    while (f < warmup) list.push_back({r, op_kind::F, f++});
    while (b < m) {
      for (int i = 0; i < k && b < m; ++i) list.push_back({r, op_kind::B, b++});
      for (int i = 0; i < k && f < m; ++i) list.push_back({r, op_kind::F, f++});
    }
  }
  return s;
}

}  // namespace

TROUPE_SCHEDULE_PLUGIN(host) {
  if (auto st = host.add("2f2b", [](int p, int m, const schedule_options& o) { return kfkb(2, "2f2b", p, m, o); }); !st)
    return st;
  return host.add("1f1b_as_kfkb", [](int p, int m, const schedule_options& o) { return kfkb(1, "1f1b_as_kfkb", p, m, o); });
}
