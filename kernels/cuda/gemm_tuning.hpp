// Measured GEMM algorithm choices, kept in a file across runs (runtime.gemm_tune_file).
//
// cuBLASLt's heuristic picks a good algorithm, not the fastest: at GPT-2's shapes on the H200 the
// fastest of its top eight candidates was up to 22% faster than its first (bench/
// gpu_gemm_bench). Timing candidates at run time would make the choice, and so the bits of every
// result, depend on timing noise. Instead each choice is measured once and written to a file; every
// later plan of the same GEMM on the same GPU and cuBLASLt version, in this process or another one
// (the workers of a launch, a replay), reads it back. Results are then as reproducible as with the
// heuristic, provided the runs share the file. The file is plain text, one line per GEMM: the key
// (GPU, cuBLASLt version, shape, layouts, dtypes, epilogue, alignments), the algorithm's 64 bytes
// in hex, the measured milliseconds. Appends happen under an exclusive flock of `path + ".lock"`,
// held while tuning, so two processes never tune the same GEMM differently.
#pragma once

#include <cublasLt.h>

#include <functional>
#include <optional>
#include <string>

namespace troupe::kernels::cuda::gemm_tuning {

/// Names the tuning file of this process (runtime.gemm_tune_file, set before the first GEMM
/// plan; kernels::set_gemm_tune_file); empty turns tuning off (the default).
void set_file_path(const std::string& path);
/// The tuning file (read at each plan: plans are made rarely); empty when tuning is off.
std::string file_path();

/// A measured candidate: the algorithm and its time.
struct choice {
  cublasLtMatmulAlgo_t algo;
  double ms;
};

/// "id .. tile .. stages .. splitK .. red .. swz .. custom .. cluster .." of an algorithm (its
/// configuration attributes; -1 where cuBLASLt reports none), for logs and the GEMM survey.
std::string describe(const cublasLtMatmulAlgo_t& algo);

/// The algorithm recorded for `key`, else the one `tune()` measures (then appended to the file);
/// nullopt when tuning is off.
/// `tune` runs with the file locked; it returns nothing when no candidate ran, and then nothing is
/// recorded and nullopt returned. Throws core::failure when the file cannot be read or written.
std::optional<cublasLtMatmulAlgo_t> lookup_or_tune(const std::string& key,
                                                    const std::function<std::optional<choice>()>& tune);

}  // namespace troupe::kernels::cuda::gemm_tuning
