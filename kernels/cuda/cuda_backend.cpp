// The CUDA backend's memory primitives (empty, zero, copy), graphs and stream hand-offs; each op
// is a member defined in its own file (kernels/cuda/<op>.cu).
#include "kernels/cuda/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <cstring>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/sm_partition.hpp"

namespace troupe::kernels {

std::unique_ptr<backend> make_cuda_backend(int device_index, int share_index, int share_count) {
  return std::make_unique<cuda::cuda_backend>(device_index, share_index, share_count);
}

bool cuda_device_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::uint64_t cuda_device_memory(int device_index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return prop.totalGlobalMem;
}

namespace cuda {

namespace {
// Host-to-device copies up to this size are staged through page-locked memory without a wait.
constexpr std::size_t staged_copy_limit = std::size_t{1} << 20;
// Device-to-host copies up to this size are read back through page-locked memory: a pageable
// copy goes through the driver's bounce buffers. Measured on the H200 (gpu_gpt2_bench --phases,
// 124M): the step's norm phase (its kernels plus the readback of 1.2 MB of norm blocks) took
// 1.58 ms with a pageable readback and ~1.1 ms through pinned memory.
constexpr std::size_t staged_readback_limit = std::size_t{16} << 20;
}  // namespace

cuda_backend::cuda_backend(int device_index, int share_index, int share_count) {
  int n = 0;
  TROUPE_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (device_index < 0 || device_index >= n)
    throw core::failure("cuda backend: device cuda:" + std::to_string(device_index) +
                        " does not exist (" + std::to_string(n) +
                        " visible; hint: check CUDA_VISIBLE_DEVICES)");
  ctx_ = std::make_unique<context>(device_index);
  if (share_count > 1) adopt_partition(*ctx_, share_index, share_count);
}

int cuda_backend::sm_count() const { return ctx_->sm_count; }

cuda_backend::~cuda_backend() = default;

void cuda_backend::activate() const {
  int current = -1;
  TROUPE_CUDA_CHECK(cudaGetDevice(&current));
  if (current != ctx_->device) TROUPE_CUDA_CHECK(cudaSetDevice(ctx_->device));
}

core::device cuda_backend::dev() const { return {core::device_kind::cuda, ctx_->device}; }

std::string cuda_backend::name() const { return "cuda:" + std::to_string(ctx_->device); }

tensor cuda_backend::empty(const core::shape_t& shape, core::dtype t) {
  activate();
  for (auto d : shape)
    if (d < 0) throw core::failure("cuda empty: negative dimension in " + core::shape_string(shape));
  auto st = std::make_shared<core::storage>();
  st->bytes = static_cast<std::size_t>(core::numel_of(shape)) * core::dtype_size(t);
  st->dev = dev();
  std::shared_ptr<device_allocator> alloc = ctx_->alloc;
  st->data = alloc->allocate(st->bytes);
  // The storage outlives nothing it holds: `owner` is read in its own destructor, before its
  // members go, to see which other streams used the block (cuda_handoff.hpp).
  const core::storage* owner = st.get();
  cudaStream_t own = ctx_->stream;
  st->release = [alloc, owner, own](void* p) { release_block(*alloc, own, p, owner->sync); };
  return tensor::over(std::move(st), 0, shape, t);
}

void cuda_backend::zero(tensor& x) {
  activate();
  if (!x.defined() || x.bytes() == 0) return;
  if (x.dev().is_cpu()) {
    std::memset(x.raw(), 0, x.bytes());
    return;
  }
  TROUPE_CUDA_CHECK(cudaMemsetAsync(x.raw(), 0, x.bytes(), ctx_->stream));
}

void cuda_backend::copy(const tensor& src, tensor& dst) {
  activate();
  if (src.bytes() != dst.bytes())
    throw core::failure("cuda copy: " + core::shape_string(src.shape()) + " " +
                        core::dtype_name(src.type()) + " (" + std::to_string(src.bytes()) +
                        " bytes) into " + core::shape_string(dst.shape()) + " " +
                        core::dtype_name(dst.type()) + " (" + std::to_string(dst.bytes()) +
                        " bytes)");
  if (src.bytes() == 0) return;
  const bool src_host = src.dev().is_cpu(), dst_host = dst.dev().is_cpu();
  if (ctx_->capturing && (src_host || dst_host))
    throw core::failure("cuda copy: a copy to or from the host cannot be recorded in a graph "
                        "(copy the inputs into device buffers before graph_begin)");
  if (src_host && dst_host) {
    std::memcpy(dst.raw(), src.raw(), src.bytes());
    return;
  }
  if (src_host && src.bytes() <= staged_copy_limit) {
    // Small uploads (a micro-batch's tokens and targets) go through a page-locked staging buffer:
    // the source is read before copy returns, as callers expect, but the stream is not waited for,
    // so a stage can queue its next micro-batch while the GPU works on the last.
    pinned_buffer& b = ctx_->staging_buffer(src.bytes());
    std::memcpy(b.p, src.raw(), src.bytes());
    TROUPE_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), b.p, src.bytes(), cudaMemcpyHostToDevice,
                                      ctx_->stream));
    TROUPE_CUDA_CHECK(cudaEventRecord(b.done, ctx_->stream));
    return;
  }
  if (dst_host && src.bytes() <= staged_readback_limit) {
    pinned_buffer& b = ctx_->staging_buffer(src.bytes());
    TROUPE_CUDA_CHECK(cudaMemcpyAsync(b.p, src.raw(), src.bytes(), cudaMemcpyDeviceToHost,
                                      ctx_->stream));
    TROUPE_CUDA_CHECK(cudaEventRecord(b.done, ctx_->stream));
    TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    std::memcpy(dst.raw(), b.p, src.bytes());
    return;
  }
  const cudaMemcpyKind kind = src_host   ? cudaMemcpyHostToDevice
                              : dst_host ? cudaMemcpyDeviceToHost
                                         : cudaMemcpyDefault;
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(), kind, ctx_->stream));
  // Host tensors are pageable: the caller may read the destination or free the source as soon as
  // copy returns, so any other copy that touches the host completes before returning.
  if (src_host || dst_host) TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
}

