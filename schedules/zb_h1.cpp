// ZB-H1, the memory-neutral zero-bubble schedule (Qi et al., "Zero Bubble Pipeline Parallelism",
// 2023). The backward is split: I computes the gradient the previous rank waits for, W the weight
// gradient nobody waits for. Only the I's sit on the critical path back through the pipeline, so
// rank r defers its first r W's and runs them where 1F1B would idle in the cool-down.
//
// Rank r: p - r warm-up forwards, then for j = 0..m-1: I(j); W(j - r) once j >= r; the next
// forward. The remaining W's close the step. After each forward, F's done minus W's done is at
// most p, so no rank holds more activations than 1F1B's first rank: min(p, m). With F, I and W
// one unit each, every rank idles (p - 1)(F + I - W) per step against 1F1B's (p - 1)(F + I + W).
#include <algorithm>

#include "schedules/generators.hpp"

namespace troupe::schedules {

core::result<schedule> make_zb_h1(int p, int m, const schedule_options& options) {
  if (auto st = check_generator_args("zb_h1", p, m, options, false); !st) return st.err();
  schedule s{p, m, 1, std::vector<std::vector<instruction>>(p), "zb_h1"};
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    int next_f = 0, next_w = 0;
    const int warmup = std::min(p - r, m);
    while (next_f < warmup) list.push_back({r, op_kind::F, next_f++});
    for (int j = 0; j < m; ++j) {
      list.push_back({r, op_kind::I, j});
      if (j >= r) list.push_back({r, op_kind::W, next_w++});
      if (next_f < m) list.push_back({r, op_kind::F, next_f++});
    }
    while (next_w < m) list.push_back({r, op_kind::W, next_w++});
  }
  return s;
}

}  // namespace troupe::schedules
