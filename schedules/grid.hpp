// The step x rank grid: row k shows each rank's k-th instruction. It is how `troupe schedule show`
// prints a schedule and how validation points at a problem: marked cells read ">1B3<".
#pragma once

#include <string>
#include <vector>

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// A cell to mark: rank r's instruction at index `step` (a step past the end marks the row where
/// the list ran out).
struct grid_mark {
  int rank = 0;
  int step = 0;
};

/// The grid as text. With marks and a long schedule, only the rows near a mark are printed
/// (`context` rows either side) and the rest are elided with "...".
std::string format_grid(const schedule& s, const std::vector<grid_mark>& marks = {},
                        int context = 6);

}  // namespace troupe::schedules
