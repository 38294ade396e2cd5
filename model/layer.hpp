// One pre-norm transformer layer as backend ops: forward, and a backward split in two phases as
// zero-bubble schedules need — backward_input (every gradient that flows towards the layer's
// input) and backward_weight (every parameter gradient). A full backward is the two phases run
// back to back on the same layer, so the split and the unsplit backward are one code path and
// give the same bits by construction.
//
//   x ─ norm1 ─ qkv projection ─ attention ─ proj ─(+x)─ mid ─ norm2 ─ MLP ─(+mid)─ out
//
// Dropout (training only, layer_dropout): of the attention probabilities inside attention, and of
// the two residual branches (proj's and the MLP's outputs) before their residual adds. Masks are
// not stored: forward, recompute and backward redraw them from keyed streams, a pure function of
// (seed, step, global layer, site, global sequence, element) (kernels/backend.hpp, dropout_spec).
//
// The skeleton (norms, attention, residuals) is shared; the families differ in the qkv
// projection (GPT-2: fused c_attn with bias; LLaMA: q/k/v projections and RoPE) and the MLP
// (GPT-2: c_fc, GELU, c_proj; LLaMA: SwiGLU), which gpt2_layer.cpp and llama_layer.cpp supply.
//
// Tensor parallel (model/tensor_parallel.hpp): the same ops built with a layer_split compute one
// rank's heads and MLP columns, and call a layer_comm where the rank's partial results meet the
// group's — gathering rows before the column-parallel GEMMs (sequence parallel), reducing after
// the row-parallel ones and after the column-parallel input gradients.
#pragma once

#include <memory>

#include "core/config.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"

namespace troupe::model {

using core::tensor;

/// A LoRA adapter of one linear module W [out, in]: A [r, in], B [out, r]; the module computes
/// x·Wᵀ + scale·(x·Aᵀ)·Bᵀ. Undefined when the module has none.
struct lora_pair {
  tensor a, b;
  bool defined() const { return a.defined(); }
};

/// Parameters of one layer as views into a flat buffer: weights in the compute dtype for the
/// ops, or fp32 gradients. Fields a family does not use, and gradients of frozen weights, stay
/// undefined.
struct layer_tensors {
  tensor norm1_w, norm1_b;  // ln_1 / input_layernorm (bias: GPT-2 only)
  tensor qkv_w, qkv_b;      // GPT-2 attn.c_attn
  tensor q_w, k_w, v_w;     // LLaMA self_attn.{q,k,v}_proj
  tensor proj_w, proj_b;    // attn.c_proj / self_attn.o_proj
  tensor norm2_w, norm2_b;  // ln_2 / post_attention_layernorm
  tensor fc_w, fc_b;        // mlp.c_fc / mlp.gate_proj
  tensor up_w;              // LLaMA mlp.up_proj
  tensor out_w, out_b;      // mlp.c_proj / mlp.down_proj
  // LoRA adapters of the linear modules above (their names plus .lora_A / .lora_B).
  lora_pair qkv_l;          // GPT-2 c_attn
  lora_pair q_l, k_l, v_l;  // LLaMA q/k/v_proj
  lora_pair proj_l, fc_l, up_l, out_l;
  // Gradient views only: the chunk did not zero the linear weights' gradients (and their biases)
  // for this step, so their weight-gradient GEMMs write instead of adding (chunk.cpp, zero_grads).
  bool fresh = false;
};

/// Final norm and LM head.
struct head_tensors {
  tensor norm_w, norm_b;  // ln_f / model.norm (bias: GPT-2 only)
  tensor head_w;          // lm_head.weight [V, C]
  bool fresh = false;     // gradient views: head_w's gradient is written (layer_tensors::fresh)
};

/// Token embedding and (GPT-2) position embedding.
struct embedding_tensors {
  tensor wte, wpe;
};

/// The dropout sites of a layer (the embedding's is the chunk's). Part of a stream's key.
enum class dropout_site : std::uint64_t { embedding = 1, attention = 2, attention_out = 3, mlp_out = 4 };

/// Where one training micro-batch draws its dropout masks: the rates (model.attention_dropout,
/// model.hidden_dropout), the key of the step's streams and the global index of the micro-batch's
/// first sequence. Default: no dropout (evaluation, generation, rates 0).
struct dropout_ctx {
  float attention = 0, hidden = 0;
  std::uint64_t step_key = 0;
  std::int64_t first_sample = 0;
  bool on() const { return attention > 0 || hidden > 0; }
  /// The mask of `site` of global layer `layer` (rate 0: off).
  kernels::dropout_spec at(int layer, dropout_site site) const;
};

/// The dropout context of a training micro-batch of `cfg` at `step` whose first sequence is
/// global sequence `first_sample` (the loader's numbering, model/loader.hpp): streams keyed by
/// (seed, step), then layer and site. Rates 0 give a context that draws nothing.
dropout_ctx training_dropout(const core::model_config& cfg, std::uint64_t seed, std::int64_t step,
                             std::int64_t first_sample);

/// The masks one layer draws for one micro-batch (each off when its rate is 0).
struct layer_dropout {
  kernels::dropout_spec attention;      // the attention probabilities
  kernels::dropout_spec attention_out;  // proj's output, before the residual add
  kernels::dropout_spec mlp_out;        // the MLP's output, before the residual add
};

/// Packed documents of one micro-batch (model/loader.hpp, batch::doc_starts), int32 [N] each on
/// the backend's device: where each row's document begins in its sequence (attention sees keys
/// from there: kernels::attention_dims::doc_start) and the row's position within its document
/// (GPT-2's position embedding, LLaMA's RoPE angle). Undefined when the rows are one document
/// each (plain causal attention at position row % T).
struct doc_rows {
  tensor start;
  tensor positions;
  bool on() const { return start.defined(); }
};

/// What one layer keeps of one micro-batch for its backward. Undefined = not held.
struct layer_acts {
  layer_dropout drop;          // the masks forward drew, redrawn by recompute and backward
  doc_rows docs;               // the micro-batch's documents (shared handles, not counted)
  tensor x;                    // layer input
  tensor n1, mean1, rstd1;     // norm1 output and statistics (mean: LayerNorm only)
  tensor qkv;                  // attention input (after RoPE for LLaMA)
  tensor att, lse;             // attention output and log-sum-exp: the "attention internals"
  tensor mid;                  // residual stream after attention
  tensor n2, mean2, rstd2;     // norm2 output and statistics
  tensor fc, up;               // MLP pre-activations (GPT-2 c_fc; LLaMA gate and up)
  tensor act;                  // MLP activation, the output projection's input (LLaMA always;
                               // GPT-2 only with keep_act, otherwise it recomputes gelu(fc) in
                               // the weight phase: one [N, 4C] tensor per layer instead of two)
  bool keep_act = false;       // GPT-2: set before forward to keep act (recompute.keep_gelu)

