// The backend interface: every op of both model families as forward/backward, plus the memory and
// optimizer primitives the runtime needs. The CPU backend (kernels/cpu/) is the reference; the CUDA
// backend (kernels/cuda/) implements the same interface and is tested against it.
//
// Conventions (all backends):
//  - Tensors are contiguous, row-major, and live on the backend's device.
//  - Activations are `N = B*T` rows; heads are laid out [B, T, heads, head_dim].
//  - Every backward ACCUMULATES (+=) into each gradient it produces, input gradients included;
//    callers zero buffers first. This keeps residual branches and gradient accumulation across
//    micro-batches a single code path, so results do not depend on how a model is split.
//  - Deterministic: no floating-point atomics in reductions (exact_sum_add adds integers, whose sum
//    does not depend on the order), so the same inputs give the same bits every time.
//  - Shape errors throw core::failure naming the op and the shapes.
//  - The CPU backend computes in fp32 only; the CUDA backend also takes bf16/fp16 activations and
//    weights with fp32 accumulation. Optimizer state and master weights are always fp32.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/rope_freq.hpp"

namespace troupe::kernels {

using core::tensor;

/// An inverted dropout's mask (core/philox.hpp): element `within` of global sample `sample` is
/// kept, and multiplied by 1/(1 − p), when dropout_bits(key, sample, within) >=
/// dropout_threshold(p). A pure function of these numbers, so every backend, split, schedule and
/// recompute draws the same mask. p = 0 is no dropout at all.
struct dropout_spec {
  float p = 0;                    // drop probability, 0 <= p < 1
  std::uint64_t key = 0;          // the stream: (seed, step, layer, site), model/layer.hpp
  std::int64_t first_sample = 0;  // global index of the first sequence the tensor holds
  bool on() const { return p > 0; }
};

struct attention_dims {
  int batch = 0;      // B
  int seq = 0;        // T
  int heads = 0;      // H (query heads)
  int kv_heads = 0;   // Hkv; H % Hkv == 0 (grouped-query attention)
  int head_dim = 0;   // D
  /// Dropout of the attention probabilities (off by default): probability p_tj of query t of
  /// head h of sequence b is element (h·T + t)·T + j of sample first_sample + b. Only backends
  /// that implement it accept p > 0 (the CPU); the others throw.
  dropout_spec dropout{};
  /// The global index of head 0 for the dropout mask: a tensor-parallel rank computes heads
  /// dropout_first_head .. + heads - 1 of the whole layer and draws their masks.
  int dropout_first_head = 0;
  /// Documents packed in a row (model/loader.hpp, batch::doc_starts): when defined, int32 [B*T] on
  /// the backend's device, doc_start[b*T + t] = where the document of query t begins in its row;
  /// key j is then visible to query t iff doc_start[b*T + t] <= j <= t (causal within the
  /// document). Undefined: plain causal attention (every doc_start 0, the same bits). Only
  /// backends that implement it accept it (the CPU and CUDA); the others throw.
  tensor doc_start{};
};

struct adamw_params {
  float lr = 0;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0;  // decoupled: p -= lr * wd * p
  float grad_scale = 1;    // gradients are multiplied by this first (clipping, loss-scale undo)
  int step = 1;            // 1-based, for bias correction
  /// When defined: f64 [1] on the backend's device holding a float value (clip_factor's factor)
  /// that replaces grad_scale; when that value is not finite nothing is updated (the step is
  /// skipped without the host reading the norm first).
  tensor grad_factor{};
  /// When defined: f32 [3] {lr, bc1, bc2} on the backend's device replacing lr and the bias
  /// corrections of `step` (adamw_bias_correction(beta1, step), (beta2, step)): a replayed graph's
  /// AdamW follows the schedule.
  tensor schedule{};
};

/// AdamW's bias correction 1 − β^step, computed in double and rounded to float, as every backend
/// uses it.
inline float adamw_bias_correction(float beta, std::int64_t step) {
  return static_cast<float>(1.0 - std::pow(static_cast<double>(beta), static_cast<double>(step)));
}

/// One range [begin, end) of elements of flat optimizer buffers for `adamw_runs`, and whether
/// weight decay applies to it.
struct adamw_run {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  bool decay = true;
};

/// Elements per block of `sumsq_blocks`. Tensors are laid out in flat buffers at multiples of this,
/// so that any partition of a buffer on block boundaries (pipeline splits, ZeRO shards) yields the
/// same per-block partial sums and therefore the same global norm, bit for bit.
inline constexpr std::int64_t norm_block = 1024;

/// A 64-bit result the device computes and the host reads later (message hashes).
class pending_value {
 public:
  virtual ~pending_value() = default;
  /// Waits for the work that computes the value, then returns it.
  virtual std::uint64_t get() = 0;
};

/// A point in a backend's queued work (mark_time); mark_times says when the device reached it.
class time_mark {
 public:
  virtual ~time_mark() = default;
};

/// The logits' row width of the CUDA backend for `classes` classes (backend::logits_width): the
/// next multiple of 64.
inline std::int64_t cuda_logits_width(std::int64_t classes) { return (classes + 63) / 64 * 64; }

class backend {
 public:
  virtual ~backend() = default;
  virtual core::device dev() const = 0;
  virtual std::string name() const = 0;

