// Tensor-parallel shapes, sharding by parameter name, and the vocabulary-parallel embedding and
// cross-entropy. See tensor_parallel.hpp.
//
// The embedding and the loss work on host copies of their inputs (backend::to_host): they are
// gathers and row statistics, not GEMMs, and every backend runs them through the same code; the
// head's GEMMs stay on the backend.
#include "model/tensor_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.hpp"
#include "model/params.hpp"

namespace troupe::model {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// How a parameter splits.
enum class rule {
  replicated,  // whole on every rank
  rows,        // output features (dim 0) in tp equal blocks
  qkv_rows,    // GPT-2 c_attn: q, k and v blocks of dim 0, each split in tp equal blocks
  kv_rows,     // LLaMA k/v_proj: by key/value heads, or the head this rank's queries read
  columns,     // input features (dim 1) in tp equal blocks
  vocab,       // vocabulary rows, padded to a multiple of tp
};

rule rule_of(const core::model_config& cfg, const std::string& name) {
  TROUPE_CHECK(name.find(".lora_") == std::string::npos,
               "LoRA adapters are not split for tensor parallel: " + name);
  if (name == embedding_name(cfg) || name == "lm_head.weight") return rule::vocab;
  if (cfg.arch == core::arch_kind::gpt2) {
    if (ends_with(name, "attn.c_attn.weight") || ends_with(name, "attn.c_attn.bias"))
      return rule::qkv_rows;
    if (ends_with(name, "mlp.c_fc.weight") || ends_with(name, "mlp.c_fc.bias")) return rule::rows;
    if (ends_with(name, "attn.c_proj.weight") || ends_with(name, "mlp.c_proj.weight"))
      return rule::columns;
    return rule::replicated;  // ln_*, wpe, the row-parallel biases
  }
  if (ends_with(name, "self_attn.q_proj.weight") || ends_with(name, "mlp.gate_proj.weight") ||
      ends_with(name, "mlp.up_proj.weight"))
    return rule::rows;
  if (ends_with(name, "self_attn.k_proj.weight") || ends_with(name, "self_attn.v_proj.weight"))
    return rule::kv_rows;
  if (ends_with(name, "self_attn.o_proj.weight") || ends_with(name, "mlp.down_proj.weight"))
    return rule::columns;
  return rule::replicated;  // norms
}

// Elements per row of dim 0 (1 for a vector).
std::int64_t row_elems(const tensor& t) { return t.rank() > 1 ? t.numel() / t.dim(0) : 1; }

// Copies rows [src_row, src_row + n) of src into rows [dst_row, ...) of dst (host fp32).
void copy_rows(const tensor& src, std::int64_t src_row, tensor& dst, std::int64_t dst_row,
               std::int64_t n) {
  const std::int64_t w = row_elems(src);
  std::memcpy(dst.data<float>() + dst_row * w, src.data<float>() + src_row * w,
              static_cast<std::size_t>(n * w) * sizeof(float));
}

core::shape_t with_dim(core::shape_t s, int d, std::int64_t v) {
  s[static_cast<std::size_t>(d)] = v;
  return s;
}

}  // namespace

int kv_replicas(const core::model_config& cfg, int tp) {
  const int kv = cfg.kv_heads();
  return kv >= tp ? 1 : tp / kv;
}

layer_split split_of(const core::model_config& cfg, int tp, int rank) {
  const int kv = cfg.kv_heads(), ffn = ffn_hidden(cfg);
  TROUPE_CHECK(tp >= 1 && rank >= 0 && rank < tp,
               "rank " + std::to_string(rank) + " outside a group of " + std::to_string(tp));
  TROUPE_CHECK(cfg.num_heads % tp == 0 && ffn % tp == 0 &&
                   (kv % tp == 0 || (kv < tp && tp % kv == 0)),
               "model_parallel " + std::to_string(tp) + " does not split num_heads " +
                   std::to_string(cfg.num_heads) + ", num_kv_heads " + std::to_string(kv) +
                   " and ffn " + std::to_string(ffn) + " (troupe config check names valid values)");
  layer_split s;
  s.heads = cfg.num_heads / tp;
  s.first_head = rank * s.heads;
  s.kv_replicated = kv < tp;
  s.kv_heads = s.kv_replicated ? 1 : kv / tp;
  s.ffn = ffn / tp;
  return s;
}

