// Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021). Each rank holds v chunks (rank r holds
// global chunks r, r+p, ...), so a micro-batch crosses every rank v times and the pipeline fills v
// times faster: the bubble shrinks from (p-1)/(m+p-1) to (p-1)/(v*m+p-1) of the step, at the price
// of v times more transfers and a longer warm-up.
//
// The rank's work is a sequence of v*m "virtual micro-batches" k. They are taken in groups of p
// micro-batches per chunk: forward k runs local chunk (k mod p*v) / p on micro-batch
// (k / (p*v)) * p + k mod p; backward k runs the chunks in reverse. Grouping by p is why m must be
// a multiple of p. Warm-up is 2(p - r - 1) + (v - 1)p forwards, then 1F1B, then cool-down.
#include <algorithm>

#include "schedules/generators.hpp"

namespace troupe::schedules {

core::result<schedule> make_interleaved_1f1b(int p, int m, const schedule_options& options) {
  if (auto st = check_generator_args("interleaved_1f1b", p, m, options, true); !st) return st.err();
  const int v = options.virtual_stages;
  if (v == 1) {
    auto s = make_1f1b(p, m, options);
    if (s) s->name = "interleaved_1f1b";
    return s;
  }
  if (m % p != 0) {
    const std::string up = std::to_string((m / p + 1) * p);
    return core::error::make(
        "interleaved_1f1b needs micro_batch_num m to be a multiple of pipeline_stage p, but m = " +
            std::to_string(m) + " and p = " + std::to_string(p),
        "use m = " + (m < p ? up : std::to_string(m / p * p) + " or " + up) +
            ", or 1f1b / zb_h1, which take any m");
  }
  schedule s{p, m, v, std::vector<std::vector<instruction>>(p), "interleaved_1f1b"};
  const int total = v * m;
  const int group = p * v;
  for (int r = 0; r < p; ++r) {
    auto forward = [&](int k) {
      const int local = (k % group) / p;
      return instruction{local * p + r, op_kind::F, (k / group) * p + k % p};
    };
    auto backward = [&](int k) {
      const int local = v - 1 - (k % group) / p;
      return instruction{local * p + r, op_kind::B, (k / group) * p + k % p};
    };
    const int warmup = std::min(2 * (p - r - 1) + (v - 1) * p, total);
    const int steady = total - warmup;
    auto& list = s.ranks[r];
    int next_f = 0, next_b = 0;
    for (int k = 0; k < warmup; ++k) list.push_back(forward(next_f++));
    for (int k = 0; k < steady; ++k) {
      list.push_back(forward(next_f++));
      list.push_back(backward(next_b++));
    }
    while (next_b < total) list.push_back(backward(next_b++));
  }
  return s;
}

}  // namespace troupe::schedules
