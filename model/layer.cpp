// The family-independent skeleton of a transformer layer: norms, attention, residual adds, and
// the order in which the two backward phases visit the ops. See layer.hpp.
#include "model/layer.hpp"

#include "core/error.hpp"
#include "core/rng.hpp"
#include "model/params.hpp"

namespace troupe::model {

kernels::dropout_spec dropout_ctx::at(int layer, dropout_site site) const {
  kernels::dropout_spec s;
  s.p = site == dropout_site::attention ? attention : hidden;
  if (s.p <= 0) return {};
  s.key = core::stream_key(step_key, static_cast<std::uint64_t>(layer),
                           static_cast<std::uint64_t>(site));
  s.first_sample = first_sample;
  return s;
}

dropout_ctx training_dropout(const core::model_config& cfg, std::uint64_t seed, std::int64_t step,
                             std::int64_t first_sample) {
  dropout_ctx d;
  d.attention = cfg.attention_dropout;
  d.hidden = cfg.hidden_dropout;
  d.step_key = core::stream_key(seed, core::hash_name("dropout"), static_cast<std::uint64_t>(step));
  d.first_sample = first_sample;
  return d;
}

layer_ops::layer_ops(const core::model_config& cfg, kernels::backend& be, core::dtype act,
                     const layer_split* split, layer_comm* comm)
    : cfg_(cfg),
      be_(be),
      act_(act),
      heads_(split ? split->heads : cfg.num_heads),
      kv_heads_(split ? split->kv_heads : cfg.kv_heads()),
      first_head_(split ? split->first_head : 0),
      kv_replicated_(split && split->kv_replicated),
      comm_(comm),
      qkv_width_(static_cast<std::int64_t>(heads_ + 2 * kv_heads_) * cfg.head_dim()),
      ffn_(split ? split->ffn : ffn_hidden(cfg)),
      lora_scale_(lora_scale(cfg)),
      branch_bias_(cfg.arch == core::arch_kind::gpt2 && comm == nullptr &&
                   cfg.hidden_dropout <= 0),
      qkv_bias_sum_(cfg.arch == core::arch_kind::gpt2 && comm == nullptr) {
  TROUPE_CHECK((split == nullptr) == (comm == nullptr),
               "a tensor-parallel layer needs both its split and its group");
  TROUPE_CHECK(!comm || cfg.lora.rank == 0,
               "LoRA adapters are not supported with tensor parallel (parallel.model_parallel > 1)");
}

tensor layer_ops::alloc(const core::shape_t& shape, core::dtype t) { return be_.empty(shape, t); }

tensor layer_ops::zeros(const core::shape_t& shape, core::dtype t) {
  tensor out = be_.empty(shape, t);
  // The CPU backend hands out zero-filled memory already (backend.hpp); others do not.
  if (!be_.dev().is_cpu()) be_.zero(out);
  return out;
}

kernels::attention_dims layer_ops::dims(std::int64_t rows) const {
  TROUPE_CHECK(rows % cfg_.seq_length == 0,
               std::to_string(rows) + " rows are not whole sequences of " +
                   std::to_string(cfg_.seq_length));
  kernels::attention_dims d{static_cast<int>(rows / cfg_.seq_length), cfg_.seq_length, heads_,
                           kv_heads_, cfg_.head_dim()};
  d.dropout_first_head = first_head_;
  return d;
}

void layer_ops::norm_stats(std::int64_t n, tensor& mean, tensor& rstd) {
  if (cfg_.arch == core::arch_kind::gpt2) mean = alloc({n}, core::dtype::f32);
  rstd = alloc({n}, core::dtype::f32);
}

void layer_ops::norm_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y,
                             tensor& mean, tensor& rstd) {
  const auto eps = static_cast<float>(cfg_.norm_eps);
  if (cfg_.arch == core::arch_kind::gpt2)
    be_.layernorm_forward(x, w, b, eps, y, mean, rstd);
  else
    be_.rmsnorm_forward(x, w, eps, y, rstd);
}

void layer_ops::norm_backward(const tensor& dy, const tensor& x, const tensor& w,
                              const tensor& mean, const tensor& rstd, tensor& dx, tensor& dw,
                              tensor& db) {
  if (cfg_.arch == core::arch_kind::gpt2)
    be_.layernorm_backward(dy, x, w, mean, rstd, dx, dw, db);
  else
    be_.rmsnorm_backward(dy, x, w, rstd, dx, dw);
}

