#include "kernels/cuda/cuda_allocator.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace troupe::kernels::cuda {

namespace {
constexpr std::size_t small_granule = 512;
constexpr std::size_t small_limit = std::size_t{1} << 20;
constexpr std::size_t large_granule = std::size_t{2} << 20;

// Makes `device` current for the scope: allocations and frees must happen on the owning device even
// when a stage on another GPU shares the calling thread.
class device_guard {
 public:
  explicit device_guard(int device) {
    TROUPE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) TROUPE_CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~device_guard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int device_ = 0;
};

// TROUPE_CUDA_DEBUG_SYNC, a diagnostic (docs/cuda.md): with "release" every block goes back to the
// cache only once the whole device is idle, so no reuse can overlap a kernel of any stream; "own"
// does so only for blocks no other stream used (release), "shared" only for the others
// (release_after).
void debug_sync_release(const char* kind) {
  static const std::string mode = [] {
    const char* m = std::getenv("TROUPE_CUDA_DEBUG_SYNC");
    return std::string(m ? m : "");
  }();
  if (mode.empty()) return;
  if (mode.find("release") == std::string::npos && mode.find(kind) == std::string::npos) return;
  if (cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
}

// TROUPE_CUDA_DEBUG_POISON, a diagnostic (docs/cuda.md): "alloc" fills every block handed out, and
// "release" every block going back to the cache, with 0xFF bytes (NaN in fp32, bf16 and fp16) on
// the allocator's stream ("freed": only blocks no other stream used, "pending": only the others).
// A kernel that reads bytes it did not write, or a stream that reads a block after its release,
// then reads NaN instead of stale numbers that happen to be right.
bool debug_poison(const char* kind) {  // kind nullptr: any mode
  static const std::string mode = [] {
    const char* m = std::getenv("TROUPE_CUDA_DEBUG_POISON");
    return std::string(m ? m : "");
  }();
  return !mode.empty() && (kind == nullptr || mode.find(kind) != std::string::npos);
}

// Under TROUPE_CUDA_DEBUG_POISON every allocator also enters its live blocks here, so that a block
// handed out twice, released twice, or handed between streams after its release is reported.
struct live_registry {
  std::mutex mu;
  std::unordered_map<void*, std::size_t> blocks;
};
live_registry& registry() {
  static live_registry r;
  return r;
}
void registry_add(void* p, std::size_t size) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.blocks.emplace(p, size).second)
    std::fprintf(stderr, "troupe cuda debug: block %p (%zu bytes) handed out while live\n", p,
                 size);
}
void registry_remove(void* p, const char* how) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.blocks.erase(p) == 0)
    std::fprintf(stderr, "troupe cuda debug: %s of block %p, which is not live\n", how, p);
}

// TROUPE_CUDA_DEBUG_JITTER=US, a diagnostic (docs/cuda.md): before every block handed out, the
// allocator's stream sleeps for a random 0 to US microseconds, so streams that share a GPU progress
// at shifting speeds and a missing order between them shows in more runs.
unsigned debug_jitter_us() {
  static const unsigned us = [] {
    const char* m = std::getenv("TROUPE_CUDA_DEBUG_JITTER");
    return m ? static_cast<unsigned>(std::strtoul(m, nullptr, 10)) : 0u;
  }();
  return us;
}
}  // namespace

bool debug_block_live(const void* p, std::size_t* size) {
  if (!debug_poison(nullptr)) return true;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // p may point into a block (a view): the block is the live one at or below it.
  for (const auto& [b, n] : r.blocks)
    if (static_cast<const char*>(p) >= static_cast<const char*>(b) &&
        static_cast<const char*>(p) < static_cast<const char*>(b) + n) {
      if (size) *size = n;
      return true;
    }
  return false;
}

void device_allocator::poison_locked(void* p, std::size_t size) {
  if (!stream_) return;
  device_guard guard(device_);
  TROUPE_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, size, stream_));
}

event_pool::~event_pool() {
  for (cudaEvent_t e : free_) cudaEventDestroy(e);  // teardown: nothing to report
}

cudaEvent_t event_pool::take() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  device_guard guard(device_);
  cudaEvent_t e = nullptr;
  TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags_));
  return e;
}

void event_pool::give(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(e);
}