void cuda_backend::synchronize() {
  activate();
  if (ctx_->capturing)
    throw core::failure("cuda synchronize: cannot wait for the device while recording a graph");
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
}

std::uint64_t cuda_backend::graph_begin() {
  activate();
  graph_reset();
  // Relaxed: the allocator and cuBLASLt may make calls that are not stream work (never a
  // synchronisation: copy and synchronize refuse while recording).
  TROUPE_CUDA_CHECK(cudaStreamBeginCapture(ctx_->stream, cudaStreamCaptureModeRelaxed));
  ctx_->alloc->graph_begin();
  ctx_->capturing = true;
  ctx_->graph_id = ++ctx_->graphs_begun;
  return ctx_->graph_id;
}

void cuda_backend::graph_end() {
  activate();
  if (!ctx_->capturing) throw core::failure("cuda graph_end: no graph_begin before it");
  ctx_->capturing = false;
  ctx_->alloc->graph_end();
  cudaGraph_t g = nullptr;
  const cudaError_t e = cudaStreamEndCapture(ctx_->stream, &g);
  if (e != cudaSuccess || g == nullptr) {
    cudaGetLastError();
    ctx_->alloc->graph_release();
    throw core::failure(std::string("cuda graph_end: the recording failed (") +
                        cudaGetErrorString(e) +
                        "); hint: set runtime.cuda_graph = false to launch every op from the host");
  }
  const cudaError_t ie = cudaGraphInstantiate(&ctx_->graph, g, 0);
  cudaGraphDestroy(g);
  if (ie != cudaSuccess) {
    cudaGetLastError();
    ctx_->graph = nullptr;
    ctx_->alloc->graph_release();
    throw core::failure(std::string("cuda graph_end: cudaGraphInstantiate failed (") +
                        cudaGetErrorString(ie) + ")");
  }
}

void cuda_backend::graph_replay(std::uint64_t id) {
  activate();
  if (ctx_->graph == nullptr || ctx_->capturing || id != ctx_->graph_id)
    throw core::failure("cuda graph_replay: recording " + std::to_string(id) +
                        " is not this backend's (dropped by a later graph_begin or graph_reset)");
  TROUPE_CUDA_CHECK(cudaGraphLaunch(ctx_->graph, ctx_->stream));
}

