// A model chunk: embedding (first chunk), layers, final norm + head + loss (last chunk), with the
// saved activations of each micro-batch in flight. See chunk.hpp for the contract.
//
// Why the results do not depend on the split: every layer runs the same ops on the same inputs
// whether its neighbour is in this chunk or another; a chunk boundary only hands the hidden state
// (forward) or its gradient (backward) over unchanged. Recompute re-runs the identical forward
// ops, so recomputed activations are the same bits as saved ones. backward is backward_input and
// backward_weight applied layer by layer, so the split backward is the same arithmetic too.
#include "model/chunk.hpp"

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/error.hpp"
#include "model/layer.hpp"
#include "model/params.hpp"
#include "model/tensor_parallel.hpp"

namespace troupe::model {

std::vector<chunk_spec> partition(const core::model_config& cfg, int chunks) {
  TROUPE_CHECK(chunks >= 1 && cfg.num_layers % chunks == 0,
               "cannot split " + std::to_string(cfg.num_layers) + " layers into " +
                   std::to_string(chunks) + " equal chunks");
  return partition(cfg, std::vector<int>(static_cast<std::size_t>(chunks), cfg.num_layers / chunks));
}

std::vector<chunk_spec> partition(const core::model_config& cfg, const std::vector<int>& layers) {
  int sum = 0;
  for (int n : layers) {
    TROUPE_CHECK(n >= 1, "a model chunk of " + std::to_string(n) + " layers");
    sum += n;
  }
  TROUPE_CHECK(!layers.empty() && sum == cfg.num_layers,
               "chunk layers summing to " + std::to_string(sum) + " for a " +
                   std::to_string(cfg.num_layers) + "-layer model");
  const int chunks = static_cast<int>(layers.size());
  std::vector<chunk_spec> out;
  int first = 0;
  for (int i = 0; i < chunks; ++i) {
    out.push_back({first, layers[static_cast<std::size_t>(i)], i == 0, i == chunks - 1});
    first += layers[static_cast<std::size_t>(i)];
  }
  return out;
}

std::vector<chunk_spec> partition(const core::config& c) {
  return partition(c.model, core::chunk_layers(c));
}

namespace {

core::dtype compute_dtype(core::precision_kind p) {
  switch (p) {
    case core::precision_kind::fp32: return core::dtype::f32;
    case core::precision_kind::bf16: return core::dtype::bf16;
    case core::precision_kind::fp16: return core::dtype::f16;
  }
  return core::dtype::f32;
}

/// What the last chunk keeps for the head's backward.
struct head_acts {
  tensor x;                // final norm input (the last layer's output)
  tensor n, mean, rstd;    // final norm output and statistics
  tensor dlogits;          // d loss / d logits × grad_scale, [N, logits_width(V)]: the largest buffer
                           // (tensor parallel: [N, V/tp], this rank's vocabulary columns)
  tensor dn;               // tensor parallel: d loss / d n (this rank's rows), from the loss
  tensor n_all;            // tensor parallel: n with every rank's rows (the head GEMM's input)
};

/// One micro-batch in flight.
struct mb_state {
  int mb = 0;                      // the micro-batch id (names tensor-parallel collectives)
  tensor tokens;                   // first chunk: int32 [N]
  tensor input;                    // other chunks: hidden [N, C]
  tensor targets;                  // last chunk under full recompute: int32 [N]
  float grad_scale = 0;
  dropout_ctx drop;                // the masks of this micro-batch (none in evaluation)
  doc_rows docs;                   // packed documents (undefined: one per sequence)
  bool complete = false;           // every activation backward reads is held
  bool input_done = false;         // backward_input ran; backward_weight is due
  std::vector<layer_acts> layers;
  std::vector<layer_stash> stash;
  head_acts head;
  tensor head_dn;                  // dy of the final norm, when its weights wait for phase W
  bool head_norm_done = false;
  bool head_weight_done = false;   // the head's weight gradient ran with backward_input
  tensor d_emb;                    // dy of the embedding, for phase W
  std::size_t bytes = 0;           // as last accounted

  template <class F>
  void each(F&& f) {
    for (tensor* t : {&tokens, &input, &targets, &head.x, &head.n, &head.mean, &head.rstd,
                      &head.dlogits, &head.dn, &head.n_all, &head_dn, &d_emb, &docs.start, &docs.positions})
      f(*t);
    for (auto& a : layers) a.each(f);
    for (auto& s : stash) s.each(f);
  }
};

/// What a forward keeps: of a chunk (all, all_but_attention, nothing, per_layer: as
/// chunk_impl::layer_keep says) or of one layer (all, all_but_attention, input: only its input,
/// for a full recompute of that layer).
enum class keep { all, all_but_attention, nothing, per_layer, input };

}  // namespace

class chunk_impl {
 public:
  chunk_impl(const core::model_config& cfg, chunk_spec spec, kernels::backend& be,
             core::precision_kind precision, chunk_tp tp)
      : cfg_(cfg), spec_(spec), be_(be), act_(compute_dtype(precision)), tp_(tp) {
    TROUPE_CHECK(spec.num_layers >= 0 && spec.first_layer >= 0 &&
                     spec.first_layer + spec.num_layers <= cfg.num_layers,
                 "chunk layers [" + std::to_string(spec.first_layer) + ", " +
                     std::to_string(spec.first_layer + spec.num_layers) + ") outside a " +
                     std::to_string(cfg.num_layers) + "-layer model");
    TROUPE_CHECK(cfg.hidden_size % cfg.num_heads == 0 && cfg.num_heads % cfg.kv_heads() == 0,
                 "hidden_size " + std::to_string(cfg.hidden_size) + ", num_heads " +
                     std::to_string(cfg.num_heads) + ", kv heads " +
                     std::to_string(cfg.kv_heads()) + " do not divide");
    shared_head_ = shares_head(cfg, spec, tp.size);
    defs_ = define_params(cfg, spec, tp.size);
    frozen_defs_ = define_frozen_params(cfg, spec);
    if (tp_.size > 1) shard_defs();
    for (std::size_t i = 0; i < defs_.size(); ++i) {
      infos_.push_back(defs_[i].info);
      index_[defs_[i].info.name] = {false, i};
    }
    for (std::size_t i = 0; i < frozen_defs_.size(); ++i) {
      frozen_infos_.push_back(frozen_defs_[i].info);
      index_[frozen_defs_[i].info.name] = {true, i};
    }
    const std::int64_t n = flat_numel(defs_);
    params_ = be_.empty({n}, core::dtype::f32);
    be_.zero(params_);
    if (act_ != core::dtype::f32) {
      low_ = be_.empty({n}, act_);
      be_.zero(low_);
    }
    // Frozen base weights: no gradient, no optimizer state; a compute-dtype copy when mixed.
    if (!frozen_defs_.empty()) {
      const std::int64_t nf = flat_numel(frozen_defs_);
      frozen_ = be_.empty({nf}, core::dtype::f32);
      be_.zero(frozen_);
      if (act_ != core::dtype::f32) {
        frozen_low_ = be_.empty({nf}, act_);
        be_.zero(frozen_low_);
      }
    }
    ops_ = tp_.size > 1 ? make_tp_layer_ops(cfg_, be_, act_, tp_.size, *tp_.comm)
                        : make_layer_ops(cfg_, be_, act_);
    recompute_layers_.assign(static_cast<std::size_t>(spec.num_layers), true);
    keep_gelu_.assign(static_cast<std::size_t>(spec.num_layers), false);
  }

