// ZB-V, the zero-bubble V schedule (Qi et al., "Pipeline Parallelism with Controllable Memory",
// 2024). Two chunks per rank placed in a V (placement::v): rank r holds chunk r, on the way down,
// and chunk 2p-1-r, on the way back, so rank 0 runs both the embedding and the loss and chunk p-1
// hands its output to chunk p on rank p-1 without a transfer. The backward is split as in ZB-H1:
// I (input gradient, on the critical path) and W (weight gradient, which nobody waits for).
//
// The order is not written out as three loops but found by a greedy list scheduler that runs the
// pipeline in unit time (F = I = W = 1, transfers free) and, at each time step, gives every rank
// the first that is ready of:
//   1. I, the critical path back through the pipeline;
//   2. F, if the rank stays within its activation budget;
//   3. W, which frees activations and fills what would be bubbles;
// and within a kind the rank's oldest micro-batch (a rank's two chunks never offer the same one).
// Warm-up, steady state and cool-down come out of those rules: forwards run until the budget is
// full, then I, F and W alternate, and the W's left at the end close the step.
//
// Memory: a (chunk, micro-batch) activation lives from its F to its W. The budget is 2p of them
// per rank; a chunk is half of a 1F1B stage, so that is 1F1B's peak of p stage activations.
// Every chunk's F, I and W run in micro-batch order (the runtime's bit-exact accumulation).
//
// With F = I = W = 1 no rank can finish before 6m + p - 1 (rank p-1 waits p - 1 for its first
// input, then has 6m of work), so every rank idles at least p - 1 of the step, a bubble of
// (p-1)/(6m+p-1). These rules reach that bound for p <= 4 and stay within a few units of it
// beyond (tests/schedules/zb_v_test.cpp), against zb_h1's (p-1)/(3m+p-1) in stage units.
#include <algorithm>
#include <array>
#include <vector>

#include "schedules/generators.hpp"

namespace troupe::schedules {

core::result<schedule> make_zb_v(int p, int m, const schedule_options& options) {
  if (auto st = check_generator_args("zb_v", p, m, options, true); !st) return st.err();
  if (options.virtual_stages != 2)
    return core::error::make("zb_v runs exactly two chunks per rank (a V), but virtual stages v = " +
                                 std::to_string(options.virtual_stages) + " were asked for",
                             "set parallel.virtual_pipeline = 2 (troupe schedule: --virtual 2), or use "
                             "interleaved_1f1b for other v");
  schedule s{p, m, 2, std::vector<std::vector<instruction>>(p), "zb_v", placement::v};
  const int chunks = 2 * p;
  const int budget = 2 * p;
  constexpr int not_yet = -1;
  // End times of each (chunk, micro-batch) forward and input backward; not_yet until run.
  std::vector<int> f_end(static_cast<std::size_t>(chunks) * m, not_yet), i_end(f_end.size(), not_yet);
  auto at = [m](int c, int j) { return static_cast<std::size_t>(c) * m + j; };
  std::vector<int> next_f(chunks, 0), next_i(chunks, 0), next_w(chunks, 0), in_flight(p, 0);
  auto done_by = [](int end, int t) { return end != not_yet && end <= t; };

  auto ready_f = [&](int c, int t) {
    const int j = next_f[c];
    return j < m && (c == 0 || done_by(f_end[at(c - 1, j)], t));
  };
  auto ready_i = [&](int c, int t) {
    const int j = next_i[c];
    return j < m && done_by(f_end[at(c, j)], t) && (c == chunks - 1 || done_by(i_end[at(c + 1, j)], t));
  };
  auto ready_w = [&](int c, int t) {
    const int j = next_w[c];
    return j < next_i[c] && done_by(i_end[at(c, j)], t);
  };

  const long total = 3L * chunks * m;
  long placed = 0;
  for (int t = 0; placed < total; ++t) {
    bool moved = false;
    for (int r = 0; r < p; ++r) {
      const std::array<int, 2> mine = {s.chunk_of(r, 0), s.chunk_of(r, 1)};
      // The ready instruction of `kind` with the oldest micro-batch on this rank, if any.
      auto oldest = [&](op_kind kind) {
        instruction best{-1, kind, m};
        for (int c : mine) {
          const bool ready = kind == op_kind::I   ? ready_i(c, t)
                             : kind == op_kind::F ? ready_f(c, t) && in_flight[r] < budget
                                                  : ready_w(c, t);
          const int j = kind == op_kind::I ? next_i[c] : kind == op_kind::F ? next_f[c] : next_w[c];
          if (ready && j < best.mb) best = {c, kind, j};
        }
        return best;
      };
      instruction op = oldest(op_kind::I);
      if (op.chunk < 0) op = oldest(op_kind::F);
      if (op.chunk < 0) op = oldest(op_kind::W);
      if (op.chunk < 0) continue;
      switch (op.kind) {
        case op_kind::F: f_end[at(op.chunk, op.mb)] = t + 1, ++next_f[op.chunk], ++in_flight[r]; break;
        case op_kind::I: i_end[at(op.chunk, op.mb)] = t + 1, ++next_i[op.chunk]; break;
        default: ++next_w[op.chunk], --in_flight[r]; break;
      }
      s.ranks[r].push_back(op);
      ++placed;
      moved = true;
    }
    // Everything started at t ends at t + 1: a step in which no rank moved is followed by the same
    // state, so the rules above would wait for ever. The sweep in the tests never gets here.
    if (!moved)
      return core::error::make("zb_v found no order for p = " + std::to_string(p) + ", m = " + std::to_string(m) +
                                   ": every rank waits at time " + std::to_string(t),
                               "use zb_h1 for this p and m");
  }
  return s;
}

}  // namespace troupe::schedules