  /// Every field, for memory accounting and release.
  template <class F>
  void each(F&& f) {
    for (tensor* t : {&x, &n1, &mean1, &rstd1, &qkv, &att, &lse, &mid, &n2, &mean2, &rstd2, &fc,
                      &up, &act})
      f(*t);
  }
};

/// Output gradients of the layer's parametrised ops, kept from backward_input for
/// backward_weight. Undefined = not held.
struct layer_stash {
  tensor d_out;   // d out: the MLP output projection's dy
  tensor d_fc;    // dy of c_fc / gate_proj
  tensor d_up;    // dy of up_proj
  tensor d_n2;    // dy of norm2
  tensor d_mid;   // d mid: the attention output projection's dy
  tensor d_qkv;   // dy of the qkv projection (before RoPE)
  tensor d_n1;    // dy of norm1
  tensor d_qkv_b;  // Σ_rows d_qkv (fp32), GPT-2's qkv bias gradient from the attention backward
  bool norms_done = false;  // norm weight gradients were accumulated in backward_input
  // Set by the caller of backward_input: the qkv bias gradient is wanted (not frozen).
  bool sum_qkv_bias = false;

  template <class F>
  void each(F&& f) {
    for (tensor* t : {&d_out, &d_fc, &d_up, &d_n2, &d_mid, &d_qkv, &d_n1, &d_qkv_b}) f(*t);
  }
};

/// Where the rows of a cached forward (generation) sit: their cache slots and positions, int32
/// [R] each on the backend's device (kernels/backend.hpp, "inference with a key/value cache").
struct cache_rows {
  tensor slots, positions;
};

/// One layer's key and value caches, [slots, positions, Hkv * D] in the activation dtype.
struct layer_cache {
  tensor k, v;
};

/// What one rank of a tensor-parallel group holds of a layer (model/tensor_parallel.hpp).
struct layer_split {
  int heads = 0;              // query heads of this rank
  int kv_heads = 0;           // key/value heads of this rank
  int first_head = 0;         // global index of its first query head
  int ffn = 0;                // MLP width of this rank
  bool kv_replicated = false; // fewer key/value heads than ranks: each rank holds the one its
                              // query heads read, and ranks sharing it sum its gradient
};

/// Which op of a chunk a layer_comm's next collectives belong to (their tags follow from it).
enum class comm_op : std::uint32_t {
  forward = 1,
  backward_input = 2,
  backward_weight = 3,
  recompute = 4,
  embedding_forward = 5,
  embedding_backward = 6,
  loss = 7,
  head_backward = 8,         // the final norm's weight gradients (sequence parallel)
  recompute_embedding = 9,   // the embedding, and the loss, of a whole-chunk recompute
  recompute_loss = 10,
};

/// Where a layer split across a tensor-parallel group communicates. Every rank of the group
/// makes the same calls in the same order (tags follow from the order, model/tensor_parallel.hpp).
/// Tensors are rows [n, C] on the layer's backend.
class layer_comm {
 public:
  virtual ~layer_comm() = default;
  /// This rank's position in the group, and the group's size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Sequence parallel: the residual stream holds rows [rank * n, (rank + 1) * n) of the
  /// micro-batch's size * n rows on each rank.
  virtual bool sequence_parallel() const = 0;
  /// Before a column-parallel GEMM: every rank's rows in group order (sequence parallel), or x.
  virtual tensor gather_rows(const tensor& x) = 0;
  /// After a row-parallel GEMM (forward) or a column-parallel GEMM's input gradient (backward):
  /// the sum over the group, or this rank's rows of it (sequence parallel).
  virtual tensor reduce_rows(const tensor& x) = 0;
  /// The sum over the group (norm weight gradients under sequence parallel).
  virtual tensor all_reduce(const tensor& x) = 0;
  /// Every rank's x flattened and concatenated in group order, whatever sequence_parallel says.
  virtual tensor all_gather(const tensor& x) = 0;
  /// The sum over the ranks that hold the same replicated key/value heads.
  virtual tensor all_reduce_kv(const tensor& x) = 0;
  /// Names the op whose collectives come next: global layer `layer` (-1 the embedding, -2 the
  /// head) of micro-batch `micro_batch`. A model::chunk calls it before each op; a group that
  /// needs no names ignores it.
  virtual void begin_op(int layer, int micro_batch, comm_op op) {
    (void)layer, (void)micro_batch, (void)op;
  }
};

/// The ops of one model family. One instance serves all layers of a chunk; it holds only
/// scratch, never per-micro-batch state.
class layer_ops {
 public:
  /// `act` is the activation dtype (the compute precision). With `split` and `comm`, the ops
  /// compute one tensor-parallel rank's part of each layer (model/tensor_parallel.hpp).
  layer_ops(const core::model_config& cfg, kernels::backend& be, core::dtype act,
            const layer_split* split = nullptr, layer_comm* comm = nullptr);
  virtual ~layer_ops() = default;

