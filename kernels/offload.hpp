// Host memory for optimizer offload (optimizer.offload, actors/shard_engine.hpp): page-locked
// buffers, copies between them and the device queued on a backend's stream without the host
// waiting, and fences the host waits on before it reads what such a copy wrote.
//
// Contract: a buffer from pinned_host is a host tensor (dev() is the CPU) that any backend's copy
// and the CPU backend's ops accept. copy_to_host_async returns at once on the CUDA backend; dst must
// not be read, and neither src nor dst freed or rewritten, before a fence made after it was waited
// for. On the CPU backend (and any backend that is not CUDA, e.g. the planner's meta backend) the
// same calls are plain host copies that finish before returning, so the offload code path runs and
// is tested without a GPU.
#pragma once

#include <memory>

#include "kernels/backend.hpp"

namespace troupe::kernels {

/// A host tensor for `be`'s asynchronous copies: page-locked on CUDA (zero-filled), otherwise
/// `host.empty(shape, t)`: the CPU backend (or, in a dry run, a meta backend claiming the CPU) that
/// holds the host-side state.
tensor pinned_host(backend& be, backend& host, const core::shape_t& shape, core::dtype t);

/// Queues dst (host) = src (be's device or the host) on be's stream and returns; see the contract.
void copy_to_host_async(backend& be, const tensor& src, tensor& dst);

/// Queues dst (be's device) = src (host) on be's stream and returns; src must not be rewritten or
/// freed before a fence made after it was waited for (nor before later work of be's stream ran:
/// the stream runs its work in order). On other backends a plain copy.
void copy_to_device_async(backend& be, const tensor& src, tensor& dst);

/// A point in a backend's queued work.
class host_fence {
 public:
  virtual ~host_fence() = default;
  /// Blocks until the work the backend had queued when the fence was made has run.
  virtual void wait() = 0;
};

/// A fence after everything `be` has queued so far (already passed on the CPU).
std::unique_ptr<host_fence> make_fence(backend& be);

}  // namespace troupe::kernels
