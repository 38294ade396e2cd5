#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda {

void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  std::string hint;
  if (e == cudaErrorMemoryAllocation)
    hint = " (hint: the GPU is out of memory; lower micro_batch_size, turn recompute on, or use "
           "more pipeline stages)";
  else if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
    hint = " (hint: no usable GPU/driver; run with runtime.device = \"cpu\")";
  else if (e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure)
    hint = " (hint: a kernel faulted; the context is unusable now; rerun under compute-sanitizer)";
  throw core::failure(std::string(file) + ":" + std::to_string(line) + ": CUDA error " +
                      cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") in " + call + hint);
}

void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line) {
  std::string hint;
  if (s == CUBLAS_STATUS_NOT_SUPPORTED)
    hint = " (hint: this combination of dtypes/layouts has no cuBLASLt kernel)";
  else if (s == CUBLAS_STATUS_ALLOC_FAILED)
    hint = " (hint: the GPU is out of memory)";
  throw core::failure(std::string(file) + ":" + std::to_string(line) + ": cuBLAS error " +
                      cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ") in " + call +
                      hint);
}

}  // namespace troupe::kernels::cuda
