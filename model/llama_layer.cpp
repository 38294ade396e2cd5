// LLaMA's parts of a layer: q/k/v projections run as one GEMM and rotated by RoPE, and the
// SwiGLU MLP down_proj(silu(gate_proj(m)) * up_proj(m)). No biases.
//
// The q, k and v weights stay separate parameters under their Hugging Face names, each at its own
// norm_block-aligned offset, so they are not adjacent in the flat buffer. Linear weights are
// [out, in], so stacking them row-wise gives the fused [(H + 2 Hkv) D, C] weight whose GEMM writes
// qkv in exactly the [q heads | k heads | v heads] layout attention reads. The stacked copy is
// rebuilt before every use (three row-block copies, cheap next to the GEMM) rather than cached, so
// it can never go stale when someone writes the parameters; the weight gradient goes through one
// fused scratch GEMM and is then added to the three gradients.
#include "model/layer.hpp"
#include "model/params.hpp"

namespace troupe::model {
namespace {

/// q, k and v seen as one [q rows + k rows + v rows, C] matrix when they lie back to back in one
/// buffer, in that order (the parameter and gradient buffers of a chunk keep a layer's projections
/// so, unless padding separates them); else an undefined tensor.
tensor back_to_back(const tensor& q, const tensor& k, const tensor& v) {
  if (!q.defined() || !k.defined() || !v.defined()) return {};
  if (q.store() != k.store() || k.store() != v.store()) return {};
  if (q.type() != k.type() || k.type() != v.type() || q.rank() != 2 || k.rank() != 2 ||
      v.rank() != 2 || k.dim(1) != q.dim(1) || v.dim(1) != q.dim(1))
    return {};
  if (k.byte_offset() != q.byte_offset() + q.bytes() ||
      v.byte_offset() != k.byte_offset() + k.bytes())
    return {};
  return tensor::over(q.store(), q.byte_offset(), {q.dim(0) + k.dim(0) + v.dim(0), q.dim(1)},
                      q.type());
}

class llama_layer_ops final : public layer_ops {
 public:
  using layer_ops::layer_ops;

 protected:
  tensor qkv_forward(const layer_tensors& w, const tensor& n1, const tensor* positions) override {
    const int heads = heads_, kv = kv_heads_;
    tensor qkv = alloc({n1.dim(0), qkv_width_});
    be_.linear_forward(n1, stacked(w), {}, qkv);
    const std::int64_t q = std::int64_t(heads) * cfg_.head_dim(), k = std::int64_t(kv) * cfg_.head_dim();
    lora_forward(w.q_l, n1, qkv, 0);
    lora_forward(w.k_l, n1, qkv, q);
    lora_forward(w.v_l, n1, qkv, q + k);
    const kernels::rope_spec rope = rope_of(cfg_);
    if (positions)
      be_.rope_forward_at(qkv, *positions, heads + 2 * kv, heads + kv, cfg_.head_dim(), rope, qkv);
    else
      be_.rope_forward(qkv, cfg_.seq_length, heads + 2 * kv, heads + kv, cfg_.head_dim(), rope, qkv);
    return qkv;
  }

  void qkv_backward_input(const layer_tensors& w, const tensor& dqkv, tensor& dn1,
                          layer_stash& s, const tensor* positions) override {
    const int heads = heads_, kv = kv_heads_;
    tensor d_proj = dqkv;  // turned back in place: the attention's gradient is not read again
    if (positions)
      be_.rope_backward_at(dqkv, *positions, heads + 2 * kv, heads + kv, cfg_.head_dim(),
                           rope_of(cfg_), d_proj);
    else
      be_.rope_backward(dqkv, cfg_.seq_length, heads + 2 * kv, heads + kv, cfg_.head_dim(),
                        rope_of(cfg_), d_proj);
    be_.linear_backward_input_write(d_proj, stacked(w), dn1);
    const std::int64_t q = std::int64_t(heads) * cfg_.head_dim(), k = std::int64_t(kv) * cfg_.head_dim();
    lora_backward_input(w.q_l, d_proj, dn1, 0);
    lora_backward_input(w.k_l, d_proj, dn1, q);
    lora_backward_input(w.v_l, d_proj, dn1, q + k);
    s.d_qkv = d_proj;
  }

