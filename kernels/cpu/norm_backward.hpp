// The backward of LayerNorm and RMSNorm over the last dimension, one implementation for both: with
// xhat = (x - mean) * rstd (mean = 0 for RMSNorm) and g = dy * w,
//   dx += rstd * ((g - mean(g)) - xhat * mean(g * xhat))     (RMSNorm: no mean(g) term)
//   dw += Σ_rows dy * xhat,  db += Σ_rows dy                  (LayerNorm's bias only)
// dx is per row (threads take rows); dw and db are column sums, so a second pass lets threads take
// column ranges and adds the rows in row order. Subtracting a zero mean and a zero mean(g) is
// exact, so RMSNorm's results are those of its own formula bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/fast_math.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

/// n rows of ch channels. mean: nullptr for RMSNorm; db: nullptr when there is no bias.
inline void norm_backward(const float* dyp, const float* xp, const float* wp, const float* mp,
                          const float* rp, float* dxp, float* dwp, float* dbp, std::int64_t n,
                          std::int64_t ch) {
  const float inv_c = 1.0f / static_cast<float>(ch);
  parallel_for(n, std::max<std::int64_t>(1, (1 << 14) / ch), [&](std::int64_t r0, std::int64_t r1) {
    std::vector<float> g(static_cast<std::size_t>(ch)), xhat(static_cast<std::size_t>(ch));
    for (std::int64_t r = r0; r < r1; ++r) {
      const float* dyr = dyp + r * ch;
      const float* xr = xp + r * ch;
      float* dxr = dxp + r * ch;
      const float m = mp ? mp[r] : 0.0f, s = rp[r];
      for (std::int64_t j = 0; j < ch; ++j) {
        g[j] = dyr[j] * wp[j];
        xhat[j] = (xr[j] - m) * s;
      }
      const float g_mean = mp ? sum(g.data(), ch) * inv_c : 0.0f;
      const float gx_mean = dot(g.data(), xhat.data(), ch) * inv_c;
      for (std::int64_t j = 0; j < ch; ++j) dxr[j] += s * ((g[j] - g_mean) - xhat[j] * gx_mean);
    }
  });
  parallel_for(ch, std::max<std::int64_t>(16, (1 << 15) / std::max<std::int64_t>(n, 1)),
               [&](std::int64_t c0, std::int64_t c1) {
                 for (std::int64_t r = 0; r < n; ++r) {
                   const float* dyr = dyp + r * ch;
                   const float* xr = xp + r * ch;
                   const float m = mp ? mp[r] : 0.0f, s = rp[r];
                   for (std::int64_t j = c0; j < c1; ++j) dwp[j] += dyr[j] * ((xr[j] - m) * s);
                   if (dbp)
                     for (std::int64_t j = c0; j < c1; ++j) dbp[j] += dyr[j];
                 }
               });
}

}  // namespace troupe::kernels::cpu
