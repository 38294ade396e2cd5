// Costs as users write them on the command line: "F,B,W,comm" (I = B - W), or named fields
// "f=1,b=2,i=1,w=1,comm=0.1,reduce=0,step=0".
#pragma once

#include <string>
#include <string_view>

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// Parses "F,B[,W[,comm]]" or "key=value,...". Positional: I = B - W; without W, I = W = B / 2.
/// Named: b without i and w splits evenly; i and w without b make b = i + w.
core::result<cost_model> parse_costs(std::string_view text);

/// "F=1 B=2 I=1 W=1 comm=0" (reduce and step only when not zero).
std::string format_costs(const cost_model& c);

}  // namespace troupe::schedules