void layer_ops::norm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                       const tensor& mean, const tensor& rstd,
                                       const tensor& residual, tensor& dx, tensor& dw,
                                       tensor& db, tensor& rsum) {
  if (cfg_.arch == core::arch_kind::gpt2) {
    be_.layernorm_backward_residual(dy, x, w, mean, rstd, residual, dx, dw, db, rsum);
  } else {
    TROUPE_CHECK(!rsum.defined(), "RMSNorm's backward sums no residual");
    be_.rmsnorm_backward_residual(dy, x, w, rstd, residual, dx, dw);
  }
}

void layer_ops::attention_input(const layer_tensors& w, const tensor& x, const tensor* positions,
                                layer_acts& a) {
  const std::int64_t n = x.dim(0), c = cfg_.hidden_size;
  a.x = x;
  a.n1 = alloc({n, c});
  norm_stats(n, a.mean1, a.rstd1);
  norm_forward(x, w.norm1_w, w.norm1_b, a.n1, a.mean1, a.rstd1);
  // Column-parallel qkv reads every row; under sequence parallel a.n1 keeps this rank's rows
  // only and the weight phase gathers them again (backward_weight).
  const tensor n1 = comm_ ? comm_->gather_rows(a.n1) : a.n1;
  a.qkv = qkv_forward(w, n1, positions);
}

tensor layer_ops::residual_branch(const tensor& in, const tensor& w, const tensor& b,
                                  const lora_pair& l, const tensor& residual,
                                  const kernels::dropout_spec& drop) {
  if (comm_) {
    // Row-parallel: each rank's partial product over its heads / MLP columns; the bias joins
    // once, on rank 0, so the group's sum holds it once.
    tensor partial = alloc({in.dim(0), cfg_.hidden_size});
    be_.linear_forward(in, w, comm_->rank() == 0 ? b : tensor{}, partial);
    tensor out = comm_->reduce_rows(partial);
    if (drop.on()) dropout_hidden(out, drop, out);
    be_.add(out, residual, out);
    return out;
  }
  tensor out = alloc(residual.shape());
  if (!drop.on()) {
    be_.linear_forward_residual(in, w, b, residual, out);
    lora_forward(l, in, out);
    return out;
  }
  be_.linear_forward(in, w, b, out);
  lora_forward(l, in, out);
  be_.dropout(out, drop, std::int64_t(cfg_.seq_length) * cfg_.hidden_size, out);
  be_.add(out, residual, out);
  return out;
}

tensor layer_ops::branch_grad(const tensor& dy, const kernels::dropout_spec& drop) {
  if (!drop.on()) return dy;
  tensor out = alloc(dy.shape());
  dropout_hidden(dy, drop, out);
  return out;
}

void layer_ops::dropout_hidden(const tensor& x, const kernels::dropout_spec& drop, tensor& y) {
  const std::int64_t T = cfg_.seq_length, C = cfg_.hidden_size, n = x.dim(0);
  const bool sp = comm_ && comm_->sequence_parallel();
  const std::int64_t row0 = sp ? comm_->rank() * n : 0;
  if (row0 % T == 0 && n % T == 0) {
    kernels::dropout_spec s = drop;
    s.first_sample += row0 / T;
    be_.dropout(x, s, T * C, y);
    return;
  }
  // This rank's rows cut a sequence: draw the whole micro-batch's mask and keep these rows.
  tensor whole = zeros({n * comm_->size(), C});
  tensor mine = whole.rows(row0, row0 + n);
  be_.copy(x, mine);
  be_.dropout(whole, drop, T * C, whole);
  be_.copy(mine, y);
}

tensor layer_ops::attention_output(const layer_tensors& w, layer_acts& a) {
  const std::int64_t n = a.x.dim(0), c = cfg_.hidden_size;
  a.mid = residual_branch(a.att, w.proj_w, w.proj_b, w.proj_l, a.x, a.drop.attention_out);
  a.n2 = alloc({n, c});
  norm_stats(n, a.mean2, a.rstd2);
  norm_forward(a.mid, w.norm2_w, w.norm2_b, a.n2, a.mean2, a.rstd2);
  if (!comm_ || !comm_->sequence_parallel()) return mlp_forward(w, a);
  // The column-parallel MLP reads every row; a.n2 keeps this rank's rows (as a.n1 does).
  const tensor mine = a.n2;
  a.n2 = comm_->gather_rows(mine);
  tensor out = mlp_forward(w, a);
  a.n2 = mine;
  return out;
}

