// GPT-2's parts of a layer: the fused c_attn projection (with bias) straight into the
// [q heads | k heads | v heads] layout attention reads, and the c_fc → GELU(tanh) → c_proj MLP.
#include "model/layer.hpp"

namespace troupe::model {
namespace {

class gpt2_layer_ops final : public layer_ops {
 public:
  using layer_ops::layer_ops;

 protected:
  tensor qkv_forward(const layer_tensors& w, const tensor& n1) override {
    tensor qkv = alloc({n1.dim(0), qkv_width_});
    be_.linear_forward(n1, w.qkv_w, w.qkv_b, qkv);
    return qkv;
  }

  void qkv_backward_input(const layer_tensors& w, const tensor& dqkv, tensor& dn1,
                          layer_stash& s) override {
    be_.linear_backward_input(dqkv, w.qkv_w, dn1);
    s.d_qkv = dqkv;
  }

  void qkv_backward_weight(const layer_acts& a, const layer_stash& s, layer_tensors& g) override {
    be_.linear_backward_weight(s.d_qkv, a.n1, g.qkv_w, g.qkv_b);
  }

  tensor mlp_forward(const layer_tensors& w, layer_acts& a) override {
    const std::int64_t n = a.n2.dim(0);
    a.fc = alloc({n, ffn_});
    be_.linear_forward(a.n2, w.fc_w, w.fc_b, a.fc);
    a.act = alloc({n, ffn_});
    be_.gelu_forward(a.fc, a.act);
    tensor out = alloc({n, cfg_.hidden_size});
    be_.linear_forward(a.act, w.out_w, w.out_b, out);
    return out;
  }

  void mlp_backward_input(const layer_tensors& w, const layer_acts& a, const tensor& dy,
                          tensor& dn2, layer_stash& s) override {
    const std::int64_t n = a.n2.dim(0);
    tensor dact = zeros({n, ffn_});
    be_.linear_backward_input(dy, w.out_w, dact);
    tensor dfc = zeros({n, ffn_});
    be_.gelu_backward(dact, a.fc, dfc);
    be_.linear_backward_input(dfc, w.fc_w, dn2);
    s.d_out = dy;
    s.d_fc = dfc;
  }

  void mlp_backward_weight(const layer_acts& a, const layer_stash& s, layer_tensors& g) override {
    be_.linear_backward_weight(s.d_out, a.act, g.out_w, g.out_b);
    be_.linear_backward_weight(s.d_fc, a.n2, g.fc_w, g.fc_b);
  }
};

}  // namespace

std::unique_ptr<layer_ops> make_gpt2_layer_ops(const core::model_config& cfg,
                                               kernels::backend& be, core::dtype act) {
  return std::make_unique<gpt2_layer_ops>(cfg, be, act);
}

}  // namespace troupe::model