  core::model_config cfg_;
  chunk_spec spec_;
  kernels::backend& be_;
  core::dtype act_;
  chunk_tp tp_;
  std::vector<param_def> defs_, frozen_defs_;     // trainable (flat params_) and frozen
  std::vector<param_def> full_defs_;              // tensor parallel: defs_ with whole shapes

  /// Tensor parallel: this rank's slices in place of the whole parameters, offsets reassigned.
  void shard_defs() {
    TROUPE_CHECK(tp_.comm && tp_.comm->size() == tp_.size && tp_.comm->rank() == tp_.rank,
                 "a tensor-parallel chunk of rank " + std::to_string(tp_.rank) + " of " +
                     std::to_string(tp_.size) + " without its group");
    TROUPE_CHECK(frozen_defs_.empty(), "tensor parallel does not split LoRA adapters ([lora])");
    TROUPE_CHECK(act_ == core::dtype::f32,
                 "tensor parallel runs in fp32 (precision.compute = \"fp32\")");
    full_defs_ = defs_;
    defs_ = model::shard_defs(cfg_, std::move(defs_), tp_.size, tp_.rank);
  }
  bool tp_on() const { return tp_.size > 1; }
  bool sp() const { return tp_on() && tp_.comm->sequence_parallel(); }
  /// Names the next collectives of the group (tensor parallel only).
  void name_op(int layer, const mb_state& st, comm_op op) {
    if (tp_on()) tp_.comm->begin_op(layer, st.mb, op);
  }
  std::vector<param_info> infos_, frozen_infos_;
  std::unordered_map<std::string, std::pair<bool, std::size_t>> index_;  // name → (frozen, i)
  tensor params_, low_;
  // One chunk holds both uses of a tied embedding: the head reads the embedding's weights and
  // writes its gradient into head_grad_, outside grads_ (chunk::shares_head).
  bool shared_head_ = false;
  // The gradient buffers are made (zeroed) when first asked for (need_grads): a chunk that only
  // runs evaluation forwards, as the coordinator's copy of the model does, never holds them.
  mutable tensor grads_, head_grad_;
  void need_grads() const {
    if (grads_.defined()) return;
    grads_ = be_.empty({params_.numel()}, core::dtype::f32);
    be_.zero(grads_);
    if (shared_head_) {
      head_grad_ = be_.empty({cfg_.vocab_size, cfg_.hidden_size}, core::dtype::f32);
      be_.zero(head_grad_);
    }
  }
  tensor frozen_, frozen_low_;
  std::unique_ptr<layer_ops> ops_;
  core::recompute_mode recompute_ = core::recompute_mode::none;
  std::vector<bool> recompute_layers_;  // [spec_.num_layers]: the layers recompute_ applies to
  bool whole_ = false;                  // full recompute of every layer: rerun the whole chunk
  std::vector<bool> keep_gelu_;         // [spec_.num_layers]: layer_acts::keep_act of each layer
  std::map<int, mb_state> states_;
  std::map<int, tensor> losses_;  // per-row losses of each micro-batch, on the device
  std::size_t bytes_ = 0, peak_ = 0;
  // Gradients that zero_grads leaves as they are: the linear weights' (and their biases'), which
  // the first weight pass of a step writes (layer_tensors::fresh). fresh_layers_[l] / fresh_head_:
  // not yet written since the last zero_grads. unwritten_: the ranges of grads_ zero_grads clears.
  std::vector<bool> fresh_layers_;
  bool fresh_head_ = false;
  std::vector<std::pair<std::int64_t, std::int64_t>> unwritten_;
  bool ranges_known_ = false;

  /// Whether `name` is the head of a shared tied embedding (no parameter of its own).
  bool is_shared_head(const std::string& name) const {
    return shared_head_ && name == "lm_head.weight";
  }
  std::pair<bool, const param_info*> info(const std::string& name) const {
    auto it = index_.find(is_shared_head(name) ? embedding_name(cfg_) : name);
    if (it == index_.end())
      throw core::failure("no parameter '" + name + "' in the chunk of layers [" +
                          std::to_string(spec_.first_layer) + ", " +
                          std::to_string(spec_.first_layer + spec_.num_layers) + ")" +
                          (spec_.has_embedding ? " with embedding" : "") +
                          (spec_.has_head ? " with head" : ""));
    const auto [frozen, i] = it->second;
    return {frozen, frozen ? &frozen_infos_[i] : &infos_[i]};
  }
  /// The fp32 master weight `name`, trainable or frozen.
  tensor param_view(const std::string& name) const {
    const auto [frozen, p] = info(name);
    return (frozen ? frozen_ : params_).slice(p->offset, p->shape);
  }
  tensor grad_view(const std::string& name) const {
    need_grads();
    if (is_shared_head(name)) return head_grad_;
    const auto [frozen, p] = info(name);
    if (frozen)
      throw core::failure("parameter '" + name + "' is frozen ([lora]): it has no gradient");
    return grads_.slice(p->offset, p->shape);
  }

