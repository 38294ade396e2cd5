// The meta backend: a backend whose tensors have shapes, dtypes and sizes but no memory, and whose
// ops do nothing. Running the model's own code on it (model::chunk's forward and backward, in a
// schedule's order) shows exactly which buffers the model allocates and when it lets them go,
// without the memory or the arithmetic: `troupe plan` sizes a 7B-parameter layout this way in
// milliseconds, from the same code the runtime runs, so the two cannot disagree.
//
// Contract: a tensor it hands out must never be read or written by the host (its storage points at
// no memory). Live bytes are counted per storage, optionally rounded as a device allocator rounds
// them, and can be split by a label the caller sets (`scope`) or by a classifier of shapes.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "kernels/backend.hpp"

namespace troupe::kernels {

class meta_backend final : public backend {
 public:
  struct options {
    /// Round each allocation as the CUDA allocator does (512 B up to 1 MiB, 2 MiB granules above).
    bool cuda_rounding = false;
    /// Behave like the CUDA backend where its allocations differ from the defaults the CPU
    /// backend uses (its fused ops allocate no temporaries).
    bool cuda_fusions = false;
  };
  /// The label of allocations made while it is current (default "other").
  struct scope {
    scope(meta_backend& be, std::string label) : be_(be), prev_(be.label_) { be_.label_ = std::move(label); }
    ~scope() { be_.label_ = prev_; }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    meta_backend& be_;
    std::string prev_;
  };
  /// A label for an allocation from its shape and dtype, overriding the scope's ("" = keep it).
  using classifier = std::function<std::string(const core::shape_t&, core::dtype)>;

  meta_backend() : meta_backend(options{}) {}
  explicit meta_backend(options o);

  /// Bytes alive now / at the peak, and the split of the peak by label.
  std::uint64_t live_bytes() const;
  std::uint64_t peak_bytes() const;
  std::map<std::string, std::uint64_t> peak_by_label() const;
  std::map<std::string, std::uint64_t> live_by_label() const;
  /// Restarts the peak at the bytes alive now.
  void reset_peak();
  void set_classifier(classifier c) { classify_ = std::move(c); }
  /// The bytes an allocation of `bytes` takes under these options.
  std::uint64_t rounded(std::uint64_t bytes) const;

  /// The device its tensors claim to be on (default the CPU): a dry run for a GPU claims
  /// cuda:0, so the runtime's code takes its GPU paths (host inputs copied in, hand-over copies).
  void set_device(core::device d) { dev_ = d; }
  core::device dev() const override { return dev_; }
  std::string name() const override { return "meta"; }
  std::uint64_t peak_memory_bytes() const override { return peak_bytes(); }

  tensor empty(const core::shape_t& shape, core::dtype t) override;
  void zero(tensor&) override {}
  void copy(const tensor&, tensor&) override {}
  void convert(const tensor&, tensor&) override {}
  void synchronize() override {}

  void linear_forward(const tensor&, const tensor&, const tensor&, tensor&) override {}
  void linear_backward_input(const tensor&, const tensor&, tensor&) override {}
  void linear_backward_weight(const tensor&, const tensor&, tensor&, tensor&) override {}
  std::int64_t logits_width(std::int64_t classes) const override {
    return opt_.cuda_fusions ? cuda_logits_width(classes) : classes;
  }
  void linear_backward_input_gelu(const tensor& dy, const tensor& w, const tensor& pre,
                                  tensor& dx) override;
  void embedding_forward(const tensor&, const tensor&, const tensor&, int, tensor&) override {}
  void embedding_backward(const tensor&, const tensor&, int, tensor&, tensor&) override {}
  void layernorm_forward(const tensor&, const tensor&, const tensor&, float, tensor&, tensor&,
                         tensor&) override {}
  void layernorm_backward(const tensor&, const tensor&, const tensor&, const tensor&,
                          const tensor&, tensor&, tensor&, tensor&) override {}
  void rmsnorm_forward(const tensor&, const tensor&, float, tensor&, tensor&) override {}
  void rmsnorm_backward(const tensor&, const tensor&, const tensor&, const tensor&, tensor&,
                        tensor&) override {}
  void gelu_forward(const tensor&, tensor&) override {}
  void gelu_backward(const tensor&, const tensor&, tensor&) override {}
  void swiglu_forward(const tensor&, const tensor&, tensor&) override {}
  void swiglu_backward(const tensor&, const tensor&, const tensor&, tensor&, tensor&) override {}
  void add(const tensor&, const tensor&, tensor&) override {}
  void accumulate(const tensor&, tensor&) override {}
  void sum_rows(const tensor&, tensor&) override {}
  void scale(tensor&, float) override {}
  void dropout(const tensor&, const dropout_spec&, std::int64_t, tensor&) override {}
  void rope_forward(const tensor&, int, int, int, int, const rope_spec&, tensor&) override {}
  void rope_backward(const tensor&, int, int, int, int, const rope_spec&, tensor&) override {}
  void attention_forward(const tensor&, const attention_dims&, tensor&, tensor&) override {}
  void attention_backward(const tensor&, const tensor&, const tensor&, const tensor&,
                          const attention_dims&, tensor&) override {}
  void cross_entropy(tensor&, const tensor&, tensor&, float) override {}
  void vp_embedding_forward(const tensor&, const tensor&, std::int64_t, std::int64_t,
                            std::int64_t, const tensor&, int, tensor&) override {}
  void vp_embedding_backward(const tensor&, const tensor&, std::int64_t, std::int64_t, int,
                             tensor&, tensor&) override {}
  void vp_row_max(const tensor&, std::int64_t, tensor&) override {}
  void vp_row_stats(const tensor&, std::int64_t, const tensor&, const tensor&, std::int64_t,
                    std::int64_t, tensor&) override {}
  void vp_losses(const tensor&, const tensor&, const tensor&, tensor&) override {}
  void vp_softmax_grad(tensor&, std::int64_t, const tensor&, const tensor&, const tensor&,
                       std::int64_t, float) override {}
  void sumsq_blocks(const tensor&, tensor&) override {}
  void exact_sum_add(const tensor&, tensor&) override {}
  void clip_factor(const tensor&, const tensor&, double, tensor&) override {}
  void adamw(tensor&, const tensor&, tensor&, tensor&, const adamw_params&, tensor&) override {}
  bool has_nonfinite(const tensor&) override { return false; }

 private:
  /// The backend's bytes. A tensor may die on another thread than the one that made it (a peer
  /// that received it, in a collective run a thread per rank), so every access holds `mu`.
  struct counter {
    mutable std::mutex mu;
    std::uint64_t live = 0, peak = 0;
    std::map<std::string, std::uint64_t> by_label, peak_split;
  };
  options opt_;
  core::device dev_{};
  std::string label_ = "other";
  classifier classify_;
  std::shared_ptr<counter> counter_ = std::make_shared<counter>();
};

}  // namespace troupe::kernels
