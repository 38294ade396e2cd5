// Which OpenBLAS kernels the CPU GEMMs run: chosen from the instruction sets the processor has,
// once, before main().
//
// Debian's OpenBLAS picks its kernels by processor model and falls back to its SSE3 ("Prescott")
// kernels on a model it does not know; 0.3.21 does not know current Xeons, which then run every
// GEMM about three times slower than their AVX-512 kernels would. So unless OPENBLAS_CORETYPE is
// set (the user's choice wins), troupe names the kernels itself: SkylakeX on a processor with
// AVX-512 (F, CD, BW, DQ, VL), Haswell on one with AVX2 and FMA, OpenBLAS's own choice otherwise.
// The kernels decide how a GEMM rounds, so this also makes the bits of a CPU run depend on the
// instruction sets of the machine rather than on its model name (docs/kernels.md, "Determinism").
//
// The switch uses OpenBLAS's dynamic-architecture entry points (weak symbols: a build of OpenBLAS
// for one architecture has none and keeps its kernels). It runs during static initialisation,
// before any thread exists and before any GEMM, so setting the variable for the call is safe.
#include "kernels/cpu/blas_core.hpp"

#include <cblas.h>
#include <strings.h>

#include <cstdlib>
#include <string>

extern "C" {
void gotoblas_dynamic_init(void) __attribute__((weak));
void gotoblas_dynamic_quit(void) __attribute__((weak));
}

namespace troupe::kernels::cpu {
namespace {

bool chose_kernels = false;

void choose_blas_kernels() {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  const char* want = blas_core_for_cpu();
  if (!want || !gotoblas_dynamic_init || !gotoblas_dynamic_quit) return;
  const char* now = openblas_get_corename();
  if (now && strcasecmp(now, want) == 0) return;
  setenv("OPENBLAS_CORETYPE", want, 1);
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
  unsetenv("OPENBLAS_CORETYPE");
  chose_kernels = true;
}

[[maybe_unused]] const bool chosen_at_start = (choose_blas_kernels(), true);

}  // namespace

const char* blas_core_for_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
  return nullptr;
}

std::string blas_core() {
  const char* name = openblas_get_corename();
  std::string s = name ? name : "unknown";
  if (std::getenv("OPENBLAS_CORETYPE")) s += " (OPENBLAS_CORETYPE)";
  return s;
}

bool blas_core_chosen() { return chose_kernels; }

}  // namespace troupe::kernels::cpu
