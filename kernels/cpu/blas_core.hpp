// The OpenBLAS kernels the CPU backend's GEMMs run (kernels/cpu/blas_core.cpp chooses them).
#pragma once

#include <string>

namespace troupe::kernels::cpu {

/// The OpenBLAS kernel set troupe asks for on this processor: "SkylakeX" with AVX-512 (F, CD, BW,
/// DQ, VL), "Haswell" with AVX2 and FMA, nullptr otherwise (OpenBLAS's own choice stands).
const char* blas_core_for_cpu();
/// The kernel set OpenBLAS runs now (its core name), with " (OPENBLAS_CORETYPE)" when the
/// environment chose it.
std::string blas_core();
/// True when troupe replaced OpenBLAS's own choice at start-up.
bool blas_core_chosen();

}  // namespace troupe::kernels::cpu