  // --- memory ---------------------------------------------------------------------------------
  /// Uninitialised tensor on this device (CPU: zero-filled).
  virtual tensor empty(const core::shape_t& shape, core::dtype t) = 0;
  virtual void zero(tensor& x) = 0;
  /// Copy between any two tensors of equal byte size on this device or the host.
  virtual void copy(const tensor& src, tensor& dst) = 0;
  /// Element type conversion (f32 <-> bf16/f16) of equally shaped tensors.
  virtual void convert(const tensor& src, tensor& dst) = 0;
  /// Wait for all work this backend queued.
  virtual void synchronize() = 0;
  /// Host copy of a tensor (synchronises).
  tensor to_host(const tensor& x);
  /// Device copy of a host tensor.
  tensor from_host(const tensor& host);

  // --- dense ------------------------------------------------------------------------------------
  /// y[N,OC] = x[N,IC] · w[OC,IC]ᵀ (+ b[OC] when b is defined). Overwrites y.
  /// Padded rows (the LM head's logits, see logits_width): y may be [N, W] with W > OC and no b;
  /// then columns OC..W of y are set to −∞, logits that cross_entropy gives zero probability and
  /// zero gradient. Only a backend whose logits_width pads accepts them.
  virtual void linear_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y) = 0;
  /// dx[N,IC] += dy[N,OC] · w[OC,IC]. dy may have padded rows [N, W > OC]: columns past OC are
  /// not read.
  virtual void linear_backward_input(const tensor& dy, const tensor& w, tensor& dx) = 0;
  /// dw[OC,IC] += dyᵀ · x; db[OC] += Σ_rows dy (when db is defined). dy may have padded rows
  /// [N, W > OC] when db is not defined: columns past OC are not read.
  virtual void linear_backward_weight(const tensor& dy, const tensor& x, tensor& dw, tensor& db) = 0;
  /// The row width of the logits of `classes` classes (>= classes) that the LM head computes into
  /// (model/chunk.cpp): the CUDA backend pads a width that is not a multiple of 64 (GPT-2's
  /// 50,257) to the next one, since cuBLASLt's fast kernels need aligned sizes and strides (the
  /// head's three GEMMs ran about 5x slower at 50,257 than at 50,304 on an H200). The padding is
  /// invisible outside: its logits are −∞ (linear_forward), its gradient zero (cross_entropy).
  virtual std::int64_t logits_width(std::int64_t classes) const { return classes; }

