// Choosing a backend by device name, and the CPU backend's thread count: the one place that knows
// every backend implementation, so the interface in kernels/backend.hpp knows none.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/backend.hpp"

namespace troupe::kernels {

/// A share of one GPU's SMs: share `index` of `count` disjoint groups (runtime.split_gpu); the
/// default is the whole GPU.
struct gpu_share {
  int index = 0;
  int count = 1;
};

/// "cpu" or "cuda[:i]". Throws core::failure when the device is not available in this build or
/// on this machine (the message says which), or when `share` splits the CPU or cannot be made.
std::unique_ptr<backend> make_backend(const std::string& device, gpu_share share = {});
/// True when this build has the CUDA backend and a GPU is visible.
bool cuda_available();
/// Total bytes of the device `device` names ("cuda[:i]"); 0 for the CPU or when unknown.
std::uint64_t device_memory_bytes(const std::string& device);

/// Sets the threads a CPU op may use, the caller included (0 = all cores, the default); results do
/// not depend on it (docs/kernels.md, "Determinism").
void set_cpu_threads(int n);

/// Names the file of measured GEMM algorithms of this process (runtime.gemm_tune_file; the CUDA
/// backend's, kernels/cuda/gemm_tuning.hpp); empty (the default) uses cuBLASLt's first choice.
/// Throws core::failure for a non-empty path in a build without the CUDA backend.
void set_gemm_tune_file(const std::string& path);

}  // namespace troupe::kernels
