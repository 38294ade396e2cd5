// Page-locked host buffers, copies each way on the backend's stream and event fences for
// optimizer offload (kernels/offload.hpp). Page-locked memory is what lets cudaMemcpyAsync return
// before the copy ran (a pageable destination makes the driver stage through its own buffers and
// wait), and copies at the bus's full rate.
#include "kernels/cuda/offload.hpp"

#include <cuda_runtime.h>

#include <cstring>

#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda {

namespace {

cuda_backend* as_cuda(backend& be) { return dynamic_cast<cuda_backend*>(&be); }

/// Makes be's device current (events and copies go to its stream).
void use_device(backend& be) { TROUPE_CUDA_CHECK(cudaSetDevice(be.dev().index)); }

bool page_locked(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

class event_fence final : public host_fence {
 public:
  explicit event_fence(cudaStream_t s) {
    TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    TROUPE_CUDA_CHECK(cudaEventRecord(ev_, s));
  }
  ~event_fence() override { cudaEventDestroy(ev_); }
  void wait() override { TROUPE_CUDA_CHECK(cudaEventSynchronize(ev_)); }

 private:
  cudaEvent_t ev_ = nullptr;
};

}  // namespace

tensor pinned_host(backend& be, const core::shape_t& shape, core::dtype t) {
  if (!as_cuda(be)) return {};
  auto st = std::make_shared<core::storage>();
  st->bytes = static_cast<std::size_t>(core::numel_of(shape)) * core::dtype_size(t);
  st->dev = core::device{};
  if (st->bytes > 0) {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, st->bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw core::failure("optimizer offload: cudaHostAlloc of " + std::to_string(st->bytes) +
                          " bytes of page-locked host memory failed (" + cudaGetErrorString(e) +
                          "); hint: `troupe plan CONFIG` shows the host memory offload needs; "
                          "raise optimizer.zero_stage or set optimizer.offload = false");
    }
    std::memset(p, 0, st->bytes);
    st->data = p;
    st->release = [](void* q) { cudaFreeHost(q); };
  }
  return tensor::over(std::move(st), 0, shape, t);
}

bool copy_to_host_async(backend& be, const tensor& src, tensor& dst) {
  cuda_backend* c = as_cuda(be);
  if (!c) return false;
  if (src.bytes() != dst.bytes())
    throw core::failure("cuda copy_to_host_async: " + std::to_string(src.bytes()) + " bytes into " +
                        std::to_string(dst.bytes()));
  if (src.bytes() == 0) return true;
  use_device(be);
  if (src.dev().is_cpu() || !dst.dev().is_cpu() || !page_locked(dst.raw())) {
    be.copy(src, dst);  // nothing to overlap (or pageable memory): the ordinary copy
    return true;
  }
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(), cudaMemcpyDeviceToHost,
                                    c->stream()));
  return true;
}

bool copy_to_device_async(backend& be, const tensor& src, tensor& dst) {
  cuda_backend* c = as_cuda(be);
  if (!c) return false;
  if (src.bytes() != dst.bytes())
    throw core::failure("cuda copy_to_device_async: " + std::to_string(src.bytes()) +
                        " bytes into " + std::to_string(dst.bytes()));
  if (src.bytes() == 0) return true;
  use_device(be);
  if (!src.dev().is_cpu() || dst.dev().is_cpu() || !page_locked(src.raw())) {
    be.copy(src, dst);  // nothing to overlap (or pageable memory): the ordinary copy
    return true;
  }
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(), cudaMemcpyHostToDevice,
                                    c->stream()));
  return true;
}

std::unique_ptr<host_fence> make_fence(backend& be) {
  cuda_backend* c = as_cuda(be);
  if (!c) return nullptr;
  use_device(be);
  return std::make_unique<event_fence>(c->stream());
}

}  // namespace troupe::kernels::cuda
