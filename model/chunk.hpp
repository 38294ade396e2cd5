// A model chunk: a contiguous range of transformer layers, optionally with the token embedding
// (first chunk) and the final norm, LM head and loss (last chunk). The whole model is one chunk;
// a pipeline splits it into pipeline_stage × virtual_pipeline chunks. A chunk owns its parameters
// and gradients in flat fp32 buffers (tensors at offsets aligned to kernels::norm_block, so ZeRO
// shards and grad-norm blocks are split-invariant) and the saved activations of the micro-batches
// in flight, keyed by micro-batch id.
//
// Determinism contract: for the same inputs, forward/backward of a chunk produce the same bits no
// matter how the model is split into chunks, which schedule calls them, or whether activations
// were recomputed; parameter gradients accumulate in the order backward (or backward_weight) is
// called, which the runtime keeps in micro-batch order.
//
// Tied embeddings (GPT-2): the first chunk owns "wte.weight", the last chunk owns a copy named
// "lm_head.weight" flagged `tied`. Each keeps its own gradient; the trainer / runtime sums them in
// the fixed order (embedding use, then head use) and both copies take the same update. A chunk
// that holds both uses (shares_head) has no copy: its head reads the embedding's weights and
// writes its gradient into a buffer of its own, grad("lm_head.weight"), which the sum adds into
// the embedding's; the one update is the bits each copy would take.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "model/layer.hpp"

namespace troupe::model {

using core::tensor;

/// Which part of the model a chunk holds.
struct chunk_spec {
  int first_layer = 0;
  int num_layers = 0;
  bool has_embedding = false;
  bool has_head = false;
};

/// Splits cfg.num_layers into `chunks` contiguous chunks of equal size. REQUIRES: divisible.
std::vector<chunk_spec> partition(const core::model_config& cfg, int chunks);
/// Splits cfg.num_layers into contiguous chunks of `layers[i]` layers each. REQUIRES: every
/// entry >= 1, summing to num_layers.
std::vector<chunk_spec> partition(const core::model_config& cfg, const std::vector<int>& layers);
/// The run's split: pipeline_stage x virtual_pipeline chunks as core::chunk_layers(c) says (even,
/// or uneven with parallel.stage_layers / first_stage_layers / last_stage_layers).
std::vector<chunk_spec> partition(const core::config& c);

/// One named parameter (Hugging Face naming, e.g. "h.3.attn.c_attn.weight" for GPT-2,
/// "model.layers.3.self_attn.q_proj.weight" for LLaMA) inside the chunk's flat buffers. Linear
/// weights are stored [out, in].
struct param_info {
  std::string name;
  core::shape_t shape;
  std::int64_t offset = 0;  // elements into the flat buffer; a multiple of kernels::norm_block
  std::int64_t numel = 0;
  bool decay = true;        // weight decay applies (matrices yes; norms, biases no)
  bool tied = false;        // the LM head's copy of a tied embedding
};

/// Keys and values of earlier positions for chunk::forward_cached: one layer_cache per layer of
/// the chunk, each [slots, positions, Hkv * D] in the compute dtype.
struct kv_cache {
  int slots = 0;
  int positions = 0;
  std::vector<layer_cache> layers;
};

/// Tensor parallel: the chunk is rank `rank` of a group of `size` (model/tensor_parallel.hpp).
/// Its parameters are that rank's slices (the whole chunk's names and order, shapes
/// model::shard_shape; init() draws the whole tensors and keeps the slice, so every layout starts
/// from the same weights), its layers the split ops, its embedding and loss vocabulary-parallel,
/// and `comm` (outliving the chunk) carries the group's collectives, named op by op
/// (layer_comm::begin_op). Under sequence parallel (comm->sequence_parallel()) the hidden input,
/// output and their gradients are this rank's rows of the micro-batch; tokens and targets are
/// always every row. Not with LoRA, dropout under sequence parallel, packed documents or the
/// inference entry points (forward_logits, forward_cached).
struct chunk_tp {
  int size = 1;
  int rank = 0;
  layer_comm* comm = nullptr;
};

class chunk_impl;

class chunk {
 public:
  chunk(const core::model_config& cfg, chunk_spec spec, kernels::backend& be,
        core::precision_kind precision = core::precision_kind::fp32, chunk_tp tp = {});
  ~chunk();
  chunk(chunk&&) noexcept;
  chunk& operator=(chunk&&) noexcept;

