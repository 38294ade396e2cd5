// The launchers of kernels/cuda/*.cu, one group per op file. Each takes the tensors of the matching
// backend method (already on this device), checks shapes and dtypes, launches on the given stream
// (or the context's stream when it needs scratch memory or cuBLASLt) and checks the launch.
// Semantics are those of kernels/backend.hpp; backward launchers accumulate (+=).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

// convert.cu
void launch_convert(const tensor& src, tensor& dst, cudaStream_t s);

// linear.cu
void launch_linear_forward(context& ctx, const tensor& x, const tensor& w, const tensor& b,
                           tensor& y);
void launch_linear_backward_input(context& ctx, const tensor& dy, const tensor& w, tensor& dx);
void launch_linear_backward_weight(context& ctx, const tensor& dy, const tensor& x, tensor& dw,
                                   tensor& db);
// linear.cu, fused variants (backend.hpp): outputs written, not accumulated
void launch_linear_forward_residual(context& ctx, const tensor& x, const tensor& w,
                                    const tensor& b, const tensor& r, tensor& y);
void launch_linear_gelu_forward(context& ctx, const tensor& x, const tensor& w, const tensor& b,
                                tensor& pre, tensor& y);
void launch_linear_backward_input_write(context& ctx, const tensor& dy, const tensor& w,
                                        tensor& dx);
void launch_linear_backward_input_gelu(context& ctx, const tensor& dy, const tensor& w,
                                       const tensor& pre, tensor& dx);

// embedding.cu
void launch_embedding_forward(const tensor& tokens, const tensor& wte, const tensor& wpe, int seq,
                              tensor& out, cudaStream_t s);
void launch_embedding_backward(context& ctx, const tensor& dout, const tensor& tokens, int seq,
                               tensor& dwte, tensor& dwpe);

// layernorm.cu
void launch_layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps,
                              tensor& y, tensor& mean, tensor& rstd, cudaStream_t s);
/// dx += LayerNorm's input gradient, or, with a residual, dx = *residual + that gradient (written).
void launch_layernorm_backward(context& ctx, const tensor& dy, const tensor& x, const tensor& w,
                               const tensor& mean, const tensor& rstd, tensor& dx, tensor& dw,
                               tensor& db, const tensor* residual = nullptr);

// rmsnorm.cu
void launch_rmsnorm_forward(const tensor& x, const tensor& w, float eps, tensor& y, tensor& rstd,
                            cudaStream_t s);
void launch_rmsnorm_backward(context& ctx, const tensor& dy, const tensor& x, const tensor& w,
                             const tensor& rstd, tensor& dx, tensor& dw);

// gelu.cu
void launch_gelu_forward(const tensor& x, tensor& y, cudaStream_t s);
void launch_gelu_backward(const tensor& dy, const tensor& x, tensor& dx, cudaStream_t s);
/// d = d · GELU'(x) in place.
void launch_gelu_backward_scale(const tensor& x, tensor& d, cudaStream_t s);

// swiglu.cu
void launch_swiglu_forward(const tensor& gate, const tensor& up, tensor& y, cudaStream_t s);
void launch_swiglu_backward(const tensor& dy, const tensor& gate, const tensor& up, tensor& dgate,
                            tensor& dup, cudaStream_t s);

// residual.cu
void launch_add(const tensor& a, const tensor& b, tensor& y, cudaStream_t s);
void launch_accumulate(const tensor& x, tensor& y, cudaStream_t s);
void launch_scale(tensor& x, float factor, cudaStream_t s);

// rope.cu
void launch_rope_forward(const tensor& x, int seq, int heads_total, int rot_heads, int head_dim,
                         float theta, tensor& y, cudaStream_t s);
void launch_rope_backward(const tensor& dy, int seq, int heads_total, int rot_heads, int head_dim,
                          float theta, tensor& dx, cudaStream_t s);

// attention.cu
void launch_attention_forward(context& ctx, const tensor& qkv, const attention_dims& d, tensor& out,
                              tensor& lse);
/// Adds the gradient to dqkv, or writes it (`accumulate` false: dqkv's old contents are ignored).
void launch_attention_backward(context& ctx, const tensor& dout, const tensor& qkv,
                               const tensor& out, const tensor& lse, const attention_dims& d,
                               tensor& dqkv, bool accumulate = true);

// cross_entropy.cu
void launch_cross_entropy(tensor& logits, const tensor& targets, tensor& losses, float grad_scale,
                          cudaStream_t s);

// adamw.cu
void launch_sumsq_blocks(const tensor& x, tensor& out, cudaStream_t s);
void launch_sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out, cudaStream_t s);
// exact_sum.cu
void launch_exact_sum_add(const tensor& values, tensor& acc, cudaStream_t s);
void launch_clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip, tensor& out,
                        cudaStream_t s);
void launch_adamw(tensor& param, const tensor& grad, tensor& m, tensor& v, const adamw_params& p,
                  tensor& low, cudaStream_t s);
void launch_adamw_runs(tensor& param, const tensor& grad, tensor& m, tensor& v,
                       const std::vector<adamw_run>& runs, const adamw_params& p, tensor& low,
                       cudaStream_t s);
bool launch_has_nonfinite(context& ctx, const tensor& x);

// message_hash.cu
/// The message hash of x's bytes (kernels/message_hash.hpp), queued on ctx.stream; get() waits.
std::shared_ptr<pending_value> launch_message_hash(context& ctx, const tensor& x);

}  // namespace troupe::kernels::cuda