tensor layer_ops::forward(const layer_tensors& w, const tensor& x, layer_acts& a,
                         const layer_dropout& drop, const doc_rows& docs) {
  a.drop = drop;
  a.docs = docs;
  attention_input(w, x, docs.on() ? &docs.positions : nullptr, a);
  recompute_attention(a);
  return attention_output(w, a);
}

tensor layer_ops::forward_cached(const layer_tensors& w, const tensor& x, const cache_rows& at,
                                 layer_cache& c) {
  TROUPE_CHECK(!comm_, "cached generation does not run tensor parallel");
  layer_acts a;
  attention_input(w, x, &at.positions, a);
  const kernels::attention_dims d{0, 0, heads_, kv_heads_, cfg_.head_dim()};
  be_.kv_cache_write(a.qkv, at.slots, at.positions, d, c.k, c.v);
  a.att = alloc({x.dim(0), static_cast<std::int64_t>(d.heads) * d.head_dim});
  be_.attention_decode(a.qkv, at.slots, at.positions, c.k, c.v, d, a.att);
  return attention_output(w, a);
}

void layer_ops::recompute_attention(layer_acts& a) {
  const std::int64_t n = a.qkv.dim(0);
  auto d = dims(n);
  d.dropout = a.drop.attention;
  d.doc_start = a.docs.start;
  a.att = alloc({n, static_cast<std::int64_t>(d.heads) * d.head_dim});
  a.lse = alloc({d.batch, d.heads, d.seq}, core::dtype::f32);
  be_.attention_forward(a.qkv, d, a.att, a.lse);
}

