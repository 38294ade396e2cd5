// Tensor parallel (Megatron-style) and sequence parallel: what each of `tp` ranks holds of a
// model, how full tensors split into rank slices and back, and the vocabulary-parallel embedding
// and cross-entropy. The layers themselves are the family ops (model/layer.hpp) built with a
// layer_split and a layer_comm: the same code as the unsplit layer on H/tp heads and ffn/tp MLP
// columns, with the collectives at the seams (docs/model.md, "Tensor and sequence parallel").
//
// Sharding rules (rank r of tp; every rule keeps a tensor's Hugging Face name and full shape in
// checkpoints, so a checkpoint does not depend on the layout):
//  - column-parallel (output features split): GPT-2 c_attn re-laid per head — rank r gets the
//    q, k and v rows (and bias) of its heads; LLaMA q_proj by heads; k_proj / v_proj by key/value
//    heads when num_kv_heads >= tp, else each rank holds the one key/value head its query heads
//    read (replicated); c_fc (with bias), gate_proj, up_proj by rows.
//  - row-parallel (input features split): attn.c_proj / o_proj, mlp.c_proj / down_proj by
//    columns; their bias (GPT-2) is whole on every rank and added once.
//  - vocabulary-parallel: wte / embed_tokens and lm_head by vocabulary rows, the vocabulary
//    padded to a multiple of tp with zero rows that never enter the softmax.
//  - replicated: norms, wpe.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "model/layer.hpp"
#include "model/params.hpp"

namespace troupe::model {

/// What rank `rank` of `tp` holds of every layer of `cfg`. REQUIRES: the config check's rule
/// (tp divides num_heads and the MLP width; divides num_kv_heads or is a multiple of it).
layer_split split_of(const core::model_config& cfg, int tp, int rank);

/// Ranks that hold the same key/value head: tp / num_kv_heads when replicated, else 1.
int kv_replicas(const core::model_config& cfg, int tp);

/// The vocabulary rows rank `rank` of `tp` holds: rows [first, first + rows) of the vocabulary
/// padded to `padded` (a multiple of tp), of which the first `valid` are real tokens.
struct vocab_range {
  std::int64_t padded = 0, first = 0, rows = 0, valid = 0;
};
vocab_range vocab_range_of(std::int64_t vocab, int tp, int rank);

/// The ops of one tensor-parallel rank of cfg.arch: forward, backward_input and backward_weight
/// compute its heads and MLP columns and call `comm` at the seams. Under sequence parallel their
/// input, output and input gradient are this rank's rows of the micro-batch (rows [rank * N/tp,
/// (rank + 1) * N/tp) of the N = B*T rows); otherwise every rank holds all N rows.
std::unique_ptr<layer_ops> make_tp_layer_ops(const core::model_config& cfg, kernels::backend& be,
                                             core::dtype act, int tp, layer_comm& comm);

/// The shape of rank `rank`'s slice of parameter `name` (full shape `full`): shard_tensor's.
core::shape_t shard_shape(const core::model_config& cfg, const std::string& name,
                          const core::shape_t& full, int tp, int rank);
/// Whether every rank holds parameter `name` whole (norms, wpe, GPT-2's row-parallel biases):
/// its gradient is the same on every rank, and a global norm counts it once.
bool replicated(const core::model_config& cfg, const std::string& name);

/// Whether rank `rank`'s slice of `name` counts in a global gradient norm: every split slice
/// does; of a tensor several ranks hold alike (replicated, or a key/value head shared by
/// kv_replicas ranks) only the first holder's.
bool counts_in_norm(const core::model_config& cfg, const std::string& name, int tp, int rank);

/// The flat-buffer layout of rank `rank`'s slices of `defs` (a chunk's whole parameters, as
/// define_params gives them): shapes shard_shape, offsets reassigned as define_params assigns
/// them. What a model::chunk built with chunk_tp holds.
std::vector<param_def> shard_defs(const core::model_config& cfg, std::vector<param_def> defs,
                                  int tp, int rank);
/// The whole parameter defs[i] (defs: the chunk's whole parameters) from every rank's flat
/// buffer of the chunk (`flat(t)`, host fp32, laid out as shard_defs says): a view of flat(0)
/// when tp is 1, else a new host tensor (unshard_tensor).
tensor unshard_param(const core::model_config& cfg, const std::vector<param_def>& defs,
                     std::size_t i, int tp, const std::function<const tensor&(int)>& flat);

/// Rank `rank`'s slice of parameter `name` (a Hugging Face name of cfg, full shape `full`: host
/// fp32), as a new host tensor.
tensor shard_tensor(const core::model_config& cfg, const std::string& name, const tensor& full,
                    int tp, int rank);
/// The full tensor `name` from every rank's slice (in rank order), as a new host tensor:
/// split tensors concatenated (vocabulary padding dropped), replicated ones taken from the first
/// rank that holds them. Inverse of shard_tensor, bit for bit.
tensor unshard_tensor(const core::model_config& cfg, const std::string& name,
                      const std::vector<tensor>& shards);

/// Vocabulary-parallel embedding: wte holds this rank's vocabulary rows (vocab_range_of), wpe
/// (GPT-2, else undefined) is whole. tokens int32 [N] (every rank all of them). Returns the
/// embedding rows this rank holds: all N, or its N/tp under sequence parallel. Each rank looks up
/// the tokens in its range (zero rows for the others), rank 0 adds the positions, and the group
/// sums.
tensor vp_embedding_forward(layer_comm& comm, kernels::backend& be, const embedding_tensors& w,
                            const tensor& tokens, std::int64_t vocab, int seq);
/// Its backward: dout is the gradient of the rows forward returned; accumulates into g.wte
/// (this rank's rows) and g.wpe (whole, the same on every rank) where defined.
void vp_embedding_backward(layer_comm& comm, kernels::backend& be, const tensor& dout,
                           const tensor& tokens, std::int64_t vocab, int seq, embedding_tensors& g);

/// The LM head fused with a vocabulary-parallel cross-entropy: h [n, C] is the final norm's
/// output on this rank's rows, head_w this rank's vocabulary rows of lm_head [Vl, C], targets
/// int32 [N] (negative = ignored). The full logits are never gathered: each rank computes its
/// [N, Vl] block; the row maxima are all-gathered (then the max, in rank order), the sums of
/// exponentials and the target logits summed. Returns the losses [N] (fp32, every rank the same
/// bits). When grad_scale != 0 also returns dh (the gradient of h, this rank's rows) and
/// accumulates the head's weight gradient into dw (when defined), as cross_entropy does; with dw
/// undefined, dlogits and input are what linear_backward_weight(dlogits, input, dw) needs later.
struct vp_loss {
  tensor losses;
  tensor dh;
  tensor dlogits;  // [N, Vl]: d loss / d this rank's logits, times grad_scale
  tensor input;    // [N, C]: h with every rank's rows (h itself without sequence parallel)
};
vp_loss vp_cross_entropy(layer_comm& comm, kernels::backend& be, const tensor& h,
                         const tensor& head_w, const tensor& targets, std::int64_t vocab,
                         float grad_scale, tensor& dw);

}  // namespace troupe::model