vocab_range vocab_range_of(std::int64_t vocab, int tp, int rank) {
  vocab_range v;
  v.padded = (vocab + tp - 1) / tp * tp;
  v.rows = v.padded / tp;
  v.first = rank * v.rows;
  v.valid = std::clamp<std::int64_t>(vocab - v.first, 0, v.rows);
  return v;
}

std::unique_ptr<layer_ops> make_tp_layer_ops(const core::model_config& cfg, kernels::backend& be,
                                             core::dtype act, int tp, layer_comm& comm) {
  TROUPE_CHECK(comm.size() == tp, "a group of " + std::to_string(comm.size()) +
                                      " ranks for model_parallel " + std::to_string(tp));
  const layer_split s = split_of(cfg, tp, comm.rank());
  return make_layer_ops(cfg, be, act, s, comm);
}

core::shape_t shard_shape(const core::model_config& cfg, const std::string& name,
                          const core::shape_t& full, int tp, int rank) {
  core::shape_t s = full;
  switch (rule_of(cfg, name)) {
    case rule::replicated: break;
    case rule::rows:
    case rule::qkv_rows: s[0] /= tp; break;
    case rule::kv_rows: s[0] = cfg.kv_heads() >= tp ? s[0] / tp : cfg.head_dim(); break;
    case rule::columns: s[1] /= tp; break;
    case rule::vocab: s[0] = vocab_range_of(s[0], tp, rank).rows; break;
  }
  return s;
}

bool replicated(const core::model_config& cfg, const std::string& name) {
  return rule_of(cfg, name) == rule::replicated;
}

std::vector<param_def> shard_defs(const core::model_config& cfg, std::vector<param_def> defs,
                                  int tp, int rank) {
  std::int64_t next = 0;
  for (auto& d : defs) {
    d.info.shape = shard_shape(cfg, d.info.name, d.info.shape, tp, rank);
    d.info.numel = core::numel_of(d.info.shape);
    d.info.offset = next;
    next += (d.info.numel + kernels::norm_block - 1) / kernels::norm_block * kernels::norm_block;
  }
  return defs;
}

tensor unshard_param(const core::model_config& cfg, const std::vector<param_def>& defs,
                     std::size_t i, int tp, const std::function<const tensor&(int)>& flat) {
  const param_info& whole = defs.at(i).info;
  if (tp == 1) return flat(0).slice(whole.offset, whole.shape);
  std::vector<tensor> shards;
  for (int t = 0; t < tp; ++t) {
    const param_info mine = shard_defs(cfg, defs, tp, t)[i].info;
    const tensor& f = flat(t);
    TROUPE_CHECK(f.numel() >= mine.offset + mine.numel,
                 "the parameters of tensor-parallel rank " + std::to_string(t) + " end before " +
                     whole.name);
    shards.push_back(f.slice(mine.offset, mine.shape));
  }
  return unshard_tensor(cfg, whole.name, shards);
}

bool counts_in_norm(const core::model_config& cfg, const std::string& name, int tp, int rank) {
  switch (rule_of(cfg, name)) {
    case rule::replicated: return rank == 0;
    case rule::kv_rows: return rank % kv_replicas(cfg, tp) == 0;
    default: return true;
  }
}