  /// Parameter views for the ops (compute dtype) or for gradients (fp32; frozen ones undefined).
  struct views {
    embedding_tensors emb;
    std::vector<layer_tensors> layers;
    head_tensors head;
  };
  template <class Lookup>
  views make_views(Lookup lookup) const {
    views v;
    const std::function<tensor(const std::string&)> f = lookup;
    if (spec_.has_embedding) v.emb = embedding_views(cfg_, f);
    for (int l = 0; l < spec_.num_layers; ++l)
      v.layers.push_back(layer_views(cfg_, spec_.first_layer + l, f));
    if (spec_.has_head) v.head = head_views(cfg_, f);
    return v;
  }
  views weights() const {
    const tensor& t = low_.defined() ? low_ : params_;
    const tensor& f = frozen_low_.defined() ? frozen_low_ : frozen_;
    return make_views([&](const std::string& name) {
      const auto [frozen, p] = info(name);
      return (frozen ? f : t).slice(p->offset, p->shape);
    });
  }
  views gradients() const {
    need_grads();
    return make_views([&](const std::string& name) {
      if (is_shared_head(name)) return head_grad_;
      const auto [frozen, p] = info(name);
      return frozen ? tensor{} : grads_.slice(p->offset, p->shape);
    });
  }

  /// The gradients of layer `l` (or of the head, l = -1) that its weight pass writes when fresh:
  /// each linear weight whose gradient is wanted, with its bias.
  std::vector<tensor> written_by(const views& g, int l) const {
    std::vector<tensor> out;
    auto add = [&](const tensor& w, const tensor* b) {
      if (!w.defined()) return;
      out.push_back(w);
      if (b && b->defined()) out.push_back(*b);
    };
    if (l < 0) {
      add(g.head.head_w, nullptr);
      return out;
    }
    const layer_tensors& t = g.layers[static_cast<std::size_t>(l)];
    // Biases whose gradients the norms' backward sums accumulate into zeroed memory.
    const bool branch = ops_->branch_bias_from_norm();
    add(t.qkv_w, &t.qkv_b);
    add(t.q_w, nullptr);
    add(t.k_w, nullptr);
    add(t.v_w, nullptr);
    add(t.proj_w, branch ? nullptr : &t.proj_b);
    add(t.fc_w, &t.fc_b);
    add(t.up_w, nullptr);
    add(t.out_w, branch ? nullptr : &t.out_b);
    return out;
  }
  std::pair<std::int64_t, std::int64_t> range_in_grads(const tensor& t) const {
    const auto begin =
        static_cast<std::int64_t>((t.byte_offset() - grads_.byte_offset()) / sizeof(float));
    return {begin, begin + t.numel()};
  }
  /// Clears what no weight pass writes and marks the rest fresh.
  void zero_grads() {
    need_grads();
    if (!ranges_known_) {
      const views g = gradients();
      std::vector<std::pair<std::int64_t, std::int64_t>> written;
      for (int l = -1; l < spec_.num_layers; ++l)
        if (l >= 0 || spec_.has_head)
          for (const tensor& t : written_by(g, l))
            if (t.store() == grads_.store()) written.push_back(range_in_grads(t));
      std::sort(written.begin(), written.end());
      std::int64_t at = 0;
      for (auto [b, e] : written) {
        if (b > at) unwritten_.emplace_back(at, b);
        at = std::max(at, e);
      }
      if (at < grads_.numel()) unwritten_.emplace_back(at, grads_.numel());
      ranges_known_ = true;
    }
    for (auto [b, e] : unwritten_) {
      tensor part = grads_.slice(b, {e - b});
      be_.zero(part);
    }
    fresh_layers_.assign(static_cast<std::size_t>(spec_.num_layers), true);
    fresh_head_ = spec_.has_head;
  }
  /// Whether layer l's (head: l = -1) weight pass writes its gradients, once per zero_grads.
  bool take_fresh(int l) {
    if (l < 0) return std::exchange(fresh_head_, false);
    if (static_cast<std::size_t>(l) >= fresh_layers_.size()) return false;
    const bool f = fresh_layers_[static_cast<std::size_t>(l)];
    fresh_layers_[static_cast<std::size_t>(l)] = false;
    return f;
  }
  /// Zeroes the gradients still fresh, for a reader that comes before their weight pass (the
  /// values are then those of a zeroed buffer, as before any backward).
  void settle() {
    bool any = fresh_head_;
    for (bool f : fresh_layers_) any = any || f;
    if (!any) return;
    const views g = gradients();
    for (int l = -1; l < spec_.num_layers; ++l)
      if ((l >= 0 || spec_.has_head) && take_fresh(l))
        for (tensor t : written_by(g, l)) be_.zero(t);
  }

  /// Bytes held by st (each storage once: a layer's output is the next layer's input).
  void account(mb_state& st) {
    std::unordered_set<const core::storage*> seen;
    std::size_t bytes = 0;
    st.each([&](const tensor& t) {
      if (t.defined() && seen.insert(t.store().get()).second) bytes += t.store()->bytes;
    });
    bytes_ = bytes_ - st.bytes + bytes;
    st.bytes = bytes;
    peak_ = std::max(peak_, bytes_);
  }
  void drop(std::map<int, mb_state>::iterator it) {
    bytes_ -= it->second.bytes;
    states_.erase(it);
  }

  std::int64_t check_rows(const tensor& input) const {
    TROUPE_CHECK(input.defined(), "forward without an input");
    const std::int64_t n = input.dim(0);
    // Under sequence parallel a hidden input is this rank's rows of whole sequences.
    const std::int64_t whole = !spec_.has_embedding && sp() ? n * tp_.size : n;
    TROUPE_CHECK(n > 0 && whole % cfg_.seq_length == 0,
                 std::to_string(n) + " input rows are not whole sequences of seq_length " +
                     std::to_string(cfg_.seq_length));
    if (spec_.has_embedding) {
      TROUPE_CHECK(input.type() == core::dtype::i32 && input.numel() == n,
                   "first chunk wants int32 tokens [B*T], got " +
                       std::string(core::dtype_name(input.type())) + " " +
                       core::shape_string(input.shape()));
    } else {
      TROUPE_CHECK(input.type() == act_ && input.shape() == core::shape_t({n, cfg_.hidden_size}),
                   "chunk wants " + std::string(core::dtype_name(act_)) + " hidden [N, " +
                       std::to_string(cfg_.hidden_size) + "], got " +
                       core::dtype_name(input.type()) + " " + core::shape_string(input.shape()));
    }
    return n;
  }
  /// A copy on this backend that the chunk owns: callers may reuse their buffers.
  tensor own(const tensor& t) {
    tensor out = be_.empty(t.shape(), t.type());
    be_.copy(t, out);
    return out;
  }

