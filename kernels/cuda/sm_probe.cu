// cuda_backend::sms_reached: where a backend's kernels run. Each block of the probe writes the id
// of the SM it ran on; the blocks spin a little so that they spread over every SM the stream may
// use.
#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

namespace {

__global__ void sm_probe_kernel(int* out) {
  if (threadIdx.x != 0) return;
  unsigned id = 0;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  __nanosleep(20000);
  out[blockIdx.x] = static_cast<int>(id);
}

}  // namespace

std::vector<int> cuda_backend::sms_reached(int blocks) {
  activate();
  TROUPE_CHECK(blocks > 0, "sms_reached: blocks must be positive");
  scratch ids(*ctx_, sizeof(int) * static_cast<std::size_t>(blocks));
  sm_probe_kernel<<<blocks, 32, 0, ctx_->stream>>>(ids.as<int>());
  TROUPE_CUDA_CHECK(cudaGetLastError());
  std::vector<int> out(static_cast<std::size_t>(blocks));
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(out.data(), ids.as<int>(), out.size() * sizeof(int),
                                    cudaMemcpyDeviceToHost, ctx_->stream));
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace troupe::kernels::cuda