std::uint64_t cuda_backend::graph_current() const {
  return ctx_->graph != nullptr && !ctx_->capturing ? ctx_->graph_id : 0;
}

void cuda_backend::graph_reset() {
  activate();
  if (ctx_->capturing) {
    // An op failed while recording: end the capture so the stream works again, drop what it made.
    ctx_->capturing = false;
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(ctx_->stream, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
  }
  if (ctx_->graph) {
    // Its replays may still be queued: they must finish before its memory serves anyone else.
    TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    TROUPE_CUDA_CHECK(cudaGraphExecDestroy(ctx_->graph));
    ctx_->graph = nullptr;
  }
  ctx_->graph_id = 0;
  ctx_->alloc->graph_release();
}

void cuda_backend::record_ready(const tensor& t) {
  activate();
  cuda::record_ready(ctx_->stream_owner, t);
}

void cuda_backend::wait_ready(const tensor& t) {
  activate();
  cuda::wait_ready(ctx_->stream_owner, t);
}

std::uint64_t cuda_backend::peak_memory_bytes() const { return ctx_->alloc->stats().peak_in_use; }

namespace {
// A timing event recorded on a backend's stream, from the context's pool and back to it.
struct event_mark : time_mark {
  explicit event_mark(const context* c) : ctx(c), pool(c->marks), event(pool->take()) {}
  ~event_mark() override { pool->give(event); }
  event_mark(const event_mark&) = delete;
  event_mark& operator=(const event_mark&) = delete;
  const context* ctx;
  std::shared_ptr<event_pool> pool;
  cudaEvent_t event;
};
}  // namespace

std::shared_ptr<time_mark> cuda_backend::mark_time() {
  activate();
  if (ctx_->capturing) throw core::failure("cuda mark_time: not while a graph is being recorded");
  auto m = std::make_shared<event_mark>(ctx_.get());
  TROUPE_CUDA_CHECK(cudaEventRecord(m->event, ctx_->stream));
  return m;
}

std::vector<std::chrono::steady_clock::time_point> cuda_backend::mark_times(
    const std::vector<std::shared_ptr<time_mark>>& marks) {
  activate();
  std::vector<std::chrono::steady_clock::time_point> out;
  if (marks.empty()) return out;
  std::vector<const event_mark*> ev;
  for (const auto& m : marks) {
    auto* e = dynamic_cast<const event_mark*>(m.get());
    if (!e || e->ctx != ctx_.get())
      throw core::failure(name() + " mark_times: a mark of another backend");
    ev.push_back(e);
  }
  for (const event_mark* e : ev) TROUPE_CUDA_CHECK(cudaEventSynchronize(e->event));
  // The anchor: an event on an idle stream of the same device runs at once, so the host's clock
  // right after it completes is its device time, to within a launch (microseconds). Events of one
  // device share its clock; each mark is placed before the anchor by their difference.
  if (!ctx_->clock_stream)
    TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_->clock_stream, cudaStreamNonBlocking));
  event_mark anchor(ctx_.get());
  TROUPE_CUDA_CHECK(cudaEventRecord(anchor.event, ctx_->clock_stream));
  TROUPE_CUDA_CHECK(cudaEventSynchronize(anchor.event));
  const auto host = std::chrono::steady_clock::now();
  out.reserve(ev.size());
  for (const event_mark* e : ev) {
    float ms = 0;
    TROUPE_CUDA_CHECK(cudaEventElapsedTime(&ms, e->event, anchor.event));
    out.push_back(host - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double, std::milli>(ms)));
  }
  return out;
}

memory_stats cuda_backend::memory() const { return ctx_->alloc->stats(); }

void cuda_backend::reset_peak_memory() { ctx_->alloc->reset_peak(); }

void cuda_backend::empty_cache() {
  activate();
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  ctx_->alloc->empty_cache();
}

CUstream_st* cuda_backend::stream() const { return ctx_->stream; }

}  // namespace cuda
}  // namespace troupe::kernels
