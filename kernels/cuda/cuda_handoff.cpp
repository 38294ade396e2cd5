#include "kernels/cuda/cuda_handoff.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda {

namespace {

// storage::sync is a plain shared_ptr: creating it and reading it are serialised here. The hand-off
// itself (transport, CAF) orders the sender's record_ready before the receiver's wait_ready.
std::mutex& sync_mutex() {
  static std::mutex mu;
  return mu;
}

handoff_state* state_of(const core::tensor& t, bool create) {
  core::storage* st = t.store().get();
  if (!st) return nullptr;
  std::lock_guard<std::mutex> lock(sync_mutex());
  if (!st->sync && create) st->sync = std::make_shared<handoff_state>();
  return static_cast<handoff_state*>(st->sync.get());
}

// TROUPE_CUDA_DEBUG_SYNC, a diagnostic (docs/cuda.md): "send" makes the host wait for the
// sender's stream at every record_ready, "recv" for the event at every wait_ready, "handoff" both.
bool debug_sync(const char* what) {
  static const std::string mode = [] {
    const char* m = std::getenv("TROUPE_CUDA_DEBUG_SYNC");
    return std::string(m ? m : "");
  }();
  return !mode.empty() && mode.find(what) != std::string::npos;
}

// TROUPE_CUDA_DEBUG_SYNC containing "origin": release events on the owner's stream too
// (diagnostic).
bool debug_owner_event() { return debug_sync("origin"); }

void add_user(handoff_state& h, const std::shared_ptr<stream_handle>& s) {
  if (std::find(h.users.begin(), h.users.end(), s) == h.users.end()) h.users.push_back(s);
}

}  // namespace

stream_handle::stream_handle(int dev) : device(dev) {
  TROUPE_CUDA_CHECK(cudaSetDevice(device));
  TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
}

stream_handle::stream_handle(int dev, cudaStream_t adopted) : stream(adopted), device(dev) {}

stream_handle::~stream_handle() {
  // Teardown must not throw; errors here (driver already unloaded at exit) lose nothing.
  int current = 0;
  cudaGetDevice(&current);
  if (current != device) cudaSetDevice(device);
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  if (current != device) cudaSetDevice(current);
}

handoff_state::~handoff_state() {
  if (ready) cudaEventDestroy(ready);  // released by the driver once it has completed
}

static void check_live(const char* what, const core::tensor& t) {
  if (!debug_block_live(t.raw(), nullptr))
    std::fprintf(stderr, "troupe cuda debug: %s of a tensor %s at %p whose block is not live\n",
                 what, core::shape_string(t.shape()).c_str(), t.raw());
}

void record_ready(const std::shared_ptr<stream_handle>& s, const core::tensor& t) {
  if (!t.defined() || t.dev().is_cpu()) return;
  check_live("record_ready", t);
  handoff_state* h = state_of(t, true);
  std::lock_guard<std::mutex> lock(h->mu);
  if (!h->ready) TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&h->ready, cudaEventDisableTiming));
  TROUPE_CUDA_CHECK(cudaEventRecord(h->ready, s->stream));
  add_user(*h, s);
  if (debug_sync("handoff") || debug_sync("send")) TROUPE_CUDA_CHECK(cudaStreamSynchronize(s->stream));
}

void wait_ready(const std::shared_ptr<stream_handle>& s, const core::tensor& t) {
  if (!t.defined() || t.dev().is_cpu()) return;
  check_live("wait_ready", t);
  handoff_state* h = state_of(t, false);
  if (!h) return;  // never handed over: it was made on this stream
  std::lock_guard<std::mutex> lock(h->mu);
  if (h->ready) {
    if (debug_sync("handoff") || debug_sync("recv")) TROUPE_CUDA_CHECK(cudaEventSynchronize(h->ready));
    if (t.dev().index == s->device) {
      TROUPE_CUDA_CHECK(cudaStreamWaitEvent(s->stream, h->ready, 0));
    } else {
      // An event cannot order streams of two GPUs: the host waits (a multi-GPU job moves tensors
      // over the NCCL transport instead).
      TROUPE_CUDA_CHECK(cudaEventSynchronize(h->ready));
    }
  }
  add_user(*h, s);
}

void release_block(device_allocator& alloc, cudaStream_t own, void* p,
                   const std::shared_ptr<void>& sync) {
  auto* h = static_cast<handoff_state*>(sync.get());
  if (!h) {
    alloc.release(p);
    return;
  }
  // Called from a storage's destructor: nothing may throw. When an event cannot be had (driver torn
  // down at exit), the block stays out of reuse, the safe side.
  try {
    std::vector<cudaEvent_t> after;
    {
      std::lock_guard<std::mutex> lock(h->mu);
      for (const auto& u : h->users) {
        // The owner's own reuse is stream-ordered.
        if (u->stream == own && !debug_owner_event()) continue;
        cudaEvent_t e = alloc.take_event();
        if (cudaEventRecord(e, u->stream) != cudaSuccess) {
          cudaGetLastError();
          alloc.recycle_event(e);
          for (cudaEvent_t x : after) alloc.recycle_event(x);
          return;
        }
        after.push_back(e);
      }
    }
    if (after.empty())
      alloc.release(p);
    else
      alloc.release_after(p, std::move(after));
  } catch (...) {
  }
}

}  // namespace troupe::kernels::cuda
