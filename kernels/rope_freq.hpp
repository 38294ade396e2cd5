// Rotary frequencies, shared by the CPU reference (kernels/cpu/rope.cpp) and the CUDA kernels
// (kernels/cuda/rope.cu) so both compute the same double expression.
//
// Pair i of a head of D elements turns by t · f_i at position t, f_i = theta^(-2i/D). With llama3
// scaling (Hugging Face rope_scaling {"rope_type": "llama3"}, Llama 3.1), for the wavelength
// w = 2π / f_i, L = original_max_positions, lo = low_freq_factor, hi = high_freq_factor:
//   w > L / lo          f_i / factor            (long wavelengths stretched)
//   w < L / hi          f_i                     (short wavelengths kept)
//   otherwise           (1 - s) f_i / factor + s f_i,   s = (L / w - lo) / (hi - lo)
#pragma once

#include <cmath>

#ifdef __CUDACC__
#define TROUPE_ROPE_HD __host__ __device__ __forceinline__
#else
#define TROUPE_ROPE_HD inline
#endif

namespace troupe::kernels {

/// The rotary embedding's frequencies: base theta and optional llama3 scaling (factor 0 = none).
struct rope_spec {
  double theta = 10000.0;
  double factor = 0;  // > 0: llama3 scaling with the three values below
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_positions = 8192;

  bool operator==(const rope_spec&) const = default;
};

/// f_i of pair i of a head of head_dim elements (see the top of this file).
TROUPE_ROPE_HD double rope_inv_freq(const rope_spec& r, int i, int head_dim) {
  const double f = pow(r.theta, -2.0 * i / head_dim);
  if (!(r.factor > 0)) return f;
  const double wavelen = 6.283185307179586476925 / f;
  const double low_wavelen = r.original_max_positions / r.low_freq_factor;
  const double high_wavelen = r.original_max_positions / r.high_freq_factor;
  if (wavelen > low_wavelen) return f / r.factor;
  if (wavelen < high_wavelen) return f;
  const double s = (r.original_max_positions / wavelen - r.low_freq_factor) /
                   (r.high_freq_factor - r.low_freq_factor);
  return (1.0 - s) * f / r.factor + s * f;
}

}  // namespace troupe::kernels
