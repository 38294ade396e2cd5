#include "kernels/cuda/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <cstring>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels {

std::unique_ptr<backend> make_cuda_backend(int device_index) {
  return std::make_unique<cuda::cuda_backend>(device_index);
}

bool cuda_device_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
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

cuda_backend::cuda_backend(int device_index) {
  int n = 0;
  TROUPE_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (device_index < 0 || device_index >= n)
    throw core::failure("cuda backend: device cuda:" + std::to_string(device_index) +
                        " does not exist (" + std::to_string(n) +
                        " visible; hint: check CUDA_VISIBLE_DEVICES)");
  ctx_ = std::make_unique<context>(device_index);
}

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

void cuda_backend::convert(const tensor& src, tensor& dst) {
  activate();
  if (src.type() == dst.type() && src.shape() == dst.shape()) {
    copy(src, dst);
    return;
  }
  launch_convert(src, dst, ctx_->stream);
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
                        "); hint: set train.cuda_graph = false to launch every op from the host");
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

void cuda_backend::linear_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y) {
  activate();
  launch_linear_forward(*ctx_, x, w, b, y);
}

void cuda_backend::linear_backward_input(const tensor& dy, const tensor& w, tensor& dx) {
  activate();
  launch_linear_backward_input(*ctx_, dy, w, dx);
}

void cuda_backend::linear_backward_weight(const tensor& dy, const tensor& x, tensor& dw,
                                          tensor& db) {
  activate();
  launch_linear_backward_weight(*ctx_, dy, x, dw, db);
}

void cuda_backend::linear_forward_residual(const tensor& x, const tensor& w, const tensor& b,
                                           const tensor& r, tensor& y) {
  activate();
  launch_linear_forward_residual(*ctx_, x, w, b, r, y);
}

void cuda_backend::linear_gelu_forward(const tensor& x, const tensor& w, const tensor& b,
                                       tensor& pre, tensor& y) {
  activate();
  launch_linear_gelu_forward(*ctx_, x, w, b, pre, y);
}

void cuda_backend::linear_backward_input_write(const tensor& dy, const tensor& w, tensor& dx) {
  activate();
  launch_linear_backward_input_write(*ctx_, dy, w, dx);
}

void cuda_backend::linear_backward_input_gelu(const tensor& dy, const tensor& w,
                                              const tensor& pre, tensor& dx) {
  activate();
  launch_linear_backward_input_gelu(*ctx_, dy, w, pre, dx);
}

void cuda_backend::embedding_forward(const tensor& tokens, const tensor& wte, const tensor& wpe,
                                     int seq, tensor& out) {
  activate();
  launch_embedding_forward(tokens, wte, wpe, seq, out, ctx_->stream);
}

void cuda_backend::embedding_backward(const tensor& dout, const tensor& tokens, int seq,
                                      tensor& dwte, tensor& dwpe) {
  activate();
  launch_embedding_backward(*ctx_, dout, tokens, seq, dwte, dwpe);
}

void cuda_backend::layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps,
                                     tensor& y, tensor& mean, tensor& rstd) {
  activate();
  launch_layernorm_forward(x, w, b, eps, y, mean, rstd, ctx_->stream);
}

void cuda_backend::layernorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                      const tensor& mean, const tensor& rstd, tensor& dx,
                                      tensor& dw, tensor& db) {
  activate();
  launch_layernorm_backward(*ctx_, dy, x, w, mean, rstd, dx, dw, db);
}

void cuda_backend::rmsnorm_forward(const tensor& x, const tensor& w, float eps, tensor& y,
                                   tensor& rstd) {
  activate();
  launch_rmsnorm_forward(x, w, eps, y, rstd, ctx_->stream);
}

void cuda_backend::rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                    const tensor& rstd, tensor& dx, tensor& dw) {
  activate();
  launch_rmsnorm_backward(*ctx_, dy, x, w, rstd, dx, dw);
}

void cuda_backend::gelu_forward(const tensor& x, tensor& y) {
  activate();
  launch_gelu_forward(x, y, ctx_->stream);
}

void cuda_backend::gelu_backward(const tensor& dy, const tensor& x, tensor& dx) {
  activate();
  launch_gelu_backward(dy, x, dx, ctx_->stream);
}

void cuda_backend::swiglu_forward(const tensor& gate, const tensor& up, tensor& y) {
  activate();
  launch_swiglu_forward(gate, up, y, ctx_->stream);
}

void cuda_backend::swiglu_backward(const tensor& dy, const tensor& gate, const tensor& up,
                                   tensor& dgate, tensor& dup) {
  activate();
  launch_swiglu_backward(dy, gate, up, dgate, dup, ctx_->stream);
}