device_allocator::device_allocator(int device)
    : device_(device),
      jitter_(static_cast<std::uint64_t>(
                  std::chrono::steady_clock::now().time_since_epoch().count()) ^
              reinterpret_cast<std::uintptr_t>(this)),
      events_(device, cudaEventDisableTiming) {}

device_allocator::~device_allocator() {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    for (auto& b : pending_) {
      for (cudaEvent_t e : b.after) events_.give(e);
      free_.emplace(b.size, b.p);  // free_cached_locked synchronises the device first
    }
    pending_.clear();
    for (auto& [size, p] : graph_free_) free_.emplace(size, p);
    graph_free_.clear();
    free_cached_locked();
  } catch (...) {
    // Destructors must not throw; a failing cudaFree at shutdown (driver torn down) loses nothing.
  }
}

cudaEvent_t device_allocator::take_event() { return events_.take(); }

void device_allocator::recycle_event(cudaEvent_t e) { events_.give(e); }

void device_allocator::release_after(void* p, std::vector<cudaEvent_t> after) {
  debug_sync_release("shared");
  std::lock_guard<std::mutex> lock(mu_);
  if (debug_poison(nullptr)) registry_remove(p, "release_after");
  auto it = live_.find(p);
  if (it == live_.end()) return;
  // Cached from now on (no longer in use): the next allocation of its class on this allocator's
  // stream may take it once that stream waits for the events (allocate).
  stats_.in_use -= it->second;
  pending_.push_back(pending_block{p, it->second, std::move(after)});
  live_.erase(it);
}

void device_allocator::collect_pending_locked() {
  if (pending_.empty()) return;
  device_guard guard(device_);
  std::size_t keep = 0;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    pending_block& b = pending_[i];
    while (!b.after.empty()) {
      const cudaError_t e = cudaEventQuery(b.after.back());
      if (e == cudaErrorNotReady) {
        cudaGetLastError();  // "not ready" is an answer, not an error: do not leave it behind
        break;
      }
      TROUPE_CUDA_CHECK(e);
      events_.give(b.after.back());
      b.after.pop_back();
    }
    if (b.after.empty()) {
      if (debug_poison("release") || debug_poison("pending")) poison_locked(b.p, b.size);
      free_.emplace(b.size, b.p);
    } else {
      // Not onto itself: a vector moved onto itself comes out empty (libstdc++), and the block
      // would lose the events it still waits for and serve again while other streams read it.
      if (keep != i) pending_[keep] = std::move(b);
      ++keep;
    }
  }
  pending_.resize(keep);
}

void* device_allocator::take_pending_locked(std::size_t size) {
  // Not during a capture (a captured stream cannot wait for an event recorded outside it), and not
  // without a stream to order the reuse on.
  if (capturing_ || !stream_) return nullptr;
  // The earliest released block of the class: its streams are the likeliest to be past it.
  auto b = std::find_if(pending_.begin(), pending_.end(),
                        [&](const pending_block& x) { return x.size == size; });
  if (b == pending_.end()) return nullptr;
  device_guard guard(device_);
  // The new owner's kernels are queued on stream_ after these waits, so they run only once the
  // other streams have passed their last use of the block; the host does not wait. A wait takes
  // the event's latest record at the time of the call, so the events can be recorded again.
  for (cudaEvent_t e : b->after) {
    TROUPE_CUDA_CHECK(cudaStreamWaitEvent(stream_, e, 0));
    events_.give(e);
  }
  void* p = b->p;
  pending_.erase(b);
  if (debug_poison("release") || debug_poison("pending")) poison_locked(p, size);
  return p;
}

std::size_t device_allocator::round_size(std::size_t bytes) {
  if (bytes == 0) bytes = 1;
  const std::size_t g = bytes <= small_limit ? small_granule : large_granule;
  return (bytes + g - 1) / g * g;
}