tensor layer_ops::backward_input(const layer_tensors& w, layer_acts& a, const tensor& dy,
                                 layer_stash& s, layer_tensors* norm_grads) {
  const std::int64_t n = a.x.dim(0), c = cfg_.hidden_size;
  TROUPE_CHECK(dy.shape() == a.x.shape(), "layer gradient " + core::shape_string(dy.shape()) +
                                              " does not match its input " +
                                              core::shape_string(a.x.shape()));
  // Under sequence parallel each rank's norm weight gradients cover its rows only: they are
  // computed into scratch and summed over the group before they join the parameter gradients.
  const bool sp = comm_ && comm_->sequence_parallel();
  // Norm weight gradients go either straight into the parameter gradients (views, so a copy of
  // the handle writes through) or into scratch that is thrown away: the weight phase then
  // recomputes them from the stashed dy.
  s.norms_done = norm_grads != nullptr;
  tensor dw1, db1, dw2, db2;
  if (norm_grads && !sp) {
    dw1 = norm_grads->norm1_w, db1 = norm_grads->norm1_b;
    dw2 = norm_grads->norm2_w, db2 = norm_grads->norm2_b;
  }
  // Scratch where the weight gradients are not wanted now, or never (a frozen norm).
  const bool bias = w.norm1_b.defined();
  for (auto [dw, db] : {std::pair{&dw1, &db1}, std::pair{&dw2, &db2}}) {
    if (!dw->defined()) *dw = zeros({c}, core::dtype::f32);
    if (bias && !db->defined()) *db = zeros({c}, core::dtype::f32);
  }
  // The projections' bias gradients from the norms' backward (branch_bias_from_norm): c_proj's
  // output gradient is dy, the attention projection's is d_mid, the residuals of norm2 and norm1.
  // Without norm_grads the weight phase reruns both norms' backward for them.
  tensor out_b_sum, proj_b_sum;
  if (branch_bias_ && norm_grads) {
    TROUPE_CHECK(!a.drop.mlp_out.on() && !a.drop.attention_out.on(),
                 "hidden dropout with the projections' bias gradients taken from the norms");
    out_b_sum = norm_grads->out_b;
    proj_b_sum = norm_grads->proj_b;
  }

  // Buffers an op writes whole are allocated, not zeroed; only accumulated ones are zeroed.
  // Tensor parallel: the MLP and attention run on every row (rows = a.n2's), their input
  // gradients are reduced back to the residual stream's rows (n).
  // Under sequence parallel the stash keeps this rank's rows of the row-parallel GEMMs' output
  // gradients (d_out, d_mid); backward_weight gathers them again.
  const tensor d_out_mine = branch_grad(dy, a.drop.mlp_out);
  const tensor d_out = comm_ ? comm_->gather_rows(d_out_mine) : d_out_mine;
  tensor dn2 = alloc({d_out.dim(0), c});
  mlp_backward_input(w, a, d_out, dn2, s);
  if (sp) s.d_out = d_out_mine;
  if (comm_) dn2 = comm_->reduce_rows(dn2);
  tensor d_mid = alloc({n, c});
  // dy reaches d_mid twice: along the residual path (unmasked) and through the norm.
  norm_backward_residual(dn2, a.mid, w.norm2_w, a.mean2, a.rstd2, dy, d_mid, dw2, db2,
                         out_b_sum);
  if (!s.norms_done) s.d_n2 = dn2;

  if (!a.att.defined()) recompute_attention(a);
  const std::int64_t rows = a.qkv.dim(0);
  tensor datt = alloc({rows, a.att.dim(1)});
  const tensor d_branch_mine = branch_grad(d_mid, a.drop.attention_out);
  const tensor d_branch = comm_ ? comm_->gather_rows(d_branch_mine) : d_branch_mine;
  be_.linear_backward_input_write(d_branch, w.proj_w, datt);
  lora_backward_input(w.proj_l, d_branch, datt);
  s.d_mid = sp ? d_branch_mine : d_branch;
  tensor dqkv = alloc({rows, qkv_width_});
  auto d = dims(rows);
  d.dropout = a.drop.attention;
  d.doc_start = a.docs.start;
  // The qkv bias gradient: the column sums of dqkv, from the pass that writes it; the weight
  // phase adds them to the gradient (qkv_bias_sum_).
  tensor dsum;
  if (qkv_bias_sum_ && s.sum_qkv_bias) dsum = alloc({qkv_width_}, core::dtype::f32);
  be_.attention_backward_write(datt, a.qkv, a.att, a.lse, d, dqkv, dsum);
  s.d_qkv_b = dsum;
  tensor dn1 = alloc({rows, c});
  qkv_backward_input(w, dqkv, dn1, s, a.docs.on() ? &a.docs.positions : nullptr);
  if (comm_) dn1 = comm_->reduce_rows(dn1);

  tensor dx = alloc({n, c});
  norm_backward_residual(dn1, a.x, w.norm1_w, a.mean1, a.rstd1, d_mid, dx, dw1, db1,
                         proj_b_sum);
  if (!s.norms_done) s.d_n1 = dn1;
  if (norm_grads && sp)
    for (auto [part, g] : {std::pair{&dw2, &norm_grads->norm2_w}, std::pair{&db2, &norm_grads->norm2_b},
                           std::pair{&dw1, &norm_grads->norm1_w}, std::pair{&db1, &norm_grads->norm1_b}})
      if (g->defined()) be_.accumulate(comm_->all_reduce(*part), *g);
  return dx;
}