void cuda_backend::add(const tensor& a, const tensor& b, tensor& y) {
  activate();
  launch_add(a, b, y, ctx_->stream);
}

void cuda_backend::accumulate(const tensor& x, tensor& y) {
  activate();
  launch_accumulate(x, y, ctx_->stream);
}

void cuda_backend::scale(tensor& x, float s) {
  activate();
  launch_scale(x, s, ctx_->stream);
}

void cuda_backend::rope_forward(const tensor& x, int seq, int heads_total, int rot_heads,
                                int head_dim, float theta, tensor& y) {
  activate();
  launch_rope_forward(x, seq, heads_total, rot_heads, head_dim, theta, y, ctx_->stream);
}

void cuda_backend::rope_backward(const tensor& dy, int seq, int heads_total, int rot_heads,
                                 int head_dim, float theta, tensor& dx) {
  activate();
  launch_rope_backward(dy, seq, heads_total, rot_heads, head_dim, theta, dx, ctx_->stream);
}

void cuda_backend::attention_forward(const tensor& qkv, const attention_dims& d, tensor& out,
                                     tensor& lse) {
  activate();
  launch_attention_forward(*ctx_, qkv, d, out, lse);
}

void cuda_backend::attention_backward(const tensor& dout, const tensor& qkv, const tensor& out,
                                      const tensor& lse, const attention_dims& d, tensor& dqkv) {
  activate();
  launch_attention_backward(*ctx_, dout, qkv, out, lse, d, dqkv);
}

void cuda_backend::layernorm_backward_residual(const tensor& dy, const tensor& x,
                                               const tensor& w, const tensor& mean,
                                               const tensor& rstd, const tensor& residual,
                                               tensor& dx, tensor& dw, tensor& db) {
  activate();
  launch_layernorm_backward(*ctx_, dy, x, w, mean, rstd, dx, dw, db, &residual);
}

void cuda_backend::attention_backward_write(const tensor& dout, const tensor& qkv,
                                            const tensor& out, const tensor& lse,
                                            const attention_dims& d, tensor& dqkv) {
  activate();
  launch_attention_backward(*ctx_, dout, qkv, out, lse, d, dqkv, false);
}

void cuda_backend::cross_entropy(tensor& logits, const tensor& targets, tensor& losses,
                                 float grad_scale) {
  activate();
  launch_cross_entropy(logits, targets, losses, grad_scale, ctx_->stream);
}

void cuda_backend::sumsq_blocks(const tensor& x, tensor& out) {
  activate();
  launch_sumsq_blocks(x, out, ctx_->stream);
}

void cuda_backend::sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out) {
  activate();
  launch_sumsq_blocks_list(xs, out, ctx_->stream);
}

void cuda_backend::exact_sum_add(const tensor& values, tensor& acc) {
  activate();
  launch_exact_sum_add(values, acc, ctx_->stream);
}

void cuda_backend::clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip,
                               tensor& out) {
  activate();
  launch_clip_factor(sumsq, guard, grad_clip, out, ctx_->stream);
}

void cuda_backend::adamw(tensor& param, const tensor& grad, tensor& m, tensor& v,
                         const adamw_params& p, tensor& low) {
  activate();
  launch_adamw(param, grad, m, v, p, low, ctx_->stream);
}

void cuda_backend::adamw_runs(tensor& param, const tensor& grad, tensor& m, tensor& v,
                              const std::vector<adamw_run>& runs, const adamw_params& p,
                              tensor& low) {
  activate();
  launch_adamw_runs(param, grad, m, v, runs, p, low, ctx_->stream);
}

bool cuda_backend::has_nonfinite(const tensor& x) {
  activate();
  if (ctx_->capturing)
    throw core::failure("cuda has_nonfinite: cannot read a result back while recording a graph");
  return launch_has_nonfinite(*ctx_, x);
}

void cuda_backend::record_ready(const tensor& t) {
  activate();
  cuda::record_ready(ctx_->stream_owner, t);
}

void cuda_backend::wait_ready(const tensor& t) {
  activate();
  cuda::wait_ready(ctx_->stream_owner, t);
}

std::shared_ptr<pending_value> cuda_backend::message_hash_async(const tensor& x) {
  if (x.defined() && x.dev().is_cpu()) return backend::message_hash_async(x);
  activate();
  if (ctx_->capturing)
    throw core::failure("cuda message_hash_async: a hash read by the host cannot be recorded in a graph");
  auto h = launch_message_hash(*ctx_, x);
  // Whoever waits for x from now on also waits for the hash's reads of it.
  if (x.defined() && x.bytes() > 0) cuda::record_ready(ctx_->stream_owner, x);
  return h;
}

std::uint64_t cuda_backend::peak_memory_bytes() const { return ctx_->alloc->stats().peak_in_use; }

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