  void qkv_backward_weight(const layer_tensors& w, const layer_acts& a, const layer_stash& s,
                           layer_tensors& g) override {
    const std::int64_t q = std::int64_t(heads_) * cfg_.head_dim(),
                       k = std::int64_t(kv_heads_) * cfg_.head_dim();
    lora_backward_weight(w.q_l, a.n1, s.d_qkv, g.q_l, 0);
    lora_backward_weight(w.k_l, a.n1, s.d_qkv, g.k_l, q);
    lora_backward_weight(w.v_l, a.n1, s.d_qkv, g.v_l, q + k);
    if (!g.q_w.defined() && !g.k_w.defined() && !g.v_w.defined()) return;
    tensor none;
    if (!kv_replicated_) {
      // The three gradients back to back: one GEMM adds into (or writes) all of them.
      tensor all = back_to_back(g.q_w, g.k_w, g.v_w);
      if (all.defined()) {
        weight_grad(s.d_qkv, a.n1, all, none, g.fresh);
        return;
      }
    }
    if (!dstacked_.defined())
      dstacked_ = alloc({qkv_width_, cfg_.hidden_size}, core::dtype::f32);
    be_.linear_backward_weight_write(s.d_qkv, a.n1, dstacked_, none);
    tensor parts[3] = {dstacked_.rows(0, q), dstacked_.rows(q, q + k), dstacked_.rows(q + k, q + 2 * k)};
    if (kv_replicated_) {
      // Ranks that hold the same key/value head each saw the gradient of their query heads only.
      const tensor kv_sum = comm_->all_reduce_kv(dstacked_.rows(q, q + 2 * k));
      parts[1] = kv_sum.rows(0, k);
      parts[2] = kv_sum.rows(k, 2 * k);
    }
    tensor* grads[3] = {&g.q_w, &g.k_w, &g.v_w};
    for (int i = 0; i < 3; ++i) {
      if (!grads[i]->defined()) continue;
      if (g.fresh)
        be_.copy(parts[i], *grads[i]);
      else
        be_.accumulate(parts[i], *grads[i]);
    }
  }

  tensor mlp_forward(const layer_tensors& w, layer_acts& a) override {
    const std::int64_t n = a.n2.dim(0);
    a.fc = alloc({n, ffn_});
    be_.linear_forward(a.n2, w.fc_w, {}, a.fc);
    lora_forward(w.fc_l, a.n2, a.fc);
    a.up = alloc({n, ffn_});
    be_.linear_forward(a.n2, w.up_w, {}, a.up);
    lora_forward(w.up_l, a.n2, a.up);
    a.act = alloc({n, ffn_});
    be_.swiglu_forward(a.fc, a.up, a.act);
    return residual_branch(a.act, w.out_w, {}, w.out_l, a.mid, a.drop.mlp_out);
  }

  void mlp_backward_input(const layer_tensors& w, const layer_acts& a, const tensor& dy,
                          tensor& dn2, layer_stash& s) override {
    const std::int64_t n = dy.dim(0);  // every row (a.n2 holds this rank's under sequence parallel)
    tensor dact = alloc({n, ffn_});
    be_.linear_backward_input_write(dy, w.out_w, dact);
    lora_backward_input(w.out_l, dy, dact);
    tensor dgate = alloc({n, ffn_}), dup = alloc({n, ffn_});
    be_.swiglu_backward(dact, a.fc, a.up, dgate, dup);
    be_.linear_backward_input_write(dgate, w.fc_w, dn2);
    lora_backward_input(w.fc_l, dgate, dn2);
    be_.linear_backward_input(dup, w.up_w, dn2);
    lora_backward_input(w.up_l, dup, dn2);
    s.d_out = dy;
    s.d_fc = dgate;
    s.d_up = dup;
  }

  void mlp_backward_weight(const layer_tensors& w, const layer_acts& a, const layer_stash& s,
                           layer_tensors& g) override {
    tensor none;
    if (g.out_w.defined()) weight_grad(s.d_out, a.act, g.out_w, none, g.fresh);
    lora_backward_weight(w.out_l, a.act, s.d_out, g.out_l);
    if (g.fc_w.defined()) weight_grad(s.d_fc, a.n2, g.fc_w, none, g.fresh);
    lora_backward_weight(w.fc_l, a.n2, s.d_fc, g.fc_l);
    if (g.up_w.defined()) weight_grad(s.d_up, a.n2, g.up_w, none, g.fresh);
    lora_backward_weight(w.up_l, a.n2, s.d_up, g.up_l);
  }

 private:
  /// The fused [q; k; v] weight of layer w: the three in place when they lie back to back, else
  /// rebuilt in the shared scratch.
  tensor stacked(const layer_tensors& w) {
    tensor all = back_to_back(w.q_w, w.k_w, w.v_w);
    if (all.defined()) return all;
    if (!stacked_.defined()) stacked_ = alloc({qkv_width_, cfg_.hidden_size}, w.q_w.type());
    std::int64_t row = 0;
    for (const tensor* part : {&w.q_w, &w.k_w, &w.v_w}) {
      tensor dst = stacked_.rows(row, row + part->dim(0));
      be_.copy(*part, dst);
      row += part->dim(0);
    }
    return stacked_;
  }

  tensor stacked_;   // compute dtype
  tensor dstacked_;  // fp32
};

}  // namespace

std::unique_ptr<layer_ops> make_llama_layer_ops(const core::model_config& cfg,
                                                kernels::backend& be, core::dtype act,
                                                const layer_split* split, layer_comm* comm) {
  return std::make_unique<llama_layer_ops>(cfg, be, act, split, comm);
}

}  // namespace troupe::model