  /// The forward of st's input; keeps activations in st as `k` says. With `losses`, the last
  /// chunk runs the cross-entropy (dlogits into st.head when kept), leaves the per-row losses (on
  /// the device) in *losses and returns an empty tensor; without, it returns the logits.
  tensor run(mb_state& st, keep k, tensor* losses, bool again = false) {
    const views w = weights();
    tensor x;
    if (spec_.has_embedding && tp_on()) {
      TROUPE_CHECK(!st.docs.on(), "tensor parallel does not run packed documents");
      name_op(-1, st, again ? comm_op::recompute_embedding : comm_op::embedding_forward);
      x = vp_embedding_forward(*tp_.comm, be_, w.emb, st.tokens, cfg_.vocab_size, cfg_.seq_length);
      // Under sequence parallel this rank's rows of the whole micro-batch's mask.
      const kernels::dropout_spec d = st.drop.at(0, dropout_site::embedding);
      if (d.on()) ops_->dropout_hidden(x, d, x);
    } else if (spec_.has_embedding) {
      x = ops_->alloc({st.tokens.dim(0), cfg_.hidden_size});
      if (st.docs.on())
        be_.embedding_forward_at(st.tokens, w.emb.wte, w.emb.wpe, st.docs.positions, x);
      else
        be_.embedding_forward(st.tokens, w.emb.wte, w.emb.wpe, cfg_.seq_length, x);
      const kernels::dropout_spec d = st.drop.at(0, dropout_site::embedding);
      if (d.on()) be_.dropout(x, d, sample_elems(), x);
    } else {
      x = st.input;
    }
    const std::int64_t n = x.dim(0);
    st.layers.assign(k == keep::nothing ? 0 : spec_.num_layers, {});
    for (int l = 0; l < spec_.num_layers; ++l) {
      layer_acts a;
      a.keep_act = keep_gelu_[static_cast<std::size_t>(l)];
      name_op(spec_.first_layer + l, st, again ? comm_op::recompute : comm_op::forward);
      tensor y = ops_->forward(w.layers[l], x, a, layer_drop(st, l), st.docs);
      const keep kl = k == keep::per_layer ? layer_keep(l) : k;
      if (kl == keep::all_but_attention) a.att = {}, a.lse = {};
      if (kl == keep::input) {
        layer_acts only_input;
        only_input.x = std::move(a.x);
        a = std::move(only_input);
      }
      if (k != keep::nothing) st.layers[l] = std::move(a);
      x = std::move(y);
    }
    if (!spec_.has_head) return x;

    head_acts h;
    h.x = x;
    if (tp_on()) {
      TROUPE_CHECK(losses != nullptr, "tensor parallel computes no logits (only the loss)");
      h.n = ops_->alloc({n, cfg_.hidden_size});
      ops_->norm_stats(n, h.mean, h.rstd);
      ops_->norm_forward(h.x, w.head.norm_w, w.head.norm_b, h.n, h.mean, h.rstd);
      // The gradient only where a backward follows from these activations.
      const bool kept = k != keep::nothing && st.grad_scale != 0;
      name_op(-2, st, again ? comm_op::recompute_loss : comm_op::loss);
      tensor no_dw;  // the head's weight gradient waits for the weight phase
      vp_loss r = vp_cross_entropy(*tp_.comm, be_, h.n, w.head.head_w, st.targets,
                                   cfg_.vocab_size, kept ? st.grad_scale : 0.0f, no_dw);
      *losses = r.losses;
      if (kept) {
        h.dlogits = std::move(r.dlogits);
        h.n_all = std::move(r.input);
        h.dn = std::move(r.dh);
        st.head = std::move(h);
      }
      return {};
    }
    // With the loss, the logits' rows may be padded (backend::logits_width); returned logits are
    // [n, V].
    tensor logits = head_forward(w.head, h, losses != nullptr);
    if (!losses) return logits;
    *losses = ops_->alloc({n}, core::dtype::f32);
    be_.cross_entropy(logits, st.targets, *losses, st.grad_scale);
    if (k != keep::nothing && st.grad_scale != 0) {
      h.dlogits = std::move(logits);
      st.head = std::move(h);
    }
    return {};
  }

  /// What layer l (local) keeps under per-layer recompute.
  keep layer_keep(int l) const {
    if (!recompute_layers_[static_cast<std::size_t>(l)]) return keep::all;
    return recompute_ == core::recompute_mode::full ? keep::input : keep::all_but_attention;
  }

  /// The chunk-level keep of a training forward.
  keep forward_keep() const {
    if (recompute_ == core::recompute_mode::none) return keep::all;
    if (whole_) return keep::nothing;
    bool every = true;
    for (bool b : recompute_layers_) every = every && b;
    if (every && recompute_ == core::recompute_mode::selective) return keep::all_but_attention;
    return keep::per_layer;
  }

  /// Final norm and LM head of h.x: fills h.n and its statistics, returns the logits: [n, V], or
  /// with `padded` [n, be_.logits_width(V)] whose columns past V are −∞ (for the cross-entropy).
  tensor head_forward(const head_tensors& w, head_acts& h, bool padded = false) {
    const std::int64_t n = h.x.dim(0);
    h.n = ops_->alloc({n, cfg_.hidden_size});
    ops_->norm_stats(n, h.mean, h.rstd);
    ops_->norm_forward(h.x, w.norm_w, w.norm_b, h.n, h.mean, h.rstd);
    const std::int64_t width = padded ? be_.logits_width(cfg_.vocab_size) : cfg_.vocab_size;
    tensor logits = ops_->alloc({n, width});
    be_.linear_forward(h.n, w.head_w, {}, logits);
    return logits;
  }

