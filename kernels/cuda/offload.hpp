// The CUDA backend's side of kernels/offload.hpp. Each function returns an undefined tensor, false
// or null when `be` is not a CUDA backend, so the caller falls back to host copies.
#pragma once

#include <memory>

#include "kernels/offload.hpp"

namespace troupe::kernels::cuda {

tensor pinned_host(backend& be, const core::shape_t& shape, core::dtype t);
bool copy_to_host_async(backend& be, const tensor& src, tensor& dst);
bool copy_to_device_async(backend& be, const tensor& src, tensor& dst);
std::unique_ptr<host_fence> make_fence(backend& be);

}  // namespace troupe::kernels::cuda
