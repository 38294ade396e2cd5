// The CUDA backend: kernels/backend.hpp on one GPU. Each op is a member defined in its own file
// (kernels/cuda/<op>.cu: its kernels, their launch and the method together). Each instance owns
// one stream, one cuBLASLt handle and one caching allocator, so several backends may share a GPU
// (that is how pipeline stages on one GPU run side by side). All ops are queued on the stream; only copies to the host,
// has_nonfinite and synchronize wait for it. This header has no CUDA types, so host-only code
// (kernels/backend.cpp, tests, benchmarks) can include it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/cuda/cuda_allocator.hpp"

struct CUstream_st;

namespace troupe::kernels {

/// A CUDA backend on GPU `device_index`; with share_count > 1 its work runs on share share_index of
/// share_count disjoint groups of the GPU's SMs (kernels/cuda/sm_partition.hpp). Throws
/// core::failure when that GPU cannot be used (or split so).
std::unique_ptr<backend> make_cuda_backend(int device_index, int share_index = 0,
                                           int share_count = 1);
/// True when at least one GPU is visible to the CUDA runtime (never throws).
bool cuda_device_present();
/// Total memory of GPU `device_index` in bytes (0 when it cannot be asked).
std::uint64_t cuda_device_memory(int device_index);

namespace cuda {

struct context;

/// The file of measured GEMM algorithms (kernels/select.hpp, gemm_tuning.hpp); "" = heuristic.
void set_gemm_tune_file(const std::string& path);
/// Benchmark switches, process-wide: print every new GEMM plan to stderr (shape, dtypes,
/// alignments, the algorithm's configuration; default off), and let GELU ride on the GEMM
/// epilogue for 16-bit activations (linear.cu; default on; off runs the unfused kernels).
void set_gemm_log(bool on);
void set_gelu_epilogue(bool on);

class cuda_backend final : public backend {
 public:
  explicit cuda_backend(int device_index, int share_index = 0, int share_count = 1);
  ~cuda_backend() override;

  core::device dev() const override;
  std::string name() const override;

  tensor empty(const core::shape_t& shape, core::dtype t) override;
  void zero(tensor& x) override;
  void copy(const tensor& src, tensor& dst) override;
  void convert(const tensor& src, tensor& dst) override;
  void synchronize() override;

  void linear_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y) override;
  void linear_backward_input(const tensor& dy, const tensor& w, tensor& dx) override;
  void linear_backward_weight(const tensor& dy, const tensor& x, tensor& dw, tensor& db) override;
  std::int64_t logits_width(std::int64_t classes) const override;
  void linear_forward_residual(const tensor& x, const tensor& w, const tensor& b, const tensor& r,
                               tensor& y) override;
  void linear_gelu_forward(const tensor& x, const tensor& w, const tensor& b, tensor& pre,
                           tensor& y) override;
  void linear_backward_input_write(const tensor& dy, const tensor& w, tensor& dx) override;
  void linear_backward_weight_write(const tensor& dy, const tensor& x, tensor& dw,
                                    tensor& db) override;
  void linear_backward_input_gelu(const tensor& dy, const tensor& w, const tensor& pre,
                                  tensor& dx) override;

  void embedding_forward(const tensor& tokens, const tensor& wte, const tensor& wpe, int seq,
                         tensor& out) override;
  void embedding_backward(const tensor& dout, const tensor& tokens, int seq, tensor& dwte,
                          tensor& dwpe) override;

