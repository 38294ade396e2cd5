// `troupe plan --calibrate FILE`: measures the rates of cost_model.hpp on the config's device by
// running the model's own code there — a chunk's forward and backward (two layers and the head at
// the config's micro-batch size), AdamW over a large buffer, a device copy — and writes them to a
// calibration file that later plans read with --calibration FILE.
#pragma once

#include "core/config.hpp"
#include "core/error.hpp"
#include "plan/cost_model.hpp"

namespace troupe::plan {

/// Times `repeats` runs of each measurement after a warm-up. Errors: the device is not available.
core::result<calibration> calibrate(const core::config& cfg, int repeats = 5);

}  // namespace troupe::plan
