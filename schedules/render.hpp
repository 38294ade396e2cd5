// Pictures of a simulated schedule: an SVG timeline (one row per rank, a colour per kind, the
// micro-batch in each box, idle time hatched so bubbles stand out) and a Chrome-trace JSON that
// Perfetto or chrome://tracing opens (one track per rank; one cost unit is drawn as 1 ms).
#pragma once

#include <string>

#include "schedules/simulate.hpp"

namespace troupe::schedules {

/// The SVG document. `subtitle` goes under the title (costs, say).
std::string render_svg(const schedule& s, const simulation& sim, const std::string& subtitle = {});

/// The Chrome-trace JSON document ({"traceEvents": [...]}).
std::string render_trace(const schedule& s, const simulation& sim);

/// `text` with &, <, > and " escaped, for SVG/HTML text and attribute values.
std::string xml_escape(const std::string& text);

}  // namespace troupe::schedules