tensor shard_tensor(const core::model_config& cfg, const std::string& name, const tensor& full,
                    int tp, int rank) {
  TROUPE_CHECK(full.type() == core::dtype::f32 && full.dev().is_cpu(),
               "shard_tensor: " + name + " must be a host fp32 tensor");
  const rule r = rule_of(cfg, name);
  const std::int64_t n0 = full.dim(0);
  switch (r) {
    case rule::replicated:
      return full.clone();
    case rule::rows: {
      tensor out = tensor::zeros(with_dim(full.shape(), 0, n0 / tp));
      copy_rows(full, rank * (n0 / tp), out, 0, n0 / tp);
      return out;
    }
    case rule::qkv_rows: {
      const std::int64_t block = n0 / 3, part = block / tp;
      tensor out = tensor::zeros(with_dim(full.shape(), 0, 3 * part));
      for (int b = 0; b < 3; ++b) copy_rows(full, b * block + rank * part, out, b * part, part);
      return out;
    }
    case rule::kv_rows: {
      const int kv = cfg.kv_heads();
      const std::int64_t d = cfg.head_dim();
      if (kv >= tp) {
        tensor out = tensor::zeros(with_dim(full.shape(), 0, n0 / tp));
        copy_rows(full, rank * (n0 / tp), out, 0, n0 / tp);
        return out;
      }
      const int head = rank / (tp / kv);  // the key/value head this rank's query heads read
      tensor out = tensor::zeros(with_dim(full.shape(), 0, d));
      copy_rows(full, head * d, out, 0, d);
      return out;
    }
    case rule::columns: {
      const std::int64_t cols = full.dim(1), part = cols / tp;
      tensor out = tensor::zeros({n0, part});
      for (std::int64_t i = 0; i < n0; ++i)
        std::memcpy(out.data<float>() + i * part, full.data<float>() + i * cols + rank * part,
                    static_cast<std::size_t>(part) * sizeof(float));
      return out;
    }
    case rule::vocab: {
      const vocab_range v = vocab_range_of(n0, tp, rank);
      tensor out = tensor::zeros(with_dim(full.shape(), 0, v.rows));  // padded rows stay zero
      copy_rows(full, v.first, out, 0, v.valid);
      return out;
    }
  }
  return {};
}

tensor unshard_tensor(const core::model_config& cfg, const std::string& name,
                      const std::vector<tensor>& shards) {
  const int tp = static_cast<int>(shards.size());
  TROUPE_CHECK(tp >= 1, "unshard_tensor: no slices of " + name);
  const rule r = rule_of(cfg, name);
  const tensor& s0 = shards[0];
  switch (r) {
    case rule::replicated:
      return s0.clone();
    case rule::rows: {
      const std::int64_t part = s0.dim(0);
      tensor out = tensor::zeros(with_dim(s0.shape(), 0, part * tp));
      for (int k = 0; k < tp; ++k) copy_rows(shards[k], 0, out, k * part, part);
      return out;
    }
    case rule::qkv_rows: {
      const std::int64_t part = s0.dim(0) / 3, block = part * tp;
      tensor out = tensor::zeros(with_dim(s0.shape(), 0, 3 * block));
      for (int k = 0; k < tp; ++k)
        for (int b = 0; b < 3; ++b) copy_rows(shards[k], b * part, out, b * block + k * part, part);
      return out;
    }
    case rule::kv_rows: {
      const int kv = cfg.kv_heads();
      if (kv >= tp) {
        const std::int64_t part = s0.dim(0);
        tensor out = tensor::zeros(with_dim(s0.shape(), 0, part * tp));
        for (int k = 0; k < tp; ++k) copy_rows(shards[k], 0, out, k * part, part);
        return out;
      }
      const std::int64_t d = cfg.head_dim();
      tensor out = tensor::zeros(with_dim(s0.shape(), 0, d * kv));
      for (int head = 0; head < kv; ++head) copy_rows(shards[head * (tp / kv)], 0, out, head * d, d);
      return out;
    }
    case rule::columns: {
      const std::int64_t rows = s0.dim(0), part = s0.dim(1);
      tensor out = tensor::zeros({rows, part * tp});
      for (int k = 0; k < tp; ++k)
        for (std::int64_t i = 0; i < rows; ++i)
          std::memcpy(out.data<float>() + i * part * tp + k * part, shards[k].data<float>() + i * part,
                      static_cast<std::size_t>(part) * sizeof(float));
      return out;
    }
    case rule::vocab: {
      const std::int64_t vocab = cfg.vocab_size;
      tensor out = tensor::zeros(with_dim(s0.shape(), 0, vocab));
      for (int k = 0; k < tp; ++k) {
        const vocab_range v = vocab_range_of(vocab, tp, k);
        TROUPE_CHECK(shards[k].dim(0) == v.rows, "unshard_tensor: " + name + " slice " +
                                                     std::to_string(k) + " has " +
                                                     std::to_string(shards[k].dim(0)) +
                                                     " rows, expected " + std::to_string(v.rows));
        copy_rows(shards[k], 0, out, v.first, v.valid);
      }
      return out;
    }
  }
  return {};
}