  /// The dropout masks of local layer l for st's micro-batch (global layer first_layer + l).
  layer_dropout layer_drop(const mb_state& st, int l) const {
    const int layer = spec_.first_layer + l;
    return {st.drop.at(layer, dropout_site::attention),
            st.drop.at(layer, dropout_site::attention_out),
            st.drop.at(layer, dropout_site::mlp_out)};
  }

  /// Elements per sequence of a hidden state: a dropout sample.
  std::int64_t sample_elems() const {
    return static_cast<std::int64_t>(cfg_.seq_length) * cfg_.hidden_size;
  }

  /// dwte, dwpe += the embedding's gradient for dy, at the rows' positions.
  template <class G>
  void embedding_backward(const tensor& dy, const mb_state& st, G& g) {
    if (tp_on()) {
      name_op(-1, st, comm_op::embedding_backward);
      vp_embedding_backward(*tp_.comm, be_, dy, st.tokens, cfg_.vocab_size, cfg_.seq_length, g);
    } else if (st.docs.on())
      be_.embedding_backward_at(dy, st.tokens, st.docs.positions, g.wte, g.wpe);
    else
      be_.embedding_backward(dy, st.tokens, cfg_.seq_length, g.wte, g.wpe);
  }

  /// The documents of doc_starts (host int32 [n], model/loader.hpp) on this backend: the starts
  /// and each row's position within its document.
  doc_rows documents(const tensor& doc_starts, std::int64_t n) {
    if (!doc_starts.defined()) return {};
    TROUPE_CHECK(doc_starts.type() == core::dtype::i32 && doc_starts.numel() == n &&
                     doc_starts.dev().is_cpu(),
                 "document starts must be host int32 [" + std::to_string(n) + "]");
    tensor pos = tensor::zeros({n}, core::dtype::i32);
    const auto* s = doc_starts.data<std::int32_t>();
    auto* p = pos.data<std::int32_t>();
    const std::int64_t T = cfg_.seq_length;
    for (std::int64_t r = 0; r < n; ++r) {
      TROUPE_CHECK(s[r] >= 0 && s[r] <= r % T, "document start " + std::to_string(s[r]) +
                                                   " at row " + std::to_string(r) +
                                                   " is not within its sequence's first " +
                                                   std::to_string(r % T + 1) + " tokens");
      p[r] = static_cast<std::int32_t>(r % T - s[r]);
    }
    return {own(doc_starts.reshape({n})), own(pos)};
  }

  tensor forward(int mb, const tensor& input, const tensor& targets, float grad_scale,
                 const dropout_ctx& drop, const tensor& doc_starts) {
    TROUPE_CHECK(!states_.count(mb), "micro-batch " + std::to_string(mb) +
                                         " is already in flight in this chunk; backward or "
                                         "release it first");
    const std::int64_t n = check_rows(input);
    // Every row of the micro-batch (this rank holds n / tp of them under sequence parallel).
    const std::int64_t all_rows = !spec_.has_embedding && sp() ? n * tp_.size : n;
    TROUPE_CHECK(!tp_on() || !doc_starts.defined(), "tensor parallel does not run packed documents");
    mb_state st;
    st.mb = mb;
    if (spec_.has_embedding)
      st.tokens = own(input.reshape({n}));
    else
      st.input = own(input);
    st.drop = drop;
    st.docs = documents(doc_starts, n);
    keep k = forward_keep();
    tensor out;
    if (spec_.has_head) {
      TROUPE_CHECK(targets.defined() && targets.type() == core::dtype::i32 &&
                       targets.numel() == all_rows,
                   "the last chunk wants int32 targets of " + std::to_string(all_rows) + " rows");
      st.targets = own(targets.reshape({all_rows}));
      st.grad_scale = grad_scale;
      // An evaluation forward (no gradient wanted) keeps nothing: no backward can follow.
      if (grad_scale == 0) k = keep::nothing;
      // Read back only when asked (loss_sum): copying it here would make the host wait for the
      // device after every micro-batch and stop it queueing the next one's kernels ahead.
      tensor rows;
      run(st, k, &rows);
      losses_[mb] = rows;
      if (grad_scale == 0) st = mb_state{};
    } else {
      out = run(st, k, nullptr);
    }
    st.complete = k != keep::nothing;
    // Only a full recompute needs the targets again, to rebuild dlogits.
    if (k != keep::nothing) st.targets = {};
    auto it = states_.emplace(mb, std::move(st)).first;
    account(it->second);
    return out;
  }

  std::map<int, mb_state>::iterator find(int mb, const char* what) {
    auto it = states_.find(mb);
    TROUPE_CHECK(it != states_.end(), std::string(what) + " of micro-batch " +
                                          std::to_string(mb) +
                                          " that has no forward in flight in this chunk");
    return it;
  }

