// Defaults of the fused backend ops (backend.hpp, "fused variants"): each is the composition of
// the plain ops it stands for, so a backend that does not fuse (the CPU reference) gets them for
// free and computes the same values as the unfused sequence the model ran before. The same holds
// for sumsq_blocks_list, the batched form of sumsq_blocks: one call per tensor.
#include "core/error.hpp"
#include "kernels/backend.hpp"

namespace troupe::kernels {

void backend::sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out) {
  std::int64_t total = 0;
  for (const tensor& x : xs) total += (x.numel() + norm_block - 1) / norm_block;
  TROUPE_CHECK(out.defined() && out.type() == core::dtype::f64 && out.numel() == total,
               "sumsq_blocks_list: out must be f64 with " + std::to_string(total) +
                   " elements (the blocks of every tensor)");
  std::int64_t at = 0;
  for (const tensor& x : xs) {
    const std::int64_t nb = (x.numel() + norm_block - 1) / norm_block;
    if (nb == 0) continue;
    tensor part = out.slice(at, {nb});
    sumsq_blocks(x, part);
    at += nb;
  }
}

void backend::linear_forward_residual(const tensor& x, const tensor& w, const tensor& b,
                                      const tensor& r, tensor& y) {
  // The linear output is written before the add reads r: r must be another buffer.
  TROUPE_CHECK(!y.defined() || !r.defined() || y.raw() != r.raw(),
               "linear_forward_residual: y must not alias the residual r");
  linear_forward(x, w, b, y);
  add(y, r, y);
}

void backend::linear_gelu_forward(const tensor& x, const tensor& w, const tensor& b, tensor& pre,
                                  tensor& y) {
  linear_forward(x, w, b, pre);
  gelu_forward(pre, y);
}

void backend::linear_backward_input_write(const tensor& dy, const tensor& w, tensor& dx) {
  zero(dx);
  linear_backward_input(dy, w, dx);
}

void backend::linear_backward_weight_write(const tensor& dy, const tensor& x, tensor& dw,
                                           tensor& db) {
  zero(dw);
  if (db.defined()) zero(db);
  linear_backward_weight(dy, x, dw, db);
}

void backend::linear_backward_input_gelu(const tensor& dy, const tensor& w, const tensor& pre,
                                         tensor& dx) {
  tensor d_act = empty(dx.shape(), dx.type());
  linear_backward_input_write(dy, w, d_act);
  zero(dx);
  gelu_backward(d_act, pre, dx);
}

void backend::layernorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                          const tensor& mean, const tensor& rstd,
                                          const tensor& residual, tensor& dx, tensor& dw,
                                          tensor& db, tensor& rsum) {
  TROUPE_CHECK(!dx.defined() || !residual.defined() || dx.raw() != residual.raw(),
               "layernorm_backward_residual: dx must not alias the residual");
  copy(residual, dx);
  layernorm_backward(dy, x, w, mean, rstd, dx, dw, db);
  if (rsum.defined()) sum_rows(residual, rsum);
}

void backend::rmsnorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                        const tensor& rstd, const tensor& residual, tensor& dx,
                                        tensor& dw) {
  TROUPE_CHECK(!dx.defined() || !residual.defined() || dx.raw() != residual.raw(),
               "rmsnorm_backward_residual: dx must not alias the residual");
  copy(residual, dx);
  rmsnorm_backward(dy, x, w, rstd, dx, dw);
}

void backend::attention_backward_write(const tensor& dout, const tensor& qkv, const tensor& out,
                                       const tensor& lse, const attention_dims& d, tensor& dqkv,
                                       tensor& dsum) {
  zero(dqkv);
  attention_backward(dout, qkv, out, lse, d, dqkv);
  if (!dsum.defined()) return;
  zero(dsum);
  sum_rows(dqkv, dsum);
}

}  // namespace troupe::kernels
