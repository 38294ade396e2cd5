// What every launcher needs besides its tensors: the backend's stream, its cuBLASLt handle and
// workspace, the caching allocator for scratch buffers, and a cache of chosen GEMM algorithms
// (asking cuBLASLt's heuristic costs microseconds per call; a training step repeats the same
// dozen shapes). One context per backend instance; several may share a GPU.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kernels/cuda/attention_sm90.hpp"
#include "kernels/cuda/cuda_allocator.hpp"
#include "kernels/cuda/cuda_handoff.hpp"

namespace troupe::kernels::cuda {

/// Everything that identifies a GEMM plan (dims, layouts, dtypes, epilogue, beta != 0).
struct gemm_key {
  std::array<std::int64_t, 12> v{};
  bool operator<(const gemm_key& o) const { return v < o.v; }
};

/// Descriptors and the heuristic's algorithm for one gemm_key (linear.cu builds them).
struct gemm_plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

/// A page-locked host buffer for small host-to-device copies, reusable once `done` has completed.
struct pinned_buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  cudaEvent_t done = nullptr;  // recorded after the copy that reads it
};

struct context {
  explicit context(int device);
  ~context();
  context(const context&) = delete;
  context& operator=(const context&) = delete;

  int device = 0;
  int sm_count = 0;
  /// Attention runs on the Hopper kernels (attention_sm90.hpp): the build carries them, the device
  /// is of compute capability 9.0, and TROUPE_CUDA_ATTENTION is not "mma" (docs/cuda.md).
  bool hopper_attention = false;
  /// How the Hopper forward loads its tiles (TROUPE_CUDA_ATTENTION "tma", "cp-async", or by shape).
  tile_loads hopper_forward_loads = tile_loads::by_shape;
  std::shared_ptr<stream_handle> stream_owner;  // shared with hand-off states (cuda_handoff.hpp)
  cudaStream_t stream = nullptr;                // stream_owner->stream
  cudaStream_t clock_stream = nullptr;          // idle: anchors time marks (mark_times)
  std::shared_ptr<event_pool> marks;  // timing events of time marks (shared: marks may outlive it)
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::shared_ptr<device_allocator> alloc;
  std::map<gemm_key, gemm_plan> gemm_plans;
  std::vector<pinned_buffer> staging;  // host-to-device copies (cuda_backend::copy)
  cudaGraphExec_t graph = nullptr;     // the recorded step (cuda_backend::graph_begin)
  bool capturing = false;
  std::uint64_t graph_id = 0;          // of `graph` (or of the recording under way)
  std::uint64_t graphs_begun = 0;

  /// A staging buffer of at least `bytes` whose previous copy has completed (a new one if none).
  pinned_buffer& staging_buffer(std::size_t bytes);
};

/// A scratch buffer from the context's allocator, returned to the cache when it goes out of scope.
/// Safe without synchronising: the block is reused only by later work on the same stream.
class scratch {
 public:
  scratch(context& ctx, std::size_t bytes) : alloc_(ctx.alloc.get()), p_(alloc_->allocate(bytes)) {}
  ~scratch() { alloc_->release(p_); }
  scratch(const scratch&) = delete;
  scratch& operator=(const scratch&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p_); }

 private:
  device_allocator* alloc_;
  void* p_;
};

/// Queues on ctx.stream the first level of the message hash of in[0, n) (kernels/message_hash.hpp):
/// out[i] = XXH3-64(block i, seed 0) for the message_hash_blocks_of(n) blocks
/// (kernels/cuda/message_hash.cu).
void launch_message_hash_blocks(context& ctx, const void* in, std::uint64_t n, std::uint64_t* out);

}  // namespace troupe::kernels::cuda