  // --- fused variants -------------------------------------------------------------------------
  // Each has a default composed of the ops above (kernels/fused_defaults.cpp), so a backend need
  // not implement them; the CUDA backend fuses them into cuBLASLt epilogues. Their outputs are
  // WRITTEN, not accumulated: the layer calls them where an output buffer is fresh, which saves
  // zeroing it first. Outputs must not alias inputs.
  /// y = x · wᵀ (+ b) + r: a linear layer ending in a residual add (r shaped like y).
  virtual void linear_forward_residual(const tensor& x, const tensor& w, const tensor& b,
                                       const tensor& r, tensor& y);
  /// pre = x · wᵀ (+ b), y = gelu(pre) (tanh approximation): GPT-2's c_fc and its activation.
  virtual void linear_gelu_forward(const tensor& x, const tensor& w, const tensor& b, tensor& pre,
                                   tensor& y);
  /// dx = dy · w (written, not accumulated).
  virtual void linear_backward_input_write(const tensor& dy, const tensor& w, tensor& dx);
  /// dw = dyᵀ · x; db = Σ_rows dy (when defined), both written: the first weight gradient of a
  /// step into a gradient buffer that zero_grads left unzeroed (model/chunk.cpp). Bits: those of
  /// zeroing dw and db and calling linear_backward_weight, but for the sign of zeros.
  virtual void linear_backward_weight_write(const tensor& dy, const tensor& x, tensor& dw,
                                            tensor& db);
  /// dx = (dy · w) ⊙ gelu'(pre) (written): the gradient of c_fc's output through the GELU, given
  /// the gradient dy of the next linear layer's output and its weight w.
  virtual void linear_backward_input_gelu(const tensor& dy, const tensor& w, const tensor& pre,
                                          tensor& dx);
  /// dx = residual + LayerNorm's input gradient (written; dw, db accumulate as in
  /// layernorm_backward): a pre-norm block's gradient, the residual path's and the norm's, in one
  /// pass instead of a copy and an accumulate. With `rsum` defined (float [C]), also rsum +=
  /// Σ_rows residual: the bias gradient of the projection whose output joined the residual stream
  /// there (model/layer.cpp), from the pass that reads the residual anyway. Its bits are fixed by
  /// the inputs' shapes (the CPU's are sum_rows'; the CUDA kernels add in another order).
  virtual void layernorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                           const tensor& mean, const tensor& rstd,
                                           const tensor& residual, tensor& dx, tensor& dw,
                                           tensor& db, tensor& rsum);

  // --- embeddings ---------------------------------------------------------------------------
  /// out[B*T,C] = wte[tok] (+ wpe[t] when wpe is defined, t = row % T). tokens: int32 [B*T].
  virtual void embedding_forward(const tensor& tokens, const tensor& wte, const tensor& wpe, int seq,
                                 tensor& out) = 0;
  /// dwte[tok] += dout rows (rows added in row order); dwpe[t] += dout rows.
  virtual void embedding_backward(const tensor& dout, const tensor& tokens, int seq, tensor& dwte,
                                  tensor& dwpe) = 0;

  // --- normalisation --------------------------------------------------------------------------
  /// y = (x - mean) * rstd * w + b over the last dim; saves mean[N], rstd[N] (fp32).
  virtual void layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps,
                                 tensor& y, tensor& mean, tensor& rstd) = 0;
  virtual void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                  const tensor& mean, const tensor& rstd, tensor& dx, tensor& dw,
                                  tensor& db) = 0;
  /// y = x * rstd * w, rstd = 1/sqrt(mean(x²) + eps); saves rstd[N] (fp32).
  virtual void rmsnorm_forward(const tensor& x, const tensor& w, float eps, tensor& y,
                               tensor& rstd) = 0;
  virtual void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w,
                                const tensor& rstd, tensor& dx, tensor& dw) = 0;
  /// dx = residual + RMSNorm's input gradient (written; dw accumulates as in rmsnorm_backward):
  /// layernorm_backward_residual's twin for LLaMA's pre-norm blocks.
  virtual void rmsnorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                         const tensor& rstd, const tensor& residual, tensor& dx,
                                         tensor& dw);

  // --- pointwise --------------------------------------------------------------------------------
  /// GELU, tanh approximation (GPT-2).
  virtual void gelu_forward(const tensor& x, tensor& y) = 0;
  virtual void gelu_backward(const tensor& dy, const tensor& x, tensor& dx) = 0;
  /// y = silu(gate) * up (LLaMA MLP).
  virtual void swiglu_forward(const tensor& gate, const tensor& up, tensor& y) = 0;
  /// dgate and dup written, not accumulated: the MLP's only use, where both are fresh buffers, so
  /// the backward neither zeroes them first nor reads them.
  virtual void swiglu_backward(const tensor& dy, const tensor& gate, const tensor& up,
                               tensor& dgate, tensor& dup) = 0;
  /// y = a + b (y may alias a).
  virtual void add(const tensor& a, const tensor& b, tensor& y) = 0;
  /// y += x.
  virtual void accumulate(const tensor& x, tensor& y) = 0;
  /// out[c] += Σ_r x[r, c] over the rows of x [N, C] (out fp32 [C]) in a fixed order: the bits
  /// of linear_backward_weight's db for dy = x.
  virtual void sum_rows(const tensor& x, tensor& out) = 0;
  /// x *= s.
  virtual void scale(tensor& x, float s) = 0;
  /// y = x ⊙ mask / (1 − p) for x [rows, cols] holding whole sequences of `sample_elems`
  /// elements each: element e is element e % sample_elems of sample s.first_sample + e /
  /// sample_elems (dropout_spec). y may alias x. Dropout's forward and its backward (the same
  /// spec applied to the output's gradient, written) are this one op.
  virtual void dropout(const tensor& x, const dropout_spec& s, std::int64_t sample_elems,
                       tensor& y) = 0;

  // --- attention ------------------------------------------------------------------------------
  /// Rotary position embedding, rotate-half convention (Hugging Face LLaMA): the first
  /// `rot_heads` heads of each row of qkv[B*T, heads_total*D] are rotated by position t = row % T;
  /// the other heads are copied; `rope` gives the frequencies (kernels/rope_freq.hpp). y may
  /// alias x.
  virtual void rope_forward(const tensor& x, int seq, int heads_total, int rot_heads, int head_dim,
                            const rope_spec& rope, tensor& y) = 0;
  /// dx = Rᵀ dy for rotated heads, dx = dy for the rest (written, not accumulated); dx may alias
  /// dy, which turns the attention's q/k/v gradient into its projections' in place.
  virtual void rope_backward(const tensor& dy, int seq, int heads_total, int rot_heads,
                             int head_dim, const rope_spec& rope, tensor& dx) = 0;
  /// Causal attention on fused qkv[B*T, (H + 2*Hkv)*D] (query heads, then key heads, then value
  /// heads), scale 1/sqrt(D). out[B*T, H*D]; lse[B, H, T] (fp32) is the log-sum-exp of each
  /// query's scores, the only statistic saved: the T×T matrix is never kept.
  virtual void attention_forward(const tensor& qkv, const attention_dims& d, tensor& out,
                                 tensor& lse) = 0;
  /// dqkv += gradient of attention w.r.t. qkv, given dout, the forward's out and lse.
  virtual void attention_backward(const tensor& dout, const tensor& qkv, const tensor& out,
                                  const tensor& lse, const attention_dims& d, tensor& dqkv) = 0;
  /// dqkv = that gradient (written, not accumulated; a fused variant: its default zeroes dqkv and
  /// calls attention_backward, the CUDA backend's kernels store instead of adding). With `dsum`
  /// defined (float [(H + 2*Hkv)*D]), also dsum = Σ_rows dqkv (written): the qkv projection's
  /// bias gradient (model/layer.cpp). Its bits are fixed by the shapes (the CPU's and the
  /// default's are sum_rows', the CUDA kernels may add in another order).
  virtual void attention_backward_write(const tensor& dout, const tensor& qkv, const tensor& out,
                                        const tensor& lse, const attention_dims& d, tensor& dqkv,
                                        tensor& dsum);

  // --- inference with a key/value cache (troupe generate) ---------------------------------
  // A cached forward runs rows that belong to cache slots (one slot per sequence being generated)
  // at explicit positions: `slots` and `positions` are int32 [R] on the backend's device, row r at
  // position positions[r] of slot slots[r]. A cache holds one layer's keys or values,
  // [S, P, Hkv*D] (slots × positions × kv heads), in the activation dtype. Of attention_dims
  // these ops read heads, kv_heads and head_dim only. REQUIRES (not checked on devices that would
  // have to wait to read them): 0 <= slots[r] < S, 0 <= positions[r] < P. The defaults throw:
  // a backend that generates text overrides all four.
  /// out[r] = wte[tokens[r]] (+ wpe[positions[r]] when wpe is defined): embedding_forward with
  /// explicit positions instead of row % T.
  virtual void embedding_forward_at(const tensor& tokens, const tensor& wte, const tensor& wpe,
                                    const tensor& positions, tensor& out);
  /// rope_forward with row r turned by the angle of positions[r] instead of row % T (the same
  /// angles, so the same bits as rope_forward at that position). y may alias x.
  virtual void rope_forward_at(const tensor& x, const tensor& positions, int heads_total,
                               int rot_heads, int head_dim, const rope_spec& rope, tensor& y);
  /// Training with packed documents (attention_dims::doc_start): each row at its position within
  /// its document, int32 [N] on the backend's device. The backward twins of
  /// embedding_forward_at and rope_forward_at: dwte[tokens[r]] += dout[r], dwpe[positions[r]] +=
  /// dout[r] (each table row receiving its rows in row order); dx = Rᵀ dy at positions[r]. The
  /// defaults throw: a backend that trains on packed documents overrides all of them.
  virtual void embedding_backward_at(const tensor& dout, const tensor& tokens,
                                     const tensor& positions, tensor& dwte, tensor& dwpe);
  virtual void rope_backward_at(const tensor& dy, const tensor& positions, int heads_total,
                                int rot_heads, int head_dim, const rope_spec& rope, tensor& dx);
  /// Copies the key and value heads of each row of qkv [R, (H + 2*Hkv)*D] to
  /// k_cache / v_cache [slots[r], positions[r]].
  virtual void kv_cache_write(const tensor& qkv, const tensor& slots, const tensor& positions,
                              const attention_dims& d, tensor& k_cache, tensor& v_cache);
  /// Decode attention: the query heads of row r of qkv attend to the cached keys and values of
  /// slot slots[r] at positions 0..positions[r] (inclusive: kv_cache_write first), scale
  /// 1/sqrt(D), query head h reading kv head h / (H/Hkv). out [R, H*D]. Rows of one slot may be
  /// several consecutive positions (a prompt's prefill): causal by construction.
  virtual void attention_decode(const tensor& qkv, const tensor& slots, const tensor& positions,
                                const tensor& k_cache, const tensor& v_cache,
                                const attention_dims& d, tensor& out);

  // --- loss -----------------------------------------------------------------------------------
  /// Softmax cross-entropy fused with its backward. logits[N,V]; targets int32 [N] (a negative
  /// target is ignored: zero loss, zero gradient). Writes losses[N] (fp32, per row) and, when
  /// grad_scale != 0, overwrites logits with dloss/dlogits * grad_scale.
  virtual void cross_entropy(tensor& logits, const tensor& targets, tensor& losses,
                             float grad_scale) = 0;

  // --- vocabulary-parallel embedding and cross-entropy (model/tensor_parallel.hpp) -------------
  // A rank holds vocabulary rows [first, first + valid) of the embedding and the head; its block
  // of logits z is fp32 [n, cols], of which columns [0, valid) are real (cols − valid padding).
  // targets int32 [n], a negative one ignored. The defaults compute on host copies
  // (kernels/vocab_parallel.cpp: the CPU backend's ops, the reference of the CUDA kernels).
  /// out [n, C] (fp32) = wte[tok − first] for tokens this rank holds, else 0; plus wpe[r % seq]
  /// when wpe is defined. A token outside [0, vocab): an error on the CPU, NaN rows on the GPU.
  virtual void vp_embedding_forward(const tensor& tokens, const tensor& wte, std::int64_t first,
                                    std::int64_t valid, std::int64_t vocab, const tensor& wpe,
                                    int seq, tensor& out);
  /// dwte[tok − first] += dout rows of the tokens this rank holds (in row order), when dwte is
  /// defined; dwpe[r % seq] += every dout row, when dwpe is defined.
  virtual void vp_embedding_backward(const tensor& dout, const tensor& tokens, std::int64_t first,
                                     std::int64_t valid, int seq, tensor& dwte, tensor& dwpe);
  /// row_max [n] = the largest real logit of each row.
  virtual void vp_row_max(const tensor& z, std::int64_t valid, tensor& row_max);
  /// maxima [tp·n]: every rank's row_max in rank order; m_i is their largest. stats [2n]:
  /// Σ_{j<valid} exp(z_ij − m_i) (accumulated in fp64) and the target's logit where this rank
  /// holds it (else 0); 0 and 0 on ignored rows. A target ≥ vocab: an error on the CPU, NaN on
  /// the GPU.
  virtual void vp_row_stats(const tensor& z, std::int64_t valid, const tensor& maxima,
                            const tensor& targets, std::int64_t first, std::int64_t vocab,
                            tensor& stats);
  /// sums: stats summed over the group. losses [n] = log sums[i] + m_i − sums[n + i]; 0 on
  /// ignored rows.
  virtual void vp_losses(const tensor& maxima, const tensor& sums, const tensor& targets,
                         tensor& losses);
  /// z := d loss / d z · grad_scale, in place: exp(z_ij − m_i) · grad_scale / sums[i] on the real
  /// columns, minus grad_scale at the target's column; padding columns and ignored rows 0.
  virtual void vp_softmax_grad(tensor& z, std::int64_t valid, const tensor& maxima,
                               const tensor& sums, const tensor& targets, std::int64_t first,
                               float grad_scale);

  // --- optimizer ------------------------------------------------------------------------------
  /// Per-block sums of squares (fp64) of x (fp32), blocks of `norm_block` elements, in order:
  /// out[i] = Σ x[i*norm_block .. (i+1)*norm_block)². out: f64 [ceil(n / norm_block)].
  virtual void sumsq_blocks(const tensor& x, tensor& out) = 0;
  /// sumsq_blocks of each of xs (fp32), their blocks one after another in out: f64
  /// [Σ ceil(xs[i].numel() / norm_block)], the same bits as one sumsq_blocks per tensor. The
  /// default makes those calls; the CUDA backend does the list in one launch per 128 tensors (the
  /// global norm of a model with hundreds of parameter tensors was one launch each).
  virtual void sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out);
  /// acc += Σ values, exactly (core/exact_sum.hpp): values f64 [n], acc int64
  /// [core::exact_sum_words] holding a superaccumulator. The result's bits do not depend on how
  /// the values are split between calls, nor on their order.
  virtual void exact_sum_add(const tensor& values, tensor& acc) = 0;
  /// The clip decided on the device: out f64 [2] = {norm, factor} with norm = sqrt(the rounded
  /// sum in `sumsq`, an exact_sum_add accumulator) and factor = clip_scale(norm, grad_clip)
  /// (kernels/clip.hpp), or NaN when the norm is not finite or `guard` (another accumulator, or
  /// undefined) is not, which makes an adamw given out.slice(1) as grad_factor skip.
  virtual void clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip,
                           tensor& out) = 0;
  /// AdamW with decoupled weight decay on fp32 master params, grads, moments m and v (all same
  /// shape). When `low` is defined (bf16/f16, same shape), it receives the updated params.
  virtual void adamw(tensor& param, const tensor& grad, tensor& m, tensor& v,
                     const adamw_params& p, tensor& low) = 0;
  /// AdamW over ranges of flat buffers in one call (the whole optimizer step of a chunk): the
  /// elements of each run take `adamw` with p.weight_decay where run.decay, else 0; elements
  /// outside every run are not touched. Runs are disjoint, 0 <= begin <= end <= param.numel();
  /// low (when defined) is laid out like param. Gives the bits of one `adamw` call per run, which
  /// is what this default does; the CUDA backend makes it one launch.
  virtual void adamw_runs(tensor& param, const tensor& grad, tensor& m, tensor& v,
                          const std::vector<adamw_run>& runs, const adamw_params& p, tensor& low) {
    for (const adamw_run& r : runs) {
      if (r.begin > r.end)
        throw core::failure("adamw_runs: run [" + std::to_string(r.begin) + ", " +
                            std::to_string(r.end) + ") ends before it begins");
      const core::shape_t s{r.end - r.begin};
      tensor ps = param.slice(r.begin, s), ms = m.slice(r.begin, s), vs = v.slice(r.begin, s);
      tensor ls = low.defined() ? low.slice(r.begin, s) : tensor{};
      adamw_params q = p;
      q.weight_decay = r.decay ? p.weight_decay : 0.0f;
      adamw(ps, grad.slice(r.begin, s), ms, vs, q, ls);
    }
  }
  /// adamw_runs, and `blocks` (int64 [message_hash_blocks_of(param.bytes())]) receives the first
  /// level of the message hash of param's bytes after the update (message_hash_blocks), elements
  /// outside every run included; message_hash_of_blocks_async finishes the hash. When
  /// adamw_params::grad_factor skips the update, the blocks are still those of param. The CUDA
  /// backend hashes the parameters in registers as it writes them; this default runs adamw_runs,
  /// then hashes param (through a host copy when it lives elsewhere).
  virtual void adamw_runs_hashed(tensor& param, const tensor& grad, tensor& m, tensor& v,
                                 const std::vector<adamw_run>& runs, const adamw_params& p,
                                 tensor& low, tensor& blocks);
  /// True when any element of x (fp32/bf16/f16) is NaN or infinite.
  virtual bool has_nonfinite(const tensor& x) = 0;

  // --- graphs: a captured step replayed without the host launching each op --------------------
  // One recording per backend. While recording, ops are queued into it and do not run, and no op
  // may wait for the device (copies to or from the host, has_nonfinite, synchronize). Replays run
  // the recorded ops on the same buffers with the same arguments: what changes between replays
  // must be in device memory (adamw_params::grad_factor and ::schedule, the inputs' buffers).
  /// Starts recording, dropping any earlier recording; returns its id, or 0 (and records nothing)
  /// when the backend has no graphs (the CPU).
  virtual std::uint64_t graph_begin() { return 0; }
  /// Ends the recording (its work has not run). Throws core::failure when it could not be
  /// recorded; the backend is then as if graph_begin had not been called.
  virtual void graph_end() {}
  /// Queues recording `id`'s work once more. Throws when `id` is not the backend's recording (a
  /// later graph_begin or a graph_reset dropped it).
  virtual void graph_replay(std::uint64_t id) {
    throw core::failure(name() + " backend: no graph " + std::to_string(id) + " to replay");
  }
  /// Drops the recording and the memory only it used.
  virtual void graph_reset() {}
  /// Id of the recording a graph_replay would run, 0 when none.
  virtual std::uint64_t graph_current() const { return 0; }

  // --- hand-off between backends (several stages on one device) -----------------------------
  // A backend queues work on its own stream; a tensor another backend made may still be being
  // written when it arrives. The sender calls record_ready(t) before handing t over, the receiver
  // wait_ready(t) before using it; neither blocks the host. On the CPU ops finish before they
  // return, so both do nothing.
  /// Marks t's bytes ready once the work this backend queued so far has run.
  virtual void record_ready(const tensor& t) { (void)t; }
  /// Orders this backend's later work after the latest record_ready(t), and keeps t's memory from
  /// being reused by its owner before that work has run. REQUIRES: t was record_ready'd if it was
  /// made by another backend.
  virtual void wait_ready(const tensor& t) { (void)t; }
  // --- message hashes (recording, docs/replay.md) -----------------------------------------------
  /// The message hash (kernels/message_hash.hpp) of x's bytes, computed where x lives once the
  /// work this backend queued so far has run; the host does not wait for it (get() does). On the
  /// CPU (and by default, through a host copy) it is computed before returning. x must not be
  /// written by anyone before the value is read: the CUDA backend marks x ready (record_ready)
  /// after the hash, so a receiver's wait_ready also orders its writes after it. Not while
  /// recording a graph.
  virtual std::shared_ptr<pending_value> message_hash_async(const tensor& x);
  /// The message hash of `bytes` bytes whose first level is `blocks` (int64
  /// [message_hash_blocks_of(bytes)], as adamw_runs_hashed writes them), computed after the work
  /// queued so far, like message_hash_async; it reads only `blocks`.
  virtual std::shared_ptr<pending_value> message_hash_of_blocks_async(const tensor& blocks,
                                                                      std::uint64_t bytes);
  /// One read of an fp32 x for its message hash and its gradient norm: `blocks` (int64
  /// [message_hash_blocks_of(x.bytes())]) receives the first level of x's message hash, as
  /// message_hash_blocks gives it, and sums[b] (f64, one per block) the sum of squares of the first
  /// counts[b] elements of block b (counts int32, one per block, each from 0 to the block's
  /// elements; a message-hash block of fp32 is one norm block), with the bits sumsq_blocks gives
  /// for a tensor that starts at the block and holds those elements (0 for a count of 0). A
  /// gradient buffer whose tensors start at multiples of norm_block thus gives each tensor's
  /// norm blocks, in place. The CUDA backend reads x once when it is 16-byte aligned; this default
  /// hashes through a host copy and sums with sumsq_blocks_list.
  virtual void message_hash_sumsq_blocks(const tensor& x, const tensor& counts, tensor& blocks,
                                         tensor& sums);
  // --- device timelines (docs/runtime.md, "Busy and idle time on the device") -------------------
  /// A mark after the work queued so far. The host does not wait; on the CPU, whose ops finish
  /// before they return, it is the host's clock now.
  virtual std::shared_ptr<time_mark> mark_time();
  /// When the device reached each mark, on the host's steady clock (the CUDA backend anchors its
  /// events to the host clock once per call). Waits for the latest mark. Marks of this backend
  /// only.
  virtual std::vector<std::chrono::steady_clock::time_point> mark_times(
      const std::vector<std::shared_ptr<time_mark>>& marks);
  /// Peak bytes of device memory this backend held (0 where not counted: the CPU backend).
  virtual std::uint64_t peak_memory_bytes() const { return 0; }
};

}  // namespace troupe::kernels