  /// Phase I (and, when `with_weights`, phase W right behind it, layer by layer).
  tensor backward_input(int mb, const tensor& grad_out, bool with_weights) {
    auto it = find(mb, "backward");
    mb_state& st = it->second;
    TROUPE_CHECK(!st.input_done, "backward_input of micro-batch " + std::to_string(mb) +
                                     " ran already; backward_weight is due");
    if (spec_.has_head)
      TROUPE_CHECK(st.grad_scale != 0, "micro-batch " + std::to_string(mb) +
                                           " was an evaluation forward (grad_scale 0)");
    if (!st.complete) {
      tensor unused;  // the recomputed losses equal the first forward's
      run(st, keep::all, spec_.has_head ? &unused : nullptr, true);
      st.complete = true;
      st.targets = {};
      account(st);
    }
    const views w = weights();
    views g = gradients();
    // This rank's rows (sequence parallel: the tokens are every row, the gradient its share).
    const std::int64_t n =
        spec_.has_embedding ? st.tokens.dim(0) / (sp() ? tp_.size : 1) : st.input.dim(0);

    tensor dy;
    if (spec_.has_head) {
      // The head's weight gradient reads dlogits, as large as the logits; under a split backward
      // it runs here rather than in backward_weight, so dlogits goes with the input gradient
      // instead of living until the weight phase (zero-bubble schedules defer up to p of them).
      // The head's gradients still accumulate in micro-batch order: the same bits. Not on a chunk
      // that also holds the embedding, whose tied gradient shares the buffer: the order in which
      // the two accumulate across micro-batches stays that of the full backward.
      const bool head_weight_now = with_weights || !spec_.has_embedding;
      dy = head_backward_input(st, w.head, head_weight_now ? &g.head : nullptr);
      if (head_weight_now) {
        head_backward_weight(st, w.head, g.head);
        st.head_weight_done = true;
      }
    } else {
      TROUPE_CHECK(grad_out.defined() && grad_out.type() == act_ &&
                       grad_out.shape() == core::shape_t({n, cfg_.hidden_size}),
                   "backward of micro-batch " + std::to_string(mb) + " wants " +
                       core::dtype_name(act_) + " grad_out [" + std::to_string(n) + ", " +
                       std::to_string(cfg_.hidden_size) + "]");
      dy = with_weights ? grad_out : own(grad_out);
    }
    st.stash.assign(spec_.num_layers, {});
    for (int l = spec_.num_layers - 1; l >= 0; --l) {
      // A layer recomputed in full kept only its input: rerun its forward (the same ops on the
      // same input, so the same bits) right before its backward.
      if (!st.layers[l].n1.defined()) {
        layer_acts a;
        a.keep_act = keep_gelu_[static_cast<std::size_t>(l)];
        name_op(spec_.first_layer + l, st, comm_op::recompute);
        ops_->forward(w.layers[l], st.layers[l].x, a, layer_drop(st, l), st.docs);
        st.layers[l] = std::move(a);
        account(st);
      }
      name_op(spec_.first_layer + l, st, comm_op::backward_input);
      st.stash[l].sum_qkv_bias = g.layers[l].qkv_b.defined();
      tensor dx = ops_->backward_input(w.layers[l], st.layers[l], dy, st.stash[l],
                                       with_weights ? &g.layers[l] : nullptr);
      account(st);
      if (with_weights) {
        name_op(spec_.first_layer + l, st, comm_op::backward_weight);
        g.layers[l].fresh = take_fresh(l);
        ops_->backward_weight(w.layers[l], st.layers[l], st.stash[l], g.layers[l]);
        st.layers[l] = {};
        st.stash[l] = {};
      } else {
        ops_->keep_for_weight(st.layers[l]);
      }
      dy = std::move(dx);
    }
    if (spec_.has_embedding) {
      const bool wanted = g.emb.wte.defined() || g.emb.wpe.defined();
      const kernels::dropout_spec d = st.drop.at(0, dropout_site::embedding);
      if (wanted && d.on()) {
        tensor masked = ops_->alloc(dy.shape());
        if (tp_on())
          ops_->dropout_hidden(dy, d, masked);
        else
          be_.dropout(dy, d, sample_elems(), masked);
        dy = std::move(masked);
      }
      if (with_weights && wanted)
        embedding_backward(dy, st, g.emb);
      else if (wanted)
        st.d_emb = dy;
      dy = {};
    }
    if (with_weights) {
      drop(it);
    } else {
      st.input_done = true;
      account(st);
    }
    return dy;
  }

  void backward_weight(int mb) {
    auto it = find(mb, "backward_weight");
    mb_state& st = it->second;
    TROUPE_CHECK(st.input_done, "backward_weight of micro-batch " + std::to_string(mb) +
                                    " before its backward_input");
    const views w = weights();
    views g = gradients();
    if (spec_.has_head && !st.head_weight_done) head_backward_weight(st, w.head, g.head);
    for (int l = spec_.num_layers - 1; l >= 0; --l) {
      name_op(spec_.first_layer + l, st, comm_op::backward_weight);
      g.layers[l].fresh = take_fresh(l);
      ops_->backward_weight(w.layers[l], st.layers[l], st.stash[l], g.layers[l]);
    }
    if (spec_.has_embedding && st.d_emb.defined())
      embedding_backward(st.d_emb, st, g.emb);
    drop(it);
  }

  tensor head_backward_input(mb_state& st, const head_tensors& w, head_tensors* norm_grads) {
    const head_acts& h = st.head;
    const std::int64_t n = h.x.dim(0), c = cfg_.hidden_size;
    tensor dn;
    if (tp_on()) {
      dn = h.dn;  // the loss reduced it over the group already
    } else {
      dn = ops_->zeros({n, c});
      be_.linear_backward_input(h.dlogits, w.head_w, dn);
    }
    tensor dx = ops_->zeros({n, c});
    if (sp() && norm_grads) {
      // Each rank holds some rows: the final norm's weight gradient is the group's sum.
      st.head_dn = dn;
      head_norm_weight(st, w, *norm_grads, &dx);
      st.head_norm_done = true;
      return dx;
    }
    tensor dw, db;
    if (norm_grads) {
      dw = norm_grads->norm_w, db = norm_grads->norm_b;
    } else {
      st.head_dn = dn;
    }
    // Scratch where the weight gradient is not wanted now, or never (a frozen norm).
    if (!dw.defined()) dw = ops_->zeros({c}, core::dtype::f32);
    if (w.norm_b.defined() && !db.defined()) db = ops_->zeros({c}, core::dtype::f32);
    ops_->norm_backward(dn, h.x, w.norm_w, h.mean, h.rstd, dx, dw, db);
    st.head_norm_done = norm_grads != nullptr;
    return dx;
  }

  /// Sequence parallel: the final norm's backward on this rank's rows (dx written when given),
  /// its weight gradients summed over the group into g.
  void head_norm_weight(mb_state& st, const head_tensors& w, head_tensors& g, tensor* dx) {
    const head_acts& h = st.head;
    const std::int64_t c = cfg_.hidden_size;
    tensor dw = ops_->zeros({c}, core::dtype::f32), db;
    if (w.norm_b.defined()) db = ops_->zeros({c}, core::dtype::f32);
    tensor dx_scratch = dx ? *dx : ops_->zeros(h.x.shape());
    ops_->norm_backward(st.head_dn, h.x, w.norm_w, h.mean, h.rstd, dx_scratch, dw, db);
    name_op(-2, st, comm_op::head_backward);
    const tensor sw = tp_.comm->all_reduce(dw);
    const tensor sb = db.defined() ? tp_.comm->all_reduce(db) : tensor{};
    if (g.norm_w.defined()) be_.accumulate(sw, g.norm_w);
    if (g.norm_b.defined() && sb.defined()) be_.accumulate(sb, g.norm_b);
  }