tensor vp_embedding_forward(layer_comm& comm, kernels::backend& be, const embedding_tensors& w,
                            const tensor& tokens, std::int64_t vocab, int seq) {
  const vocab_range v = vocab_range_of(vocab, comm.size(), comm.rank());
  TROUPE_CHECK(w.wte.type() == core::dtype::f32 && w.wte.dim(0) == v.rows,
               "vp_embedding_forward: this rank's wte must be fp32 [" + std::to_string(v.rows) +
                   ", C], got " + core::shape_string(w.wte.shape()));
  tensor out = be.empty({tokens.numel(), w.wte.dim(1)}, core::dtype::f32);
  // Rank 0 adds the positions, so the group's sum holds them once.
  be.vp_embedding_forward(tokens, w.wte, v.first, v.valid, vocab,
                          comm.rank() == 0 ? w.wpe : tensor{}, seq, out);
  return comm.reduce_rows(out);
}

void vp_embedding_backward(layer_comm& comm, kernels::backend& be, const tensor& dout,
                           const tensor& tokens, std::int64_t vocab, int seq,
                           embedding_tensors& g) {
  const vocab_range v = vocab_range_of(vocab, comm.size(), comm.rank());
  const tensor d = comm.gather_rows(dout);
  TROUPE_CHECK(d.dim(0) == tokens.numel(), "vp_embedding_backward: " + std::to_string(d.dim(0)) +
                                               " gradient rows for " +
                                               std::to_string(tokens.numel()) + " tokens");
  be.vp_embedding_backward(d, tokens, v.first, v.valid, seq, g.wte, g.wpe);
}

vp_loss vp_cross_entropy(layer_comm& comm, kernels::backend& be, const tensor& h,
                         const tensor& head_w, const tensor& targets, std::int64_t vocab,
                         float grad_scale, tensor& dw) {
  const vocab_range v = vocab_range_of(vocab, comm.size(), comm.rank());
  TROUPE_CHECK(head_w.dim(0) == v.rows, "vp_cross_entropy: this rank's lm_head has " +
                                            std::to_string(head_w.dim(0)) + " rows, expected " +
                                            std::to_string(v.rows));
  const tensor hf = comm.gather_rows(h);  // every row meets this rank's vocabulary columns
  const std::int64_t n = hf.dim(0), cols = v.rows;
  TROUPE_CHECK(targets.numel() == n, "vp_cross_entropy: " + std::to_string(targets.numel()) +
                                         " targets for " + std::to_string(n) + " rows");
  tensor z = be.empty({n, cols}, core::dtype::f32);  // the logits, then d logits
  be.linear_forward(hf, head_w, {}, z);

  // 1. The row maxima over this rank's real columns, all-gathered: every rank takes the largest
  // of the same numbers.
  tensor local_max = be.empty({n}, core::dtype::f32);
  be.vp_row_max(z, v.valid, local_max);
  const tensor maxima = comm.all_gather(local_max);
  // 2. Σ exp(z - m) over this rank's columns and the target's logit where this rank holds it;
  // one sum over the group for both.
  tensor stats = be.empty({2 * n}, core::dtype::f32);
  be.vp_row_stats(z, v.valid, maxima, targets, v.first, vocab, stats);
  const tensor sums = comm.all_reduce(stats);

  vp_loss out;
  out.losses = be.empty({n}, core::dtype::f32);
  be.vp_losses(maxima, sums, targets, out.losses);
  if (grad_scale == 0.0f) return out;

  // 3. d logits = (softmax - onehot) * grad_scale on this rank's columns; padded columns 0.
  be.vp_softmax_grad(z, v.valid, maxima, sums, targets, v.first, grad_scale);
  tensor dh = be.empty({n, hf.dim(1)}, hf.type());
  be.linear_backward_input_write(z, head_w, dh);
  out.dh = comm.reduce_rows(dh);
  if (dw.defined()) {
    tensor none;
    be.linear_backward_weight(z, hf, dw, none);
  } else {
    out.dlogits = z;
    out.input = hf;
  }
  return out;
}

}  // namespace troupe::model
