// Which pipeline rank holds each model chunk, from the config alone. The schedule decides it
// (schedules/schedule.hpp: placement `interleaved` puts chunk c on rank c % p; `v`, zb_v's, puts
// chunk c of an odd round k = c / p on rank p-1 - c % p, so rank r holds chunks r and 2p-1-r at
// v = 2). core does not build schedules: it takes the V when the config names zb_v; a caller
// that built the schedule (a file's `placement v` line, a plugin's generator) passes what it says.
#pragma once

#include <vector>

#include "core/config.hpp"

namespace troupe::core {

/// True when c's schedule is known from the config alone to place chunks in a V: schedule.name
/// "zb_v" and no schedule.file.
bool chunks_in_v(const config& c);

/// Layers of each pipeline rank: chunk_layers(c) summed per rank, chunks placed in a V when
/// `v_placement`, else interleaved. derive(c).stage_layers is rank_layers(c, chunks_in_v(c)).
std::vector<int> rank_layers(const config& c, bool v_placement);

}  // namespace troupe::core
