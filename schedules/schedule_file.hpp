// Schedule files: how a user writes a schedule by hand.
//
// Text form (any extension but .csv): one line per rank, instructions separated by spaces or
// commas, '#' starts a comment. A line may start with "rank N:" (then ranks must come in order).
//     # 1F1B, p = 2, m = 2
//     rank 0: 0F0 0F1 0B0 0B1
//     rank 1: 1F0 1B0 1F1 1B1
// Transfers may be written with or without their peer ("0SEND_F1->1" or "0SEND_F1"); a missing
// peer is filled in from the chunk layout. A file without any transfer is compute-only and is
// lowered like a built-in; a file with transfers is taken as written.
//
// A line "placement v" before the rank lines puts chunks in a V (schedule.hpp: chunk c of an odd
// round c / p on rank p-1 - c % p, as ZB-V has them); without it chunk c lives on rank c % p.
//
// CSV form (.csv), PyTorch's compute-only dump (`_dump_csv`): one row per rank, one action per
// cell, empty cells are idle steps and are skipped.
//
// p is the number of rank lines, v = (largest chunk) / p + 1, m = largest micro-batch + 1.
#pragma once

#include <string>
#include <string_view>

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// Reads a schedule file (text, or CSV when the name ends in .csv). Errors name file:line:column.
core::result<schedule> load_schedule_file(const std::string& path);

/// Parses schedule text; `source` names it in errors and becomes the schedule's name.
core::result<schedule> parse_schedule_text(std::string_view text, const std::string& source, bool csv);

/// The text form, one "rank N:" line per rank; parse_schedule_text reads it back unchanged.
std::string format_schedule_text(const schedule& s);

}  // namespace troupe::schedules
