// Everything a run checks before it starts, in one place, so that `troupe config check`, `troupe
// train`, `troupe launch` and `troupe worker` accept and refuse the same configs: the config's
// files exist and are what they should be (core::check_files), its schedule builds, lowers and
// validates, its token shards open and are long enough, and evaluation asks for no more than the
// validation data holds. No CAF here.
#pragma once

#include "core/config.hpp"
#include "core/error.hpp"

namespace troupe::actors {

/// The checks above. Reads every shard's header; builds no model.
core::status preflight(const core::config& cfg);

}  // namespace troupe::actors
