// The CPU backend: the fp32 reference implementation of every op of kernels/backend.hpp.
//
// Each op lives in its own file (kernels/cpu/<op>.cpp) and defines the members declared here.
// Every op checks devices, dtypes and shapes first and throws core::failure naming the op and the
// shapes it got. Work is split over threads only along independent outputs (rows, heads, output
// blocks of a GEMM), and the split depends on the problem shape, never on the thread count, so the
// bits of every result are the same with 1 or N threads and from whichever thread calls
// (docs/kernels.md, "Determinism"). The class holds no per-call state: several threads may call
// ops on one instance concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/backend.hpp"

namespace troupe::kernels::cpu {

class cpu_backend final : public backend {
 public:
  cpu_backend();
  core::device dev() const override { return {}; }
  std::string name() const override { return "cpu"; }

  /// Zero-filled host memory, counted: live_memory_bytes / peak_memory_bytes report what this
  /// backend's tensors hold (storage bytes, whoever holds the last handle), so a CPU run measures
  /// what `troupe plan` predicts.
  tensor empty(const core::shape_t& shape, core::dtype t) override;
  void zero(tensor& x) override;
  void copy(const tensor& src, tensor& dst) override;
  void convert(const tensor& src, tensor& dst) override;
  void synchronize() override {}

  void linear_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y) override;
  void linear_backward_input(const tensor& dy, const tensor& w, tensor& dx) override;
  void linear_backward_weight(const tensor& dy, const tensor& x, tensor& dw, tensor& db) override;

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

  void embedding_forward_at(const tensor& tokens, const tensor& wte, const tensor& wpe,
                            const tensor& positions, tensor& out) override;
  void embedding_backward_at(const tensor& dout, const tensor& tokens, const tensor& positions,
                             tensor& dwte, tensor& dwpe) override;
  void rope_backward_at(const tensor& dy, const tensor& positions, int heads_total, int rot_heads,
                        int head_dim, const rope_spec& rope, tensor& dx) override;
  void rope_forward_at(const tensor& x, const tensor& positions, int heads_total, int rot_heads,
                       int head_dim, const rope_spec& rope, tensor& y) override;
  void kv_cache_write(const tensor& qkv, const tensor& slots, const tensor& positions,
                      const attention_dims& d, tensor& k_cache, tensor& v_cache) override;
  void attention_decode(const tensor& qkv, const tensor& slots, const tensor& positions,
                        const tensor& k_cache, const tensor& v_cache, const attention_dims& d,
                        tensor& out) override;

  void cross_entropy(tensor& logits, const tensor& targets, tensor& losses,
                     float grad_scale) override;

  void sumsq_blocks(const tensor& x, tensor& out) override;
  void exact_sum_add(const tensor& values, tensor& acc) override;
  void clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip,
                   tensor& out) override;
  void adamw(tensor& param, const tensor& grad, tensor& m, tensor& v, const adamw_params& p,
             tensor& low) override;
  bool has_nonfinite(const tensor& x) override;

  std::uint64_t peak_memory_bytes() const override;
  /// Bytes of this backend's tensors alive now.
  std::uint64_t live_memory_bytes() const;

  /// cos/sin of the rotary angles for positions [0, seq) and pairs [0, head_dim/2), row-major
  /// [seq, head_dim/2] each (kernels/cpu/rope.cpp states the formula).
  struct rope_table {
    int seq = 0;
    int head_dim = 0;
    rope_spec rope;
    std::vector<float> cos, sin;
  };

 private:
  /// The table for (seq, head_dim, rope), computed once and shared by later calls.
  std::shared_ptr<const rope_table> rope_angles(int seq, int head_dim, const rope_spec& rope);

  /// Live and peak bytes, and the large blocks kept for reuse; shared with the release function
  /// of every storage handed out, which may outlive the backend.
  struct memory_counter {
    std::atomic<std::uint64_t> live{0};
    std::atomic<std::uint64_t> peak{0};
    /// Freed blocks of at least spare_min_bytes (allocation size, pointer), at most spare_max_bytes
    /// in all: a training step allocates the same large tensors (the head's logits) every
    /// micro-batch, and memory fresh from the system costs a page fault per 4 KiB.
    std::mutex spare_mu;
    std::vector<std::pair<std::size_t, void*>> spare;
    std::size_t spare_bytes = 0;
    ~memory_counter();
  };
  std::shared_ptr<memory_counter> mem_ = std::make_shared<memory_counter>();

  std::mutex rope_mu_;
  std::vector<std::shared_ptr<const rope_table>> rope_tables_;
};

}  // namespace troupe::kernels::cpu