  void head_backward_weight(mb_state& st, const head_tensors& w, head_tensors& g) {
    head_acts& h = st.head;
    tensor none;
    const bool fresh = take_fresh(-1);
    if (g.head_w.defined() && fresh)
      be_.linear_backward_weight_write(h.dlogits, tp_on() ? h.n_all : h.n, g.head_w, none);
    else if (g.head_w.defined())
      be_.linear_backward_weight(h.dlogits, tp_on() ? h.n_all : h.n, g.head_w, none);
    if (!st.head_norm_done && sp()) {
      head_norm_weight(st, w, g, nullptr);
    } else if (!st.head_norm_done && g.norm_w.defined()) {
      tensor dx_scratch = ops_->zeros(h.x.shape());
      ops_->norm_backward(st.head_dn, h.x, w.norm_w, h.mean, h.rstd, dx_scratch, g.norm_w,
                          g.norm_b);
    }
    // dlogits is as large as the logits: let it go the moment its last reader is done.
    st.head = {};
    st.head_dn = {};
    account(st);
  }
};

chunk::chunk(const core::model_config& cfg, chunk_spec spec, kernels::backend& be,
             core::precision_kind precision, chunk_tp tp)
    : impl_(std::make_unique<chunk_impl>(cfg, spec, be, precision, tp)) {}
chunk::~chunk() = default;
chunk::chunk(chunk&&) noexcept = default;
chunk& chunk::operator=(chunk&&) noexcept = default;

const chunk_spec& chunk::spec() const { return impl_->spec_; }
const chunk_tp& chunk::tp() const { return impl_->tp_; }
core::shape_t chunk::whole_shape(const std::string& name) const {
  const auto [frozen, p] = impl_->info(name);
  if (frozen || !impl_->tp_on()) return p->shape;
  return impl_->full_defs_.at(static_cast<std::size_t>(p - impl_->infos_.data())).info.shape;
}
const std::vector<param_info>& chunk::params() const { return impl_->infos_; }
bool chunk::shares_head() const { return impl_->shared_head_; }
const std::vector<param_info>& chunk::frozen_params() const { return impl_->frozen_infos_; }
tensor& chunk::flat_params() { return impl_->params_; }
tensor& chunk::flat_grads() {
  impl_->need_grads();
  impl_->settle();
  return impl_->grads_;
}
tensor& chunk::flat_low() { return impl_->low_; }
tensor& chunk::flat_frozen() { return impl_->frozen_; }
tensor& chunk::flat_frozen_low() { return impl_->frozen_low_; }
tensor chunk::param(const std::string& name) { return impl_->param_view(name); }
tensor chunk::grad(const std::string& name) {
  impl_->settle();
  return impl_->grad_view(name);
}
bool chunk::frozen(const std::string& name) const { return impl_->info(name).first; }

void chunk::init(std::uint64_t seed) {
  if (impl_->tp_on()) {
    // The whole tensors as tp 1 draws them, then this rank's slice of each.
    const auto& defs = impl_->defs_;
    tensor host = tensor::zeros({flat_numel(defs)});
    for (std::size_t i = 0; i < defs.size(); ++i) {
      const param_def& full = impl_->full_defs_[i];
      tensor whole = tensor::zeros(full.info.shape);
      init_param(full, impl_->cfg_, seed, whole.data<float>());
      const tensor mine =
          shard_tensor(impl_->cfg_, full.info.name, whole, impl_->tp_.size, impl_->tp_.rank);
      std::copy(mine.data<float>(), mine.data<float>() + mine.numel(),
                host.data<float>() + defs[i].info.offset);
    }
    impl_->be_.copy(host, impl_->params_);
    params_updated();
    return;
  }
  for (auto [defs, flat] : {std::pair{&impl_->defs_, &impl_->params_},
                            std::pair{&impl_->frozen_defs_, &impl_->frozen_}}) {
    if (defs->empty()) continue;
    tensor host = tensor::zeros({flat_numel(*defs)});
    for (const auto& d : *defs)
      init_param(d, impl_->cfg_, seed, host.data<float>() + d.info.offset);
    impl_->be_.copy(host, *flat);
  }
  params_updated();
}

void chunk::params_updated() {
  trainable_updated();
  if (impl_->frozen_low_.defined()) impl_->be_.convert(impl_->frozen_, impl_->frozen_low_);
}

void chunk::trainable_updated() {
  if (impl_->low_.defined()) impl_->be_.convert(impl_->params_, impl_->low_);
}

void chunk::zero_grads() { impl_->zero_grads(); }

void chunk::set_recompute(core::recompute_mode mode, const std::vector<bool>& layers,
                          const std::vector<bool>& keep_gelu) {
  chunk_impl& m = *impl_;
  const chunk_spec& sp = m.spec_;
  TROUPE_CHECK(layers.empty() || static_cast<int>(layers.size()) == m.cfg_.num_layers,
               "a recompute choice of " + std::to_string(layers.size()) + " layers for a " +
                   std::to_string(m.cfg_.num_layers) + "-layer model");
  TROUPE_CHECK(keep_gelu.empty() || static_cast<int>(keep_gelu.size()) == m.cfg_.num_layers,
               "a GELU choice of " + std::to_string(keep_gelu.size()) + " layers for a " +
                   std::to_string(m.cfg_.num_layers) + "-layer model");
  for (int l = 0; l < sp.num_layers; ++l)
    m.keep_gelu_[static_cast<std::size_t>(l)] =
        !keep_gelu.empty() && keep_gelu[static_cast<std::size_t>(sp.first_layer + l)];
  m.recompute_ = mode;
  m.recompute_layers_.assign(static_cast<std::size_t>(sp.num_layers), true);
  if (!layers.empty())
    for (int l = 0; l < sp.num_layers; ++l)
      m.recompute_layers_[static_cast<std::size_t>(l)] =
          layers[static_cast<std::size_t>(sp.first_layer + l)];
  bool every = true;
  for (bool b : m.recompute_layers_) every = every && b;
  m.whole_ = mode == core::recompute_mode::full && every;
}

tensor chunk::forward(int mb, const tensor& input, const tensor& targets, float grad_scale,
                      const dropout_ctx& drop, const tensor& doc_starts) {
  return impl_->forward(mb, input, targets, grad_scale, drop, doc_starts);
}

double chunk::loss_sum(int mb) const { return sum_loss_rows(impl_->be_, loss_rows(mb)); }

tensor chunk::loss_rows(int mb) const {
  TROUPE_CHECK(impl_->spec_.has_head, "loss_sum on a chunk without the head");
  auto it = impl_->losses_.find(mb);
  TROUPE_CHECK(it != impl_->losses_.end(),
               "no loss for micro-batch " + std::to_string(mb) + ": forward it first");
  return it->second;
}

double sum_loss_rows(kernels::backend& be, const tensor& rows) {
  const tensor host = be.to_host(rows);
  double sum = 0;
  for (std::int64_t i = 0; i < host.numel(); ++i) sum += host.data<float>()[i];
  return sum;
}

tensor chunk::backward(int mb, const tensor& grad_out) {
  return impl_->backward_input(mb, grad_out, true);
}

tensor chunk::backward_input(int mb, const tensor& grad_out) {
  return impl_->backward_input(mb, grad_out, false);
}

void chunk::backward_weight(int mb) { impl_->backward_weight(mb); }

void chunk::release(int mb) {
  auto it = impl_->states_.find(mb);
  if (it != impl_->states_.end()) impl_->drop(it);
  impl_->losses_.erase(mb);
}

tensor chunk::forward_logits(const tensor& input) {
  TROUPE_CHECK(impl_->spec_.has_head, "forward_logits on a chunk without the head");
  TROUPE_CHECK(!impl_->tp_on(), "forward_logits on a tensor-parallel chunk");
  const std::int64_t n = impl_->check_rows(input);
  mb_state st;
  if (impl_->spec_.has_embedding)
    st.tokens = impl_->own(input.reshape({n}));
  else
    st.input = impl_->own(input);
  tensor logits = impl_->run(st, keep::nothing, nullptr);
  if (logits.type() == core::dtype::f32) return logits;
  tensor out = impl_->be_.empty(logits.shape(), core::dtype::f32);
  impl_->be_.convert(logits, out);
  return out;
}

kv_cache chunk::make_kv_cache(int slots, int positions) {
  const core::model_config& cfg = impl_->cfg_;
  TROUPE_CHECK(slots > 0 && positions > 0 && positions <= cfg.seq_length,
               "a key/value cache of " + std::to_string(slots) + " slots × " +
                   std::to_string(positions) + " positions (1.." +
                   std::to_string(cfg.seq_length) + " positions: the model's seq_length)");
  kv_cache c;
  c.slots = slots;
  c.positions = positions;
  const core::shape_t shape{slots, positions,
                            static_cast<std::int64_t>(cfg.kv_heads()) * cfg.head_dim()};
  for (int l = 0; l < impl_->spec_.num_layers; ++l)
    c.layers.push_back({impl_->be_.empty(shape, impl_->act_), impl_->be_.empty(shape, impl_->act_)});
  return c;
}

tensor chunk::forward_cached(const tensor& tokens, const cache_rows& at, kv_cache& cache,
                             const std::vector<std::int64_t>& logit_rows) {
  chunk_impl& m = *impl_;
  const core::model_config& cfg = m.cfg_;
  TROUPE_CHECK(!m.tp_on(), "forward_cached on a tensor-parallel chunk");
  TROUPE_CHECK(m.spec_.has_embedding && m.spec_.has_head &&
                   m.spec_.num_layers == cfg.num_layers,
               "forward_cached needs the whole model in one chunk");
  TROUPE_CHECK(static_cast<int>(cache.layers.size()) == m.spec_.num_layers,
               "a key/value cache of " + std::to_string(cache.layers.size()) + " layers for " +
                   std::to_string(m.spec_.num_layers));
  const std::int64_t n = tokens.numel();
  TROUPE_CHECK(n > 0 && tokens.type() == core::dtype::i32 && at.slots.numel() == n &&
                   at.positions.numel() == n,
               "forward_cached wants int32 tokens, slots and positions of one length");
  const auto w = m.weights();
  tensor x = m.ops_->alloc({n, cfg.hidden_size});
  m.be_.embedding_forward_at(tokens, w.emb.wte, w.emb.wpe, at.positions, x);
  for (int l = 0; l < m.spec_.num_layers; ++l)
    x = m.ops_->forward_cached(w.layers[l], x, at, cache.layers[l]);
  // The head reads only the rows whose next token is wanted (a prefill wants one per prompt).
  const auto k = static_cast<std::int64_t>(logit_rows.size());
  TROUPE_CHECK(k > 0, "forward_cached without rows to return logits of");
  bool all = k == n;
  for (std::int64_t i = 0; all && i < k; ++i) all = logit_rows[static_cast<std::size_t>(i)] == i;
  head_acts h;
  h.x = x;
  if (!all) {
    h.x = m.ops_->alloc({k, cfg.hidden_size});
    for (std::int64_t i = 0; i < k; ++i) {
      const std::int64_t r = logit_rows[static_cast<std::size_t>(i)];
      TROUPE_CHECK(r >= 0 && r < n, "logit row " + std::to_string(r) + " of " + std::to_string(n));
      tensor dst = h.x.rows(i, i + 1);
      m.be_.copy(x.rows(r, r + 1), dst);
    }
  }
  tensor logits = m.head_forward(w.head, h);
  if (logits.type() == core::dtype::f32) return logits;
  tensor out = m.be_.empty(logits.shape(), core::dtype::f32);
  m.be_.convert(logits, out);
  return out;
}

std::size_t chunk::saved_activation_bytes() const { return impl_->bytes_; }
std::size_t chunk::peak_saved_activation_bytes() const { return impl_->peak_; }

}  // namespace troupe::model