  /// Runs the layer on x [N, C] and returns its output; `a` receives every activation and the
  /// masks `drop` (none by default).
  tensor forward(const layer_tensors& w, const tensor& x, layer_acts& a,
                 const layer_dropout& drop = {}, const doc_rows& docs = {});
  /// Inference with a key/value cache: the layer on rows x [R, C] at the slots and positions
  /// `at` names, their keys and values written into `c` and attention read from it. The same ops
  /// as forward but for attention (and RoPE at the rows' positions); nothing is kept.
  tensor forward_cached(const layer_tensors& w, const tensor& x, const cache_rows& at,
                        layer_cache& c);
  /// Recomputes a.att and a.lse from a.qkv (selective recompute dropped them).
  void recompute_attention(layer_acts& a);
  /// Gradient w.r.t. the layer input from dy = d out; fills `s` for backward_weight. When
  /// `norm_grads` is given, the norm weight gradients are accumulated into it right away (one
  /// norm backward instead of two when the weight phase follows immediately).
  tensor backward_input(const layer_tensors& w, layer_acts& a, const tensor& dy, layer_stash& s,
                        layer_tensors* norm_grads);
  /// Accumulates every parameter gradient of the layer into g from a and s.
  void backward_weight(const layer_tensors& w, const layer_acts& a, const layer_stash& s,
                       layer_tensors& g);
  /// After backward_input: drops the activations backward_weight does not read.
  void keep_for_weight(layer_acts& a) const;

