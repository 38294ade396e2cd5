// LoRA adapters on a layer's linear modules, composed of the backend's linear ops (no kernel of
// their own, so every backend runs them): a module W [out, in] with adapter A [r, in], B [out, r]
// computes x·Wᵀ + s·(x·Aᵀ)·Bᵀ with s = alpha / r. B starts at zero, so the adapter's output is
// ±0 and adding it leaves the base model's activations — and its loss — bit for bit unchanged.
//
// The backward follows the layer's two phases: backward_input adds s·(dy·B)·A to the module's
// input gradient; backward_weight recomputes the small [N, r] products (x·Aᵀ and dy·B) from what
// the layer keeps anyway, so an adapter adds no saved activation. LLaMA's q/k/v projections run as
// one fused GEMM whose output columns are [q | k | v]: their adapters write a column block of it,
// done with B placed in the rows of a zero [Y, r] matrix (the extra rows cost r·Y multiply-adds
// per row, small next to the base GEMM), so every operand stays contiguous.
#include "core/error.hpp"
#include "model/layer.hpp"

namespace troupe::model {

tensor layer_ops::padded_b(const tensor& b, std::int64_t y_cols, std::int64_t col) {
  if (col == 0 && b.dim(0) == y_cols) return b;
  TROUPE_CHECK(col >= 0 && col + b.dim(0) <= y_cols,
               "LoRA B with " + std::to_string(b.dim(0)) + " rows at column " +
                   std::to_string(col) + " of a " + std::to_string(y_cols) + "-column output");
  const core::shape_t shape{y_cols, b.dim(1)};
  if (!b_pad_.defined() || b_pad_.shape() != shape || b_pad_.type() != b.type())
    b_pad_ = alloc(shape, b.type());
  be_.zero(b_pad_);
  tensor rows = b_pad_.rows(col, col + b.dim(0));
  be_.copy(b, rows);
  return b_pad_;
}

void layer_ops::lora_forward(const lora_pair& w, const tensor& x, tensor& y, std::int64_t col) {
  if (!w.defined()) return;
  const std::int64_t n = x.dim(0);
  tensor h = alloc({n, w.a.dim(0)});
  be_.linear_forward(x, w.a, {}, h);
  be_.scale(h, lora_scale_);
  const tensor b = padded_b(w.b, y.dim(1), col);
  tensor delta = alloc({n, y.dim(1)});
  be_.linear_forward(h, b, {}, delta);
  be_.accumulate(delta, y);
}

void layer_ops::lora_backward_input(const lora_pair& w, const tensor& dy, tensor& dx,
                                    std::int64_t col) {
  if (!w.defined()) return;
  const tensor b = padded_b(w.b, dy.dim(1), col);
  tensor dh = alloc({dy.dim(0), w.a.dim(0)});
  be_.linear_backward_input_write(dy, b, dh);
  be_.scale(dh, lora_scale_);
  be_.linear_backward_input(dh, w.a, dx);
}

void layer_ops::weight_grad(const tensor& dy, const tensor& x, tensor& dw, tensor& db,
                            bool fresh) {
  if (fresh)
    be_.linear_backward_weight_write(dy, x, dw, db);
  else
    be_.linear_backward_weight(dy, x, dw, db);
}

void layer_ops::lora_backward_weight(const lora_pair& w, const tensor& x, const tensor& dy,
                                     lora_pair& g, std::int64_t col) {
  if (!w.defined() || !g.defined()) return;
  const std::int64_t n = x.dim(0), r = w.a.dim(0);
  tensor none;
  const tensor b = padded_b(w.b, dy.dim(1), col);
  tensor dh = alloc({n, r});
  be_.linear_backward_input_write(dy, b, dh);
  be_.scale(dh, lora_scale_);
  be_.linear_backward_weight(dh, x, g.a, none);
  tensor h = alloc({n, r});
  be_.linear_forward(x, w.a, {}, h);
  be_.scale(h, lora_scale_);
  if (col == 0 && g.b.dim(0) == dy.dim(1)) {
    be_.linear_backward_weight(dy, h, g.b, none);
    return;
  }
  const core::shape_t shape{dy.dim(1), r};
  if (!db_pad_.defined() || db_pad_.shape() != shape)
    db_pad_ = alloc(shape, core::dtype::f32);
  be_.linear_backward_weight_write(dy, h, db_pad_, none);
  be_.accumulate(db_pad_.rows(col, col + g.b.dim(0)), g.b);
}

}  // namespace troupe::model
