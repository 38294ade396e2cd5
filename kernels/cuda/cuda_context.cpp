#include "kernels/cuda/cuda_context.hpp"

#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda {

namespace {
// cuBLASLt's Hopper kernels want a large workspace (NVIDIA recommends 32 MiB on sm_90).
constexpr std::size_t gemm_workspace_bytes = std::size_t{32} << 20;
}  // namespace

context::context(int dev) : device(dev) {
  TROUPE_CUDA_CHECK(cudaSetDevice(device));
  TROUPE_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  TROUPE_CUBLAS_CHECK(cublasLtCreate(&lt));
  alloc = std::make_shared<device_allocator>(device);
  workspace_bytes = gemm_workspace_bytes;
  workspace = alloc->allocate(workspace_bytes);
}

context::~context() {
  // Teardown must not throw; errors here (driver already unloaded at exit) lose nothing.
  cudaSetDevice(device);
  if (stream) cudaStreamSynchronize(stream);
  if (workspace) alloc->release(workspace);
  for (auto& [key, plan] : gemm_plans) {
    cublasLtMatrixLayoutDestroy(plan.la);
    cublasLtMatrixLayoutDestroy(plan.lb);
    cublasLtMatrixLayoutDestroy(plan.lc);
    cublasLtMatmulDescDestroy(plan.desc);
  }
  if (lt) cublasLtDestroy(lt);
  if (stream) cudaStreamDestroy(stream);
}

}  // namespace troupe::kernels::cuda
