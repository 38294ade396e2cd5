// 1F1B (PipeDream-flush), written as Megatron's three loops with the counts computed first.
// Rank r runs p - r - 1 warm-up forwards so that, when the first gradient comes back from the last
// rank, it has exactly the micro-batches in flight that keep it busy; then it alternates one
// forward and one backward; then it drains the remaining backwards. A micro-batch's activations
// live from its F to its B, so rank r never holds more than min(p - r, m).
#include <algorithm>

#include "schedules/generators.hpp"

namespace troupe::schedules {

core::result<schedule> make_1f1b(int p, int m, const schedule_options& options) {
  if (auto st = check_generator_args("1f1b", p, m, options, false); !st) return st.err();
  schedule s{p, m, 1, std::vector<std::vector<instruction>>(p), "1f1b"};
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(p - r - 1, m);
    const int steady = m - warmup;
    auto& list = s.ranks[r];
    int next_f = 0, next_b = 0;
    for (int k = 0; k < warmup; ++k) list.push_back({r, op_kind::F, next_f++});
    for (int k = 0; k < steady; ++k) {
      list.push_back({r, op_kind::F, next_f++});
      list.push_back({r, op_kind::B, next_b++});
    }
    for (int k = 0; k < warmup; ++k) list.push_back({r, op_kind::B, next_b++});
  }
  return s;
}

}  // namespace troupe::schedules