  const chunk_spec& spec() const;
  /// The tensor-parallel rank this chunk is ({1, 0, null}: the whole chunk).
  const chunk_tp& tp() const;
  /// The whole shape of parameter `name` (its shape in params() but for a tensor-parallel
  /// slice). Throws for unknown names.
  core::shape_t whole_shape(const std::string& name) const;
  /// The trainable parameters: every parameter without a [lora] table; with one, the LoRA
  /// adapters and the base parameters lora.trainable names (model::define_params). The optimizer,
  /// gradient reduction, ZeRO shards and checkpoints see only these.
  const std::vector<param_info>& params() const;
  /// Whether this chunk holds both uses of a tied embedding and its head reads the embedding
  /// itself: params() has no "lm_head.weight" (param() of that name is the embedding's, grad()
  /// the head's own gradient buffer, outside flat_grads()). Never under tensor parallel.
  bool shares_head() const;
  /// The frozen base parameters ([lora]): no gradient, no optimizer state; empty without [lora].
  const std::vector<param_info>& frozen_params() const;
  /// Flat fp32 master parameters / gradients of params() (padded; padding stays zero). The
  /// gradients are allocated when first needed (a backward, zero_grads, grad(), flat_grads()): a
  /// chunk that only evaluates holds none.
  tensor& flat_params();
  tensor& flat_grads();
  /// The low-precision working copy of flat_params() (bf16/fp16, same layout) the layers read;
  /// undefined in fp32. Whoever writes it keeps it equal to flat_params() rounded.
  tensor& flat_low();
  /// Flat fp32 frozen parameters (frozen_params() layout) and their low-precision copy; undefined
  /// when none (the copy: also in fp32).
  tensor& flat_frozen();
  tensor& flat_frozen_low();
  /// View of one parameter (trainable or frozen) / its gradient (trainable only) by name. Throws
  /// core::failure for unknown names, and grad() for a frozen one.
  tensor param(const std::string& name);
  tensor grad(const std::string& name);
  /// Whether parameter `name` is frozen. Throws for unknown names.
  bool frozen(const std::string& name) const;

  /// Deterministic initialisation: each parameter draws from the stream keyed by
  /// (seed, hash of its name), so a parameter's initial value does not depend on the split.
  /// GPT-2: N(0, init_std), residual projections N(0, init_std/sqrt(2L)), norms 1, biases 0.
  void init(std::uint64_t seed);
  /// After the master weights changed (checkpoint load, any write through param()): refresh the
  /// low-precision copies, frozen weights included.
  void params_updated();
  /// After only the trainable weights changed (an optimizer step): refresh their copy.
  void trainable_updated();
  /// Starts a step's gradients: zeroes those the backward adds into, and lets the first weight
  /// pass of each layer (and of the head) write its linear weights' gradients instead of adding
  /// them to zeros (no memset of the largest part of the buffer). grad() and flat_grads() zero
  /// what is still unwritten, so a reader never sees the last step's values.
  void zero_grads();

  /// Which activations forwards keep. `layers` (global layer indices, [num_layers] or empty =
  /// every layer) names the layers `mode` applies to; the others keep everything. When every layer
  /// of the chunk recomputes in full, the chunk keeps only its input and reruns its whole forward
  /// (head included) before the backward; otherwise a fully recomputed layer keeps only its input
  /// and reruns its own forward just before its backward, and the head keeps what it needs.
  /// `keep_gelu` (global, [num_layers] or empty = none): the GPT-2 layers that keep their GELU
  /// output for the weight phase (core::keep_gelu_layers) instead of recomputing it.
  void set_recompute(core::recompute_mode mode, const std::vector<bool>& layers = {},
                     const std::vector<bool>& keep_gelu = {});