void* device_allocator::allocate(std::size_t bytes) {
  const std::size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (capturing_) {
    // The graph's own released blocks first; they are already counted in use.
    auto g = graph_free_.find(size);
    if (g != graph_free_.end()) {
      void* p = g->second;
      graph_free_.erase(g);
      live_.emplace(p, size);
      return p;
    }
  } else {
    collect_pending_locked();  // polls events: not while a capture is open
  }
  void* p = nullptr;
  auto it = free_.find(size);
  if (it != free_.end()) {
    p = it->second;
    free_.erase(it);
  } else if (void* q = take_pending_locked(size)) {
    p = q;
  } else {
    device_guard guard(device_);
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the sticky-free error before retrying
      // Out of memory: wait for the blocks other streams still read, then free the whole cache.
      for (auto& b : pending_)
        for (cudaEvent_t ev : b.after) TROUPE_CUDA_CHECK(cudaEventSynchronize(ev));
      collect_pending_locked();
      free_cached_locked();
      e = cudaMalloc(&p, size);
    }
    if (e != cudaSuccess) {
      const std::string why = cudaGetErrorString(e);
      cudaGetLastError();
      if (e != cudaErrorMemoryAllocation)
        throw core::failure("cuda_allocator: cudaMalloc of " + std::to_string(size) +
                            " bytes on cuda:" + std::to_string(device_) + " failed (" + why + ")");
      // The words "out of device memory" are what the CLI looks for to print the plan.
      std::size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
      throw core::failure(
          "out of device memory on cuda:" + std::to_string(device_) + ": " +
          std::to_string(size) + " more bytes wanted; this backend holds " +
          std::to_string(stats_.in_use) + " bytes in live tensors (peak " +
          std::to_string(stats_.peak_in_use) + ", " + std::to_string(stats_.reserved) +
          " reserved after freeing its cache), the device has " + std::to_string(free_bytes) +
          " of " + std::to_string(total_bytes) +
          " bytes free (hint: `troupe plan CONFIG --device-memory SIZE` shows what each rank "
          "holds and which change fits: recompute.mode, optimizer.zero_stage, "
          "parallel.micro_batch_size, parallel.pipeline_stage)");
    }
    ++stats_.device_mallocs;
    stats_.reserved += size;
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  }
  live_.emplace(p, size);
  if (capturing_) graph_owned_.emplace(p, size);
  else if (debug_poison("alloc")) poison_locked(p, size);
  if (debug_poison(nullptr)) registry_add(p, size);
  if (!capturing_ && stream_ && debug_jitter_us() > 0) {
    jitter_ = jitter_ * 6364136223846793005ull + 1442695040888963407ull;
    debug_spin(stream_, static_cast<unsigned>((jitter_ >> 33) % (debug_jitter_us() + 1)) * 1000u);
  }
  stats_.in_use += size;
  stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
  return p;
}

void device_allocator::release(void* p) {
  debug_sync_release("own");
  std::lock_guard<std::mutex> lock(mu_);
  if (debug_poison(nullptr)) registry_remove(p, "release");
  auto it = live_.find(p);
  if (it == live_.end()) return;
  if (capturing_ || graph_owned_.count(p) != 0) {
    // The graph's (or, during the capture, possibly used by it): reserved, still counted in use.
    graph_owned_.emplace(p, it->second);
    graph_free_.emplace(it->second, p);
  } else {
    if (debug_poison("release") || debug_poison("freed")) poison_locked(p, it->second);
    stats_.in_use -= it->second;
    free_.emplace(it->second, p);
  }
  live_.erase(it);
}

void device_allocator::graph_begin() {
  std::lock_guard<std::mutex> lock(mu_);
  TROUPE_CHECK(!capturing_ && graph_owned_.empty(),
               "cuda_allocator: one graph at a time (release the previous one first)");
  capturing_ = true;
}

void device_allocator::graph_end() {
  std::lock_guard<std::mutex> lock(mu_);
  capturing_ = false;
}

void device_allocator::graph_release() {
  std::lock_guard<std::mutex> lock(mu_);
  capturing_ = false;
  for (auto& [size, p] : graph_free_) {
    stats_.in_use -= size;
    free_.emplace(size, p);
  }
  graph_free_.clear();
  graph_owned_.clear();
}

void device_allocator::free_cached_locked() {
  if (free_.empty()) return;
  device_guard guard(device_);
  // A cached block may still be read by queued kernels of this allocator's stream.
  TROUPE_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto& [size, p] : free_) {
    TROUPE_CUDA_CHECK(cudaFree(p));
    stats_.reserved -= size;
    ++stats_.device_frees;
  }
  free_.clear();
}

void device_allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  free_cached_locked();
}

memory_stats device_allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void device_allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_in_use = stats_.in_use;
  stats_.peak_reserved = stats_.reserved;
}

}  // namespace troupe::kernels::cuda
