// GPT-2's parts of a layer: the fused c_attn projection (with bias) straight into the
// [q heads | k heads | v heads] layout attention reads, and the c_fc → GELU(tanh) → c_proj MLP.
// Of the MLP only the pre-activation fc is kept for backward: the GELU output is recomputed
// where the c_proj weight gradient needs it (one elementwise pass, 100 MB less per layer of
// GPT-2 124M at B=16, T=1024 in bf16), unless the layer keeps it (layer_acts::keep_act,
// recompute.keep_gelu). A kept output is the one c_proj's forward read: with GELU in the GEMM's
// epilogue (CUDA, 16-bit activations) the GELU of the fp32 sum, where the recomputed one is the
// GELU of the rounded pre-activation, so the two differ in low bits there and nowhere else.
#include "model/layer.hpp"

namespace troupe::model {
namespace {

class gpt2_layer_ops final : public layer_ops {
 public:
  using layer_ops::layer_ops;

 protected:
  // Positions enter GPT-2 through the embedding only.
  tensor qkv_forward(const layer_tensors& w, const tensor& n1, const tensor*) override {
    tensor qkv = alloc({n1.dim(0), qkv_width_});
    be_.linear_forward(n1, w.qkv_w, w.qkv_b, qkv);
    lora_forward(w.qkv_l, n1, qkv);
    return qkv;
  }

  void qkv_backward_input(const layer_tensors& w, const tensor& dqkv, tensor& dn1,
                          layer_stash& s, const tensor*) override {
    be_.linear_backward_input_write(dqkv, w.qkv_w, dn1);
    lora_backward_input(w.qkv_l, dqkv, dn1);
    s.d_qkv = dqkv;
  }

  void qkv_backward_weight(const layer_tensors& w, const layer_acts& a, const layer_stash& s,
                           layer_tensors& g) override {
    if (g.qkv_w.defined()) {
      // The bias gradient summed by the attention backward (layer_ops::qkv_bias_sum_), or here.
      const bool summed = s.d_qkv_b.defined() && g.qkv_b.defined();
      tensor none;
      weight_grad(s.d_qkv, a.n1, g.qkv_w, summed ? none : g.qkv_b, g.fresh);
      if (summed) {
        if (g.fresh)
          be_.copy(s.d_qkv_b, g.qkv_b);
        else
          be_.accumulate(s.d_qkv_b, g.qkv_b);
      }
    }
    lora_backward_weight(w.qkv_l, a.n1, s.d_qkv, g.qkv_l);
  }

  // The pre-activation fc is kept; act = gelu(fc) lives from the c_fc GEMM to the c_proj GEMM
  // here and is recomputed in the weight phase, unless a.keep_act keeps it.
  tensor mlp_forward(const layer_tensors& w, layer_acts& a) override {
    const std::int64_t n = a.n2.dim(0);
    a.fc = alloc({n, ffn_});
    tensor act = alloc({n, ffn_});
    if (w.fc_l.defined()) {  // the adapter adds to the pre-activation: no fused GELU epilogue
      be_.linear_forward(a.n2, w.fc_w, w.fc_b, a.fc);
      lora_forward(w.fc_l, a.n2, a.fc);
      be_.gelu_forward(a.fc, act);
    } else {
      be_.linear_gelu_forward(a.n2, w.fc_w, w.fc_b, a.fc, act);
    }
    if (a.keep_act) a.act = act;
    return residual_branch(act, w.out_w, w.out_b, w.out_l, a.mid, a.drop.mlp_out);
  }

  void mlp_backward_input(const layer_tensors& w, const layer_acts& a, const tensor& dy,
                          tensor& dn2, layer_stash& s) override {
    const std::int64_t n = dy.dim(0);  // every row (a.n2 holds this rank's under sequence parallel)
    tensor dfc = alloc({n, ffn_});
    if (w.out_l.defined()) {  // the adapter adds to d act before the GELU's derivative
      tensor dact = alloc({n, ffn_});
      be_.linear_backward_input_write(dy, w.out_w, dact);
      lora_backward_input(w.out_l, dy, dact);
      be_.zero(dfc);
      be_.gelu_backward(dact, a.fc, dfc);
    } else {
      be_.linear_backward_input_gelu(dy, w.out_w, a.fc, dfc);
    }
    be_.linear_backward_input_write(dfc, w.fc_w, dn2);
    lora_backward_input(w.fc_l, dfc, dn2);
    s.d_out = dy;
    s.d_fc = dfc;
  }

  void mlp_backward_weight(const layer_tensors& w, const layer_acts& a, const layer_stash& s,
                           layer_tensors& g) override {
    if (g.out_w.defined() || g.out_l.defined()) {
      tensor act = a.act;
      if (!act.defined()) {
        act = alloc(a.fc.shape());
        be_.gelu_forward(a.fc, act);
      }
      tensor none;  // out_b's gradient may come from norm2's backward (branch_bias_from_norm)
      if (g.out_w.defined())
        weight_grad(s.d_out, act, g.out_w, branch_bias_ ? none : g.out_b, g.fresh);
      lora_backward_weight(w.out_l, act, s.d_out, g.out_l);
    }
    if (g.fc_w.defined()) weight_grad(s.d_fc, a.n2, g.fc_w, g.fc_b, g.fresh);
    lora_backward_weight(w.fc_l, a.n2, s.d_fc, g.fc_l);
  }

  // The weight phase reads the kept act, or recomputes it from fc (as large as the act it
  // replaces), so exactly one of the two stays.
  void mlp_keep_for_weight(layer_acts& a) const override {
    if (a.act.defined()) a.fc = {};
  }
};

}  // namespace

std::unique_ptr<layer_ops> make_gpt2_layer_ops(const core::model_config& cfg,
                                               kernels::backend& be, core::dtype act,
                                               const layer_split* split, layer_comm* comm) {
  return std::make_unique<gpt2_layer_ops>(cfg, be, act, split, comm);
}

}  // namespace troupe::model
