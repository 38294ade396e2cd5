// Dispatch of kernels/offload.hpp: the CUDA backend's versions live in kernels/cuda/offload.cpp;
// every other backend finishes its copies before returning.
#include "kernels/offload.hpp"

#ifdef TROUPE_HAVE_CUDA
#include "kernels/cuda/offload.hpp"
#endif

namespace troupe::kernels {

namespace {
class passed_fence final : public host_fence {
 public:
  void wait() override {}
};
}  // namespace

tensor pinned_host(backend& be, backend& host, const core::shape_t& shape, core::dtype t) {
#ifdef TROUPE_HAVE_CUDA
  if (tensor p = cuda::pinned_host(be, shape, t); p.defined()) return p;
#else
  (void)be;
#endif
  tensor x = host.empty(shape, t);
  return x;
}

void copy_to_host_async(backend& be, const tensor& src, tensor& dst) {
#ifdef TROUPE_HAVE_CUDA
  if (cuda::copy_to_host_async(be, src, dst)) return;
#endif
  be.copy(src, dst);
}

void copy_to_device_async(backend& be, const tensor& src, tensor& dst) {
#ifdef TROUPE_HAVE_CUDA
  if (cuda::copy_to_device_async(be, src, dst)) return;
#endif
  be.copy(src, dst);
}

std::unique_ptr<host_fence> make_fence(backend& be) {
#ifdef TROUPE_HAVE_CUDA
  if (auto f = cuda::make_fence(be)) return f;
#else
  (void)be;
#endif
  return std::make_unique<passed_fence>();
}

}  // namespace troupe::kernels
