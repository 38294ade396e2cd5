// Checking macros for CUDA runtime and cuBLAS(Lt) calls. A failed call throws core::failure with
// file:line, the call's text, the library's own error name and a hint, so that the actor runtime can
// report which rank and instruction hit it (kernels never exit the process).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "core/error.hpp"

namespace troupe::kernels::cuda {

/// Throws core::failure naming the CUDA error; called by TROUPE_CUDA_CHECK.
[[noreturn]] void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line);
/// Throws core::failure naming the cuBLAS status; called by TROUPE_CUBLAS_CHECK.
[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line);

}  // namespace troupe::kernels::cuda

#define TROUPE_CUDA_CHECK(call)                                                             \
  do {                                                                                      \
    cudaError_t troupe_e_ = (call);                                                         \
    if (troupe_e_ != cudaSuccess)                                                           \
      ::troupe::kernels::cuda::throw_cuda_error(troupe_e_, #call, __FILE__, __LINE__);      \
  } while (0)

#define TROUPE_CUBLAS_CHECK(call)                                                           \
  do {                                                                                      \
    cublasStatus_t troupe_s_ = (call);                                                      \
    if (troupe_s_ != CUBLAS_STATUS_SUCCESS)                                                 \
      ::troupe::kernels::cuda::throw_cublas_error(troupe_s_, #call, __FILE__, __LINE__);    \
  } while (0)

/// After a kernel launch: catches bad launch configurations at the launch site.
#define TROUPE_CUDA_CHECK_LAUNCH() TROUPE_CUDA_CHECK(cudaGetLastError())
