// A caching device allocator, one per backend (and so per stream). Training allocates the same
// shapes every step, so freed blocks are kept in per-size free lists and handed out again instead
// of calling cudaMalloc/cudaFree (each of which synchronises the device). Sizes are rounded to
// classes (512 B up to 1 MiB, then 2 MiB) and a block is reused only for its own class: no
// splitting, so no fragmentation bookkeeping, at the cost of at most 2 MiB of slack per tensor.
// When cudaMalloc fails, the cached blocks are freed and the allocation retried once.
//
// Blocks are reused in stream order: a block released while kernels that use it are still queued
// on this backend's stream can be handed to the next allocation at once, because that allocation's
// kernels run on the same stream after them. A block that other streams used too (a tensor handed to
// another backend, cuda_handoff.hpp) is released with events recorded on those streams: it waits in
// a pending list and joins the free list once they have all completed (polled). When an allocation
// finds no free block of its class but a pending one, it takes that block and makes this backend's
// stream wait (on the device, cudaStreamWaitEvent) for the events first, so its next user cannot
// overwrite bytes another stream still reads, and the host never waits. Without that, a stage
// whose neighbours' streams lag behind the host would take new blocks for every hand-off still
// in flight, and hold more than the tensors it keeps (docs/plan.md measured 3–5 activations).
//
// CUDA graphs (cuda_backend::graph_begin): a captured step's kernels keep the addresses they were
// captured with and run again on every replay, while the host allocates nothing. So while a
// capture is open every block released goes to a private list of the graph, which serves the
// capture's own allocations, and every block allocated then belongs to the graph; a graph block
// released later (a tensor the capture made outlives it) goes back to that list too. Nothing else
// is ever handed a graph's block until graph_release(): evaluation or checkpointing between
// replays cannot overwrite what the replayed step reads. Graph blocks count as in use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

struct CUevent_st;
struct CUstream_st;

namespace troupe::kernels::cuda {

/// Counters of one allocator; bytes are rounded block sizes.
struct memory_stats {
  std::size_t in_use = 0;         // bytes held by live tensors and scratch (a block released
                                  // while another stream may still read it is cached, not in use)
  std::size_t peak_in_use = 0;    // high-water mark of in_use since the last reset_peak()
  std::size_t reserved = 0;       // bytes obtained from cudaMalloc and not yet returned
  std::size_t peak_reserved = 0;  // high-water mark of reserved since the last reset_peak()
  std::uint64_t device_mallocs = 0;  // cudaMalloc calls so far
  std::uint64_t device_frees = 0;    // cudaFree calls so far
};

/// Queues a kernel on `s` that spins for about `ns` nanoseconds (TROUPE_CUDA_DEBUG_JITTER).
void debug_spin(CUstream_st* s, unsigned ns);

/// Under TROUPE_CUDA_DEBUG_POISON: whether p lies in a block some allocator holds live (its size in
/// *size); always true otherwise.
bool debug_block_live(const void* p, std::size_t* size);

/// Idle CUDA events of one device and one kind (`flags`: cudaEventDisableTiming for hand-offs,
/// cudaEventDefault for time marks), kept for reuse: creating and destroying an event costs
/// microseconds, and hand-offs and time marks take one per tensor or instruction. Thread-safe.
class event_pool {
 public:
  event_pool(int device, unsigned flags) : device_(device), flags_(flags) {}
  ~event_pool();
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;
  /// An idle event, or a new one on the pool's device.
  CUevent_st* take();
  /// Back to the pool; its last record may still be pending (a later record replaces it).
  void give(CUevent_st* e);

 private:
  int device_;
  unsigned flags_;
  std::mutex mu_;
  std::vector<CUevent_st*> free_;
};

class device_allocator {
 public:
  explicit device_allocator(int device);
  ~device_allocator();
  device_allocator(const device_allocator&) = delete;
  device_allocator& operator=(const device_allocator&) = delete;

  /// A block of at least `bytes` bytes (never null; 256-byte aligned). Throws core::failure when
  /// the device is out of memory even after the cache was emptied.
  void* allocate(std::size_t bytes);
  /// Returns a block to the cache. Thread-safe (tensors may die on any actor thread).
  void release(void* p);
  /// Returns a block to the cache once every event in `after` has completed (events recorded on
  /// the other streams that used it). Takes the events: they go back to the pool. Thread-safe.
  void release_after(void* p, std::vector<CUevent_st*> after);
  /// An event (no timing) from this allocator's pool; give it back with release_after or
  /// recycle_event.
  CUevent_st* take_event();
  void recycle_event(CUevent_st* e);
  /// Frees every cached (unused) block back to the device.
  void empty_cache();
  memory_stats stats() const;
  /// Restarts the peaks at the current values (e.g. after warm-up steps).
  void reset_peak();

  /// Opens a capture: blocks released from now on, and blocks allocated, belong to the graph.
  void graph_begin();
  /// Closes the capture; the graph's blocks stay reserved for its replays.
  void graph_end();
  /// The graph is gone: its free blocks rejoin the cache, its live ones are ordinary again.
  void graph_release();

  /// The stream of the backend this allocator serves (TROUPE_CUDA_DEBUG_POISON fills blocks on it).
  void set_stream(CUstream_st* s) { stream_ = s; }

  /// The size class a request of `bytes` is served from.
  static std::size_t round_size(std::size_t bytes);

 private:
  void free_cached_locked();
  void collect_pending_locked();
  /// A pending block of class `size`, its events waited for on stream_; null when none.
  void* take_pending_locked(std::size_t size);
  void poison_locked(void* p, std::size_t size);

  struct pending_block {
    void* p;
    std::size_t size;
    std::vector<CUevent_st*> after;
  };

  int device_;
  CUstream_st* stream_ = nullptr;
  std::uint64_t jitter_;  // TROUPE_CUDA_DEBUG_JITTER's random state
  mutable std::mutex mu_;
  std::unordered_map<void*, std::size_t> live_;            // block -> class size
  std::multimap<std::size_t, void*> free_;                 // class size -> cached blocks
  std::vector<pending_block> pending_;                     // released, other streams not done
  event_pool events_;                                      // idle events (no timing)
  bool capturing_ = false;
  std::unordered_map<void*, std::size_t> graph_owned_;     // blocks of the graph, live or free
  std::multimap<std::size_t, void*> graph_free_;           // the graph's released blocks
  memory_stats stats_;
};

}  // namespace troupe::kernels::cuda
