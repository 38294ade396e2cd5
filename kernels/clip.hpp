// The clip scale of the global gradient norm (model/optimizer.hpp, step 5), shared by the host and
// the device so that a clip decided on the GPU has the bits of the one the coordinator decides.
// IEEE double division, addition and the conversion to float round the same way on both.
#pragma once

#include "core/exact_sum.hpp"

namespace troupe::kernels {

/// grad_clip / (norm + 1e-6) as float when clipping is on and the norm exceeds it, else 1.
TROUPE_HD inline float clip_scale_of(double norm, double grad_clip) {
  if (grad_clip > 0 && norm > grad_clip) return static_cast<float>(grad_clip / (norm + 1e-6));
  return 1.0f;
}

}  // namespace troupe::kernels
