// Test helpers for model chunks: tiny configs, a model split into chunks, running micro-batches
// through the chunks in pipeline order, and comparing parameters / gradients by name.
#pragma once

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"

namespace troupe::model::testing {

/// L layers, C=16, H=4 (LLaMA: Hkv=2), T=8, V=50, small MLP.
inline core::model_config tiny_config(core::arch_kind arch, int layers = 2) {
  core::model_config m;
  m.arch = arch;
  m.num_layers = layers;
  m.hidden_size = 16;
  m.num_heads = 4;
  m.num_kv_heads = arch == core::arch_kind::llama ? 2 : 0;
  m.ffn_hidden_size = arch == core::arch_kind::llama ? 24 : 0;
  m.seq_length = 8;
  m.vocab_size = 50;
  m.tie_embeddings = arch == core::arch_kind::gpt2;
  return m;
}

inline std::vector<chunk> make_chunks(const core::model_config& cfg, kernels::backend& be,
                                      int parts) {
  std::vector<chunk> out;
  for (const auto& s : partition(cfg, parts)) out.emplace_back(cfg, s, be);
  return out;
}

/// Host copy of every parameter (or gradient) of the chunks, by name.
inline std::map<std::string, std::vector<float>> by_name(std::vector<chunk>& chunks,
                                                         kernels::backend& be, bool grads) {
  std::map<std::string, std::vector<float>> out;
  for (auto& c : chunks) {
    std::vector<std::string> names;
    for (const auto& p : c.params()) names.push_back(p.name);
    // A head that shares the embedding (chunk::shares_head) still has its own gradient, and its
    // weights are the embedding's: listed as a split lists its copy.
    if (c.shares_head()) names.push_back("lm_head.weight");
    for (const auto& name : names) {
      tensor h = be.to_host(grads ? c.grad(name) : c.param(name));
      out[name].assign(h.data<float>(), h.data<float>() + h.numel());
    }
  }
  return out;
}

/// Writes named values into whichever chunk holds each name.
inline void set_by_name(std::vector<chunk>& chunks, kernels::backend& be,
                        const std::map<std::string, std::vector<float>>& values) {
  for (auto& c : chunks) {
    for (const auto& p : c.params()) {
      const auto& v = values.at(p.name);
      tensor h = tensor::zeros(p.shape);
      std::memcpy(h.raw(), v.data(), v.size() * sizeof(float));
      tensor dst = c.param(p.name);
      be.copy(h, dst);
    }
    c.params_updated();
  }
}

/// Same bytes in every tensor; lists the names that differ.
inline std::vector<std::string> differing(const std::map<std::string, std::vector<float>>& a,
                                          const std::map<std::string, std::vector<float>>& b) {
  std::vector<std::string> out;
  for (const auto& [name, v] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.size() != v.size() ||
        std::memcmp(it->second.data(), v.data(), v.size() * sizeof(float)) != 0)
      out.push_back(name);
  }
  for (const auto& [name, v] : b)
    if (!a.count(name)) out.push_back(name);
  return out;
}

/// int32 tokens [B*T] drawn from the stream `key`, in [0, vocab).
inline tensor random_tokens(const core::model_config& cfg, int batch, std::uint64_t key) {
  tensor t = tensor::zeros({static_cast<std::int64_t>(batch) * cfg.seq_length}, core::dtype::i32);
  core::rng_stream rng(key);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data<std::int32_t>()[i] = static_cast<std::int32_t>(rng.below(cfg.vocab_size));
  return t;
}

/// The forward of micro-batch `mb` through every chunk (drawing the dropout masks of `drop`);
/// returns its loss sum.
inline double forward_all(std::vector<chunk>& chunks, int mb, const tensor& tokens,
                          const tensor& targets, float grad_scale, const dropout_ctx& drop = {}) {
  tensor h = tokens;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const bool last = i + 1 == chunks.size();
    h = chunks[i].forward(mb, h, last ? targets : tensor{}, last ? grad_scale : 0.0f, drop);
  }
  return chunks.back().loss_sum(mb);
}

/// The backward of `mb` through every chunk, last to first; `split` uses
/// backward_input on every chunk first and backward_weight afterwards.
inline void backward_all(std::vector<chunk>& chunks, int mb, bool split = false) {
  tensor g;
  for (std::size_t i = chunks.size(); i-- > 0;)
    g = split ? chunks[i].backward_input(mb, g) : chunks[i].backward(mb, g);
  if (split)
    for (auto& c : chunks) c.backward_weight(mb);
}

}  // namespace troupe::model::testing