void layer_ops::backward_weight(const layer_tensors& w, const layer_acts& a,
                                const layer_stash& s, layer_tensors& g) {
  const std::int64_t n = a.x.dim(0), c = cfg_.hidden_size;
  // Sequence parallel: the norm outputs and the row-parallel GEMMs' output gradients were kept
  // as this rank's rows; the GEMMs' weight gradients read every row, so they are gathered again
  // (the same bits the forward and backward_input gathered).
  layer_acts whole;
  layer_stash whole_s;
  const layer_acts* full = &a;
  const layer_stash* fs = &s;
  if (comm_ && comm_->sequence_parallel()) {
    whole = a;
    whole.n1 = comm_->gather_rows(a.n1);
    whole.n2 = comm_->gather_rows(a.n2);
    whole_s = s;
    whole_s.d_out = comm_->gather_rows(s.d_out);
    whole_s.d_mid = comm_->gather_rows(s.d_mid);
    full = &whole;
    fs = &whole_s;
  }
  mlp_backward_weight(w, *full, *fs, g);
  tensor none;
  if (g.proj_w.defined())
    weight_grad(fs->d_mid, a.att, g.proj_w, branch_bias_ ? none : g.proj_b, g.fresh);
  lora_backward_weight(w.proj_l, a.att, fs->d_mid, g.proj_l);
  qkv_backward_weight(w, *full, *fs, g);
  if (s.norms_done) return;
  if (branch_bias_) {
    // The norms' backward as backward_input runs it (the same residuals, so the same bits), for
    // their weight gradients and the projections' biases; dx is scratch.
    for (int which : {2, 1}) {
      tensor dw = which == 2 ? g.norm2_w : g.norm1_w, db = which == 2 ? g.norm2_b : g.norm1_b;
      tensor rsum = which == 2 ? g.out_b : g.proj_b;
      if (!dw.defined() && !db.defined() && !rsum.defined()) continue;
      if (!dw.defined()) dw = zeros({c}, core::dtype::f32);
      if (!db.defined() && w.norm1_b.defined()) db = zeros({c}, core::dtype::f32);
      tensor dx_scratch = alloc({n, c});
      if (which == 2)
        norm_backward_residual(s.d_n2, a.mid, w.norm2_w, a.mean2, a.rstd2, s.d_out, dx_scratch,
                               dw, db, rsum);
      else
        norm_backward_residual(s.d_n1, a.x, w.norm1_w, a.mean1, a.rstd1, s.d_mid, dx_scratch, dw,
                               db, rsum);
    }
    return;
  }
  // The input gradient was produced in backward_input; this pass only wants dw and db.
  if (!g.norm1_w.defined() && !g.norm2_w.defined()) return;
  tensor dx_scratch = zeros({n, c});
  if (!comm_ || !comm_->sequence_parallel()) {
    if (g.norm2_w.defined())
      norm_backward(s.d_n2, a.mid, w.norm2_w, a.mean2, a.rstd2, dx_scratch, g.norm2_w, g.norm2_b);
    if (g.norm1_w.defined())
      norm_backward(s.d_n1, a.x, w.norm1_w, a.mean1, a.rstd1, dx_scratch, g.norm1_w, g.norm1_b);
    return;
  }
  // Sequence parallel: this rank's rows' share, summed over the group.
  const bool bias = w.norm1_b.defined();
  for (int which : {2, 1}) {
    tensor& gw = which == 2 ? g.norm2_w : g.norm1_w;
    tensor& gb = which == 2 ? g.norm2_b : g.norm1_b;
    if (!gw.defined()) continue;
    tensor dw = zeros({c}, core::dtype::f32), db = bias ? zeros({c}, core::dtype::f32) : tensor{};
    if (which == 2)
      norm_backward(s.d_n2, a.mid, w.norm2_w, a.mean2, a.rstd2, dx_scratch, dw, db);
    else
      norm_backward(s.d_n1, a.x, w.norm1_w, a.mean1, a.rstd1, dx_scratch, dw, db);
    be_.accumulate(comm_->all_reduce(dw), gw);
    if (gb.defined()) be_.accumulate(comm_->all_reduce(db), gb);
  }
}

void layer_ops::keep_for_weight(layer_acts& a) const {
  a.qkv = {};
  a.lse = {};
  mlp_keep_for_weight(a);
}

void layer_ops::mlp_keep_for_weight(layer_acts& a) const {
  a.fc = {};
  a.up = {};
}

std::unique_ptr<layer_ops> make_layer_ops(const core::model_config& cfg, kernels::backend& be,
                                          core::dtype act) {
  if (cfg.arch == core::arch_kind::gpt2) return make_gpt2_layer_ops(cfg, be, act);
  return make_llama_layer_ops(cfg, be, act);
}

std::unique_ptr<layer_ops> make_layer_ops(const core::model_config& cfg, kernels::backend& be,
                                          core::dtype act, const layer_split& split,
                                          layer_comm& comm) {
  if (cfg.arch == core::arch_kind::gpt2) return make_gpt2_layer_ops(cfg, be, act, &split, &comm);
  return make_llama_layer_ops(cfg, be, act, &split, &comm);
}

}  // namespace troupe::model
