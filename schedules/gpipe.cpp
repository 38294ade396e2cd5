// GPipe: all forwards, then all backwards. The simplest schedule and the most memory-hungry: every
// rank keeps all m micro-batches' activations until the backwards begin. Backwards run in
// micro-batch order 0..m-1 (not the reverse GPipe often shows) so gradients accumulate in the
// order the runtime promises; with F and B costs uniform the bubble is the same either way.
#include "schedules/generators.hpp"

namespace troupe::schedules {

core::result<schedule> make_gpipe(int p, int m, const schedule_options& options) {
  if (auto st = check_generator_args("gpipe", p, m, options, false); !st) return st.err();
  schedule s{p, m, 1, std::vector<std::vector<instruction>>(p), "gpipe"};
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    for (int j = 0; j < m; ++j) list.push_back({r, op_kind::F, j});
    for (int j = 0; j < m; ++j) list.push_back({r, op_kind::B, j});
  }
  return s;
}

}  // namespace troupe::schedules
