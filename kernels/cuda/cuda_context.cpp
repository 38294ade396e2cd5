#include "kernels/cuda/cuda_context.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda {

namespace {
#if defined(TROUPE_CUDA_SM90A)
constexpr bool hopper_kernels_built = true;
#else
constexpr bool hopper_kernels_built = false;
#endif

/// TROUPE_CUDA_ATTENTION: "auto" (unset: the Hopper kernels where they run, the forward's tiles
/// loaded as the shape runs fastest), "tma" or "cp-async" (the Hopper kernels, the forward's tiles
/// loaded that way at every shape), or "mma" (the mma.sync kernels everywhere, to compare).
/// Anything else is refused.
std::string attention_kernels_mode() {
  const char* m = std::getenv("TROUPE_CUDA_ATTENTION");
  const std::string v = m && *m ? m : "auto";
  if (v != "auto" && v != "mma" && v != "tma" && v != "cp-async")
    throw core::failure("TROUPE_CUDA_ATTENTION=" + v +
                        " is not a choice: \"auto\" (the default), \"tma\", \"cp-async\" or "
                        "\"mma\" (docs/cuda.md)");
  return v;
}

// cuBLASLt's Hopper kernels want a large workspace (NVIDIA recommends 32 MiB on sm_90).
constexpr std::size_t gemm_workspace_bytes = std::size_t{32} << 20;
}  // namespace

context::context(int dev) : device(dev) {
  TROUPE_CUDA_CHECK(cudaSetDevice(device));
  TROUPE_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  int major = 0, minor = 0;
  TROUPE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TROUPE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const std::string mode = attention_kernels_mode();
  hopper_attention = mode != "mma" && hopper_kernels_built && major == 9 && minor == 0;
  hopper_forward_loads = mode == "tma"        ? tile_loads::tma
                         : mode == "cp-async" ? tile_loads::cp_async
                                              : tile_loads::by_shape;
  stream_owner = std::make_shared<stream_handle>(device);
  stream = stream_owner->stream;
  TROUPE_CUBLAS_CHECK(cublasLtCreate(&lt));
  alloc = std::make_shared<device_allocator>(device);
  marks = std::make_shared<event_pool>(device, cudaEventDefault);
  alloc->set_stream(stream);
  workspace_bytes = gemm_workspace_bytes;
  workspace = alloc->allocate(workspace_bytes);
}

context::~context() {
  // Teardown must not throw; errors here (driver already unloaded at exit) lose nothing.
  cudaSetDevice(device);
  if (stream) cudaStreamSynchronize(stream);
  if (graph) cudaGraphExecDestroy(graph);
  if (workspace) alloc->release(workspace);
  for (auto& [key, plan] : gemm_plans) {
    cublasLtMatrixLayoutDestroy(plan.la);
    cublasLtMatrixLayoutDestroy(plan.lb);
    cublasLtMatrixLayoutDestroy(plan.lc);
    cublasLtMatmulDescDestroy(plan.desc);
  }
  for (auto& b : staging) {
    cudaEventDestroy(b.done);
    cudaFreeHost(b.p);
  }
  if (lt) cublasLtDestroy(lt);
  if (clock_stream) cudaStreamDestroy(clock_stream);
  // The stream itself goes when the last hand-off state that remembers it does (stream_handle).
}

pinned_buffer& context::staging_buffer(std::size_t bytes) {
  for (auto& b : staging) {
    if (b.bytes < bytes) continue;
    const cudaError_t e = cudaEventQuery(b.done);
    if (e == cudaSuccess) return b;
    if (e != cudaErrorNotReady) TROUPE_CUDA_CHECK(e);
    cudaGetLastError();  // "not ready" is an answer, not an error
  }
  pinned_buffer b;
  b.bytes = std::max<std::size_t>(bytes, std::size_t{64} << 10);
  TROUPE_CUDA_CHECK(cudaHostAlloc(&b.p, b.bytes, cudaHostAllocDefault));
  TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
  staging.push_back(b);
  return staging.back();
}

}  // namespace troupe::kernels::cuda
