#include "schedules/simulate.hpp"

#include <algorithm>

#include "schedules/grid.hpp"
#include "schedules/validate.hpp"

namespace troupe::schedules {

std::vector<int> peak_activations(const schedule& s) {
  std::vector<int> peak(s.ranks.size(), 0);
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    int live = 0;
    for (const auto& op : s.ranks[r]) {
      if (op.kind == op_kind::F) peak[r] = std::max(peak[r], ++live);
      if (op.kind == op_kind::B || op.kind == op_kind::W) --live;
    }
  }
  return peak;
}

core::result<simulation> simulate(const schedule& s, const cost_model& costs) {
  // The engine indexes by chunk, micro-batch and peer; refuse lists that name ones that do not
  // exist, but leave completeness and order to the run itself, so a deadlock reads as one.
  validate_options structural;
  structural.require_microbatch_order = false;
  structural.check_progress = false;
  if (s.stages < 1 || s.microbatches < 1 || s.virtual_stages < 1 ||
      static_cast<int>(s.ranks.size()) != s.stages)
    return validate(s, structural).err();
  for (int r = 0; r < s.stages; ++r)
    for (const auto& op : s.ranks[r]) {
      const bool chunk_ok = op.kind == op_kind::STEP || (op.chunk >= 0 && op.chunk < s.chunks() &&
                                                          s.rank_of(op.chunk) == r);
      const bool mb_ok = op.kind == op_kind::STEP || op.kind == op_kind::REDUCE_GRAD ||
                         (op.mb >= 0 && op.mb < s.microbatches);
      if (!chunk_ok || !mb_ok) return validate(s, structural).err();
    }

  if (!costs.chunks.empty() && static_cast<int>(costs.chunks.size()) != s.chunks())
    return core::error::make(
        "the costs name " + std::to_string(costs.chunks.size()) + " chunks, schedule '" + s.name +
            "' has " + std::to_string(s.chunks()) + " (p " + std::to_string(s.stages) + " × v " +
            std::to_string(s.virtual_stages) + ")",
        "simulate with the pipeline ranks and chunks per rank of the run that measured them");
  execution run = execute(s, costs);
  if (!run.complete()) {
    std::vector<grid_mark> marks;
    for (auto& st : run.stuck) marks.push_back({st.rank, st.step});
    std::string grid = format_grid(s, marks);
    grid.pop_back();
    return core::error::make("schedule '" + s.name + "' cannot be simulated: " + run.describe_deadlock() + "\n" + grid,
                             "run `troupe schedule check` for the full diagnosis");
  }
  simulation out;
  for (auto& list : run.timeline)
    for (auto& t : list) out.makespan = std::max(out.makespan, t.end);
  const auto peaks = peak_activations(s);
  double total_compute = 0;
  for (int r = 0; r < s.stages; ++r) {
    rank_report rep;
    for (auto& t : run.timeline[r]) {
      const double d = t.end - t.start;
      if (is_compute(t.op.kind)) rep.compute += d;
      else if (is_transfer(t.op.kind)) rep.transfer += d;
      else rep.other += d;
    }
    rep.idle = out.makespan - rep.compute - rep.transfer - rep.other;
    rep.bubble = out.makespan > 0 ? (out.makespan - rep.compute) / out.makespan : 0;
    rep.peak_activations = peaks[r];
    total_compute += rep.compute;
    out.ranks.push_back(rep);
  }
  out.bubble = out.makespan > 0 ? 1 - total_compute / (s.stages * out.makespan) : 0;
  out.timeline = std::move(run.timeline);
  return out;
}

}  // namespace troupe::schedules
