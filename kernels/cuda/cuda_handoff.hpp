// Handing a device tensor from one backend's stream to another's on the same GPU without the host
// waiting. The sender records an event on its stream after the work that wrote the tensor
// (record_ready); the receiver's stream waits for that event (wait_ready): cudaStreamWaitEvent
// queues the dependency on the device and returns at once.
//
// The memory stays the sender's allocator's. Every stream that used it through a hand-off is
// remembered, so that when the last handle dies the block is released with an event recorded on
// each of those streams and is given out again only after they completed (cuda_allocator.hpp's
// release_after). Without that, the owner's next allocation could overwrite bytes a receiver's
// queued kernels have not read yet.
//
// The state lives in core::storage::sync (a handoff_state), created by the first record_ready;
// tensors that never leave their backend carry none and cost nothing.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/cuda/cuda_allocator.hpp"

namespace troupe::kernels::cuda {

/// A backend's stream, shared with the hand-off states that remember it, so that it outlives its
/// backend while tensors it used may still be released.
struct stream_handle {
  explicit stream_handle(int device);  // a new non-blocking stream on `device`
  stream_handle(int device, cudaStream_t adopted);  // owns `adopted` (a stream made elsewhere)
  ~stream_handle();                    // waits for it and destroys it
  stream_handle(const stream_handle&) = delete;
  stream_handle& operator=(const stream_handle&) = delete;

  cudaStream_t stream = nullptr;
  int device = 0;
};

/// Hand-off state of one allocation.
struct handoff_state {
  ~handoff_state();
  std::mutex mu;
  cudaEvent_t ready = nullptr;                        // recorded by the latest record_ready
  std::vector<std::shared_ptr<stream_handle>> users;  // streams that wrote or read it
};

/// Marks t's bytes ready once the work queued on `s` so far has run.
void record_ready(const std::shared_ptr<stream_handle>& s, const core::tensor& t);
/// Makes `s` wait (on the device) for the latest record_ready of t, and remembers `s` as a user.
void wait_ready(const std::shared_ptr<stream_handle>& s, const core::tensor& t);
/// The release function of a block of `alloc` whose owner stream is `own`: at once when no other
/// stream used it, else after events on those streams.
void release_block(device_allocator& alloc, cudaStream_t own, void* p,
                   const std::shared_ptr<void>& sync);

}  // namespace troupe::kernels::cuda