  void layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps, tensor& y,
                         tensor& mean, tensor& rstd) override;
  void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                          const tensor& rstd, tensor& dx, tensor& dw, tensor& db) override;
  void rmsnorm_forward(const tensor& x, const tensor& w, float eps, tensor& y,
                       tensor& rstd) override;
  void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,
                        tensor& dx, tensor& dw) override;
  void rmsnorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                 const tensor& rstd, const tensor& residual, tensor& dx,
                                 tensor& dw) override;

  void gelu_forward(const tensor& x, tensor& y) override;
  void gelu_backward(const tensor& dy, const tensor& x, tensor& dx) override;
  void swiglu_forward(const tensor& gate, const tensor& up, tensor& y) override;
  void swiglu_backward(const tensor& dy, const tensor& gate, const tensor& up, tensor& dgate,
                       tensor& dup) override;
  void add(const tensor& a, const tensor& b, tensor& y) override;
  void accumulate(const tensor& x, tensor& y) override;
  void sum_rows(const tensor& x, tensor& out) override;
  void scale(tensor& x, float s) override;
  void dropout(const tensor& x, const dropout_spec& s, std::int64_t sample_elems,
               tensor& y) override;

  void rope_forward(const tensor& x, int seq, int heads_total, int rot_heads, int head_dim,
                    const rope_spec& rope, tensor& y) override;
  void rope_backward(const tensor& dy, int seq, int heads_total, int rot_heads, int head_dim,
                     const rope_spec& rope, tensor& dx) override;
  void attention_forward(const tensor& qkv, const attention_dims& d, tensor& out,
                         tensor& lse) override;
  void attention_backward(const tensor& dout, const tensor& qkv, const tensor& out,
                          const tensor& lse, const attention_dims& d, tensor& dqkv) override;
  void layernorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                   const tensor& mean, const tensor& rstd, const tensor& residual,
                                   tensor& dx, tensor& dw, tensor& db, tensor& rsum) override;
  void attention_backward_write(const tensor& dout, const tensor& qkv, const tensor& out,
                                const tensor& lse, const attention_dims& d, tensor& dqkv,
                                tensor& dsum) override;

  void embedding_forward_at(const tensor& tokens, const tensor& wte, const tensor& wpe,
                            const tensor& positions, tensor& out) override;
  void rope_forward_at(const tensor& x, const tensor& positions, int heads_total, int rot_heads,
                       int head_dim, const rope_spec& rope, tensor& y) override;
  void embedding_backward_at(const tensor& dout, const tensor& tokens, const tensor& positions,
                             tensor& dwte, tensor& dwpe) override;
  void rope_backward_at(const tensor& dy, const tensor& positions, int heads_total, int rot_heads,
                        int head_dim, const rope_spec& rope, tensor& dx) override;
  void kv_cache_write(const tensor& qkv, const tensor& slots, const tensor& positions,
                      const attention_dims& d, tensor& k_cache, tensor& v_cache) override;
  void attention_decode(const tensor& qkv, const tensor& slots, const tensor& positions,
                        const tensor& k_cache, const tensor& v_cache, const attention_dims& d,
                        tensor& out) override;

  void cross_entropy(tensor& logits, const tensor& targets, tensor& losses,
                     float grad_scale) override;
  void vp_embedding_forward(const tensor& tokens, const tensor& wte, std::int64_t first,
                            std::int64_t valid, std::int64_t vocab, const tensor& wpe, int seq,
                            tensor& out) override;
  void vp_embedding_backward(const tensor& dout, const tensor& tokens, std::int64_t first,
                             std::int64_t valid, int seq, tensor& dwte, tensor& dwpe) override;
  void vp_row_max(const tensor& z, std::int64_t valid, tensor& row_max) override;
  void vp_row_stats(const tensor& z, std::int64_t valid, const tensor& maxima,
                    const tensor& targets, std::int64_t first, std::int64_t vocab,
                    tensor& stats) override;
  void vp_losses(const tensor& maxima, const tensor& sums, const tensor& targets,
                 tensor& losses) override;
  void vp_softmax_grad(tensor& z, std::int64_t valid, const tensor& maxima, const tensor& sums,
                       const tensor& targets, std::int64_t first, float grad_scale) override;

  void sumsq_blocks(const tensor& x, tensor& out) override;
  void sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out) override;
  void exact_sum_add(const tensor& values, tensor& acc) override;
  void clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip,
                   tensor& out) override;
  void adamw(tensor& param, const tensor& grad, tensor& m, tensor& v, const adamw_params& p,
             tensor& low) override;
  void adamw_runs(tensor& param, const tensor& grad, tensor& m, tensor& v,
                  const std::vector<adamw_run>& runs, const adamw_params& p,
                  tensor& low) override;
  void adamw_runs_hashed(tensor& param, const tensor& grad, tensor& m, tensor& v,
                         const std::vector<adamw_run>& runs, const adamw_params& p, tensor& low,
                         tensor& blocks) override;
  bool has_nonfinite(const tensor& x) override;

  std::uint64_t graph_begin() override;
  void graph_end() override;
  void graph_replay(std::uint64_t id) override;
  void graph_reset() override;
  std::uint64_t graph_current() const override;

  void record_ready(const tensor& t) override;
  void wait_ready(const tensor& t) override;
  std::shared_ptr<pending_value> message_hash_async(const tensor& x) override;
  std::shared_ptr<pending_value> message_hash_of_blocks_async(const tensor& blocks,
                                                              std::uint64_t bytes) override;
  void message_hash_sumsq_blocks(const tensor& x, const tensor& counts, tensor& blocks,
                                 tensor& sums) override;
  std::uint64_t peak_memory_bytes() const override;
  std::shared_ptr<time_mark> mark_time() override;
  std::vector<std::chrono::steady_clock::time_point> mark_times(
      const std::vector<std::shared_ptr<time_mark>>& marks) override;

  /// Allocator counters of this backend (peak bytes of its stage).
  memory_stats memory() const;
  /// Restarts the peak counters at the current values.
  void reset_peak_memory();
  /// Returns cached, unused device blocks to the driver.
  void empty_cache();
  /// This backend's cudaStream_t, for events and communication streams.
  CUstream_st* stream() const;
  /// The SMs its kernels may run on: the GPU's, or its share's under runtime.split_gpu.
  int sm_count() const;
  /// The ids of the SMs that `blocks` blocks of a probe kernel on its stream ran on, ascending and
  /// distinct (waits for them): where this backend's work lands (sm_probe.cu).
  std::vector<int> sms_reached(int blocks);

 private:
  void activate() const;
  /// rmsnorm_backward, onto dx or (written) onto the residual when one is given.
  void rmsnorm_backward_impl(const tensor& dy, const tensor& x, const tensor& w,
                             const tensor& rstd, const tensor* residual, tensor& dx, tensor& dw);
  std::unique_ptr<context> ctx_;
};

}  // namespace cuda
}  // namespace troupe::kernels