  /// Forward of micro-batch `mb`: rows = B × seq_length tokens for any B >= 1.
  /// input: int32 tokens [B*T] on the first chunk, hidden [B*T, C] otherwise.
  /// On the last chunk `targets` (int32 [B*T]) and `grad_scale` (d total loss / d token loss,
  /// typically 1 / tokens per step) are used, the loss and dlogits are computed, and an empty
  /// tensor is returned; otherwise returns the hidden output [B*T, C].
  /// `drop` (a training forward: model::training_dropout) draws dropout masks; the default
  /// draws none. Recompute and backward of mb redraw the same masks.
  /// `doc_starts` (host int32 [B*T], model::batch::doc_starts; every chunk of the micro-batch gets
  /// the same): examples packed in one sequence, each attending only within itself at positions
  /// restarting from 0. Undefined: one document per sequence.
  tensor forward(int mb, const tensor& input, const tensor& targets = {}, float grad_scale = 0,
                 const dropout_ctx& drop = {}, const tensor& doc_starts = {});
  /// Sum of mb's per-token losses in row order (last chunk only; valid after forward). Waits for
  /// the device: ask once the host has queued what it can.
  double loss_sum(int mb) const;
  /// The per-row losses (fp32 [rows], on the device) loss_sum adds up.
  tensor loss_rows(int mb) const;
  /// Full backward of mb: accumulates parameter gradients, returns d input [B*T, C] (empty on the
  /// first chunk), releases mb's saved activations. grad_out is ignored on the last chunk.
  tensor backward(int mb, const tensor& grad_out);
  /// Zero-bubble split: backward_input computes only d input and keeps what backward_weight needs;
  /// backward_weight(mb) then accumulates the parameter gradients and releases mb's state.
  /// backward_input followed by backward_weight gives the same bits as backward. The head's
  /// gradients (final norm, LM head) are the exception on a chunk without the embedding:
  /// backward_input accumulates them at once, so the logits-sized dlogits is released then.
  tensor backward_input(int mb, const tensor& grad_out);
  void backward_weight(int mb);

  /// Drops whatever mb saved (used after evaluation forwards, which need no backward).
  void release(int mb);
  /// Inference on the last chunk: logits [rows, vocab] (fp32) for input rows; saves nothing.
  tensor forward_logits(const tensor& input);

  /// A cache for `slots` sequences of up to `positions` tokens (at most seq_length).
  kv_cache make_kv_cache(int slots, int positions);
  /// Inference with a key/value cache (a chunk with embedding and head: the whole model): runs
  /// tokens (int32 [R]) at the cache slots and positions `at` names (int32 [R] each; every tensor
  /// on the backend's device), writes their keys and values into `cache`, and returns the fp32
  /// logits [logit_rows.size(), V] of the rows listed (host indices into [0, R)). The rows of a
  /// slot must be its next positions, with positions 0..p-1 of that slot already in the cache.
  tensor forward_cached(const tensor& tokens, const cache_rows& at, kv_cache& cache,
                        const std::vector<std::int64_t>& logit_rows);

  /// Bytes of saved activations currently held / the peak since construction.
  std::size_t saved_activation_bytes() const;
  std::size_t peak_saved_activation_bytes() const;

 private:
  std::unique_ptr<chunk_impl> impl_;
};

/// Σ of per-row losses (fp32, any device) in row order, in double: what chunk::loss_sum returns.
/// Waits for the device.
double sum_loss_rows(kernels::backend& be, const tensor& rows);

}  // namespace troupe::model