  /// The family's norm (GPT-2 LayerNorm with bias, LLaMA RMSNorm); mean/b unused for RMSNorm.
  void norm_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y, tensor& mean,
                    tensor& rstd);
  /// Norm backward: dx += ..., dw (and db) += ....
  void norm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                     const tensor& rstd, tensor& dx, tensor& dw, tensor& db);
  /// Norm backward of a pre-norm block: dx = residual + ... (written), dw (and db) += ..., and
  /// rsum += Σ_rows residual when rsum is defined (LayerNorm only).
  void norm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                              const tensor& mean, const tensor& rstd, const tensor& residual,
                              tensor& dx, tensor& dw, tensor& db, tensor& rsum);
  /// Whether the bias gradients of the two projections that end in the residual stream (proj_b
  /// and out_b) come from the norms' backward instead of the weight phase's GEMMs: GPT-2 on one
  /// rank without hidden dropout, where a projection's output gradient is the residual
  /// stream's gradient that the next norm's backward reads anyway (one pass over [N, C] less
  /// per projection). Those biases then accumulate into zeroed gradients (model/chunk.cpp).
  bool branch_bias_from_norm() const { return branch_bias_; }
  /// Allocates norm statistics for n rows into mean (LayerNorm only) and rstd.
  void norm_stats(std::int64_t n, tensor& mean, tensor& rstd);

  /// y = dropout of hidden rows x [n, C] (y may alias x); under sequence parallel x holds this
  /// rank's rows of the micro-batch and the mask is the whole micro-batch's.
  void dropout_hidden(const tensor& x, const kernels::dropout_spec& drop, tensor& y);

  /// An activation-dtype buffer whose contents will be overwritten.
  tensor alloc(const core::shape_t& shape) { return alloc(shape, act_); }
  tensor alloc(const core::shape_t& shape, core::dtype t);
  /// A zero-filled buffer (backward ops accumulate into their outputs).
  tensor zeros(const core::shape_t& shape) { return zeros(shape, act_); }
  tensor zeros(const core::shape_t& shape, core::dtype t);

  kernels::backend& be() { return be_; }
  core::dtype act() const { return act_; }

 protected:
  /// qkv [N, (H + 2 Hkv) D] from the norm1 output, in the layout attention expects; rows sit at
  /// row % seq_length, or at `positions` (int32 [N]) when given.
  virtual tensor qkv_forward(const layer_tensors& w, const tensor& n1,
                             const tensor* positions) = 0;
  /// dn1 = gradient through the qkv projection from d qkv (dn1 is written, not accumulated);
  /// keeps its dy in s.d_qkv.
  /// `positions`: the rows' positions (packed documents), or null for row % T.
  virtual void qkv_backward_input(const layer_tensors& w, const tensor& dqkv, tensor& dn1,
                                  layer_stash& s, const tensor* positions) = 0;
  virtual void qkv_backward_weight(const layer_tensors& w, const layer_acts& a,
                                   const layer_stash& s, layer_tensors& g) = 0;
  /// The MLP of the norm2 output a.n2 plus the residual a.mid: returns a.mid + MLP(a.n2) [N, C]
  /// and keeps the MLP's activations in a.
  virtual tensor mlp_forward(const layer_tensors& w, layer_acts& a) = 0;
  /// dn2 = gradient through the MLP from dy (written, not accumulated); keeps the dys in s.
  virtual void mlp_backward_input(const layer_tensors& w, const layer_acts& a, const tensor& dy,
                                  tensor& dn2, layer_stash& s) = 0;
  virtual void mlp_backward_weight(const layer_tensors& w, const layer_acts& a,
                                   const layer_stash& s, layer_tensors& g) = 0;
  /// keep_for_weight's MLP part: drops the MLP activations mlp_backward_weight does not read
  /// (by default the pre-activations fc and up).
  virtual void mlp_keep_for_weight(layer_acts& a) const;

  kernels::attention_dims dims(std::int64_t rows) const;
  /// residual + dropout(in · wᵀ + b + LoRA(in)) for the mask `drop` (a residual branch's end;
  /// without dropout the fused linear_forward_residual). Tensor parallel: w is row-parallel, the
  /// partial products are reduced over the group (rank 0 adds the bias, once) before the
  /// dropout and the residual add, on the residual's rows.
  tensor residual_branch(const tensor& in, const tensor& w, const tensor& b, const lora_pair& l,
                         const tensor& residual, const kernels::dropout_spec& drop);
  /// dy through a residual branch's dropout: dy itself when `drop` is off, else its masked copy.
  tensor branch_grad(const tensor& dy, const kernels::dropout_spec& drop);
  /// Norm1, then qkv (at `positions` when given); a receives x, n1 and its statistics, and qkv.
  void attention_input(const layer_tensors& w, const tensor& x, const tensor* positions,
                       layer_acts& a);
  /// From the attention output a.att on: projection and residual, norm2, the MLP.
  tensor attention_output(const layer_tensors& w, layer_acts& a);

  // LoRA (model/lora.cpp): an adapter on a linear module whose output is columns
  // [col, col + out) of y [N, Y] (col > 0 only for LLaMA's q/k/v inside the fused qkv).
  /// y[:, col:col+out] += scale·(x·Aᵀ)·Bᵀ.
  void lora_forward(const lora_pair& w, const tensor& x, tensor& y, std::int64_t col = 0);
  /// dx += scale·(dy[:, col:col+out]·B)·A.
  void lora_backward_input(const lora_pair& w, const tensor& dy, tensor& dx, std::int64_t col = 0);
  /// g.a += scale·(dy·B)ᵀ·x; g.b += dyᵀ·(scale·x·Aᵀ) (columns [col, col + out) of dy). Gradients of
  /// frozen modules are undefined and skipped, so with `w` undefined this does nothing.
  void lora_backward_weight(const lora_pair& w, const tensor& x, const tensor& dy, lora_pair& g,
                            std::int64_t col = 0);
  /// dw += dyᵀ·x, db += Σ_rows dy; written instead when `fresh` (layer_tensors::fresh).
  void weight_grad(const tensor& dy, const tensor& x, tensor& dw, tensor& db, bool fresh);

  core::model_config cfg_;
  kernels::backend& be_;
  core::dtype act_;
  int heads_, kv_heads_;    // query and key/value heads this instance computes (all, or a rank's)
  int first_head_;          // global index of the first
  bool kv_replicated_;
  layer_comm* comm_;        // null: the whole layer on one rank
  std::int64_t qkv_width_;  // (heads + 2 kv_heads) * D
  int ffn_;
  float lora_scale_;        // lora.alpha / lora.rank
  bool branch_bias_;        // branch_bias_from_norm()
  // Whether the qkv projection's bias gradient comes from the attention backward, which sums the
  // columns of the dqkv it writes (layer_stash::d_qkv_b), instead of a pass of its own over dqkv:
  // GPT-2 on one rank.
  bool qkv_bias_sum_;

 private:
  /// B placed at rows [col, col + out) of a zero [Y, r] scratch (B itself when it fills y).
  tensor padded_b(const tensor& b, std::int64_t y_cols, std::int64_t col);
  tensor b_pad_;            // compute dtype
  tensor db_pad_;           // fp32
};

/// The ops of cfg.arch.
std::unique_ptr<layer_ops> make_layer_ops(const core::model_config& cfg, kernels::backend& be,
                                          core::dtype act);
/// The family ops of one tensor-parallel rank (model/tensor_parallel.hpp: make_tp_layer_ops).
std::unique_ptr<layer_ops> make_layer_ops(const core::model_config& cfg, kernels::backend& be,
                                          core::dtype act, const layer_split& split,
                                          layer_comm& comm);
std::unique_ptr<layer_ops> make_gpt2_layer_ops(const core::model_config& cfg,
                                               kernels::backend& be, core::dtype act,
                                               const layer_split* split = nullptr,
                                               layer_comm* comm = nullptr);
std::unique_ptr<layer_ops> make_llama_layer_ops(const core::model_config& cfg,
                                                kernels::backend& be, core::dtype act,
                                                const layer_split* split = nullptr,
                                                layer_comm* comm = nullptr);

}  // namespace troupe::model
