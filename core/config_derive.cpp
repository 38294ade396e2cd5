// Values derived from a config: batch and worker arithmetic, and the exact parameter count of
// both architectures (weights as model/ lays them out, tied embeddings counted once).
#include <algorithm>

#include "core/chunk_placement.hpp"
#include "core/config.hpp"

namespace troupe::core {

std::int64_t parameter_count(const model_config& m) {
  const std::int64_t V = m.vocab_size, C = m.hidden_size, T = m.seq_length, L = m.num_layers;
  const std::int64_t F = m.ffn_size();
  const std::int64_t head = m.tie_embeddings ? 0 : V * C;  // no bias on the output head
  if (m.arch == arch_kind::gpt2) {
    const std::int64_t layer = 2 * C                 // ln_1 weight, bias
                               + 3 * C * C + 3 * C   // attn.c_attn (q, k, v)
                               + C * C + C           // attn.c_proj
                               + 2 * C               // ln_2
                               + F * C + F           // mlp.c_fc
                               + C * F + C;          // mlp.c_proj
    return V * C + T * C + L * layer + 2 * C + head;  // wte, wpe, layers, ln_f
  }
  const std::int64_t kv = static_cast<std::int64_t>(m.kv_heads()) * m.head_dim();
  const std::int64_t layer = C                        // input_layernorm
                             + C * C + 2 * kv * C     // q_proj, k_proj, v_proj
                             + C * C                  // o_proj
                             + C                      // post_attention_layernorm
                             + 3 * F * C;             // gate_proj, up_proj, down_proj
  return V * C + L * layer + C + head;                // embed_tokens, layers, norm
}

bool chunks_in_v(const config& c) { return c.schedule.file.empty() && c.schedule.name == "zb_v"; }

std::vector<int> rank_layers(const config& c, bool v_placement) {
  const int P = c.parallel.pipeline_stage;
  const std::vector<int> chunks = chunk_layers(c);
  std::vector<int> out(static_cast<std::size_t>(P), 0);
  // Chunk i of round k = i / P: on rank i % P, or under the V on P-1 - i % P in odd rounds (the
  // rule of schedules::chunk_rank, which core cannot include).
  for (int i = 0; i < static_cast<int>(chunks.size()); ++i) {
    const int rank = v_placement && (i / P) % 2 == 1 ? P - 1 - i % P : i % P;
    out[static_cast<std::size_t>(rank)] += chunks[static_cast<std::size_t>(i)];
  }
  return out;
}

derived_values derive(const config& c) {
  const parallel_config& p = c.parallel;
  derived_values d;
  d.global_batch = static_cast<std::int64_t>(p.micro_batch_size) * p.micro_batch_num *
                   c.train.gradient_accumulation_steps * p.data_parallel;
  d.tokens_per_step = d.global_batch * c.model.seq_length;
  d.workers = p.data_parallel * p.model_parallel * p.pipeline_stage;
  // Per pipeline rank: where the config's schedule places the chunks, as far as core can tell.
  d.stage_layers = rank_layers(c, chunks_in_v(c));
  for (int n : d.stage_layers) d.layers_per_stage = std::max(d.layers_per_stage, n);
  d.parameters = parameter_count(c.model);
  return d;
}

std::vector<int> chunk_layers(const config& c) {
  const parallel_config& p = c.parallel;
  const int chunks = p.pipeline_stage * p.virtual_pipeline, L = c.model.num_layers;
  if (!p.stage_layers.empty()) return p.stage_layers;
  std::vector<int> out(static_cast<std::size_t>(chunks), 0);
  if (p.first_stage_layers == 0 && p.last_stage_layers == 0) {
    for (int& n : out) n = L / chunks;
    return out;
  }
  // One chunk holds everything: the offsets have nothing to move (validation refuses them).
  if (chunks == 1) return {L};
  // An offset left at 0 takes the even share of what the other leaves, like the middle chunks.
  int first = p.first_stage_layers, last = p.last_stage_layers;
  const int middle = chunks - 2 + (first == 0) + (last == 0);
  const int rest = L - first - last;
  const int each = middle > 0 ? rest / middle : 0;
  if (first == 0) first = each;
  if (last == 0) last = each;
  out.front() = first;
  out.back() = last;
  for (int i = 1; i + 1 < chunks; ++i) out[static_cast<std::size_t>(i)] = each;
  return out;
}

std::vector<bool> recompute_layers(const config& c) {
  const recompute_config& r = c.recompute;
  const auto L = static_cast<std::size_t>(c.model.num_layers);
  if (r.mode == recompute_mode::none) return std::vector<bool>(L, false);
  if (!r.layer_list.empty()) {
    std::vector<bool> out(L, false);
    for (int l : r.layer_list)
      if (l >= 0 && static_cast<std::size_t>(l) < L) out[static_cast<std::size_t>(l)] = true;
    return out;
  }
  if (r.layers == 0) return std::vector<bool>(L, true);
  std::vector<bool> out(L, false);
  std::size_t first = 0;
  for (int n : chunk_layers(c)) {
    for (int i = 0; i < std::min(n, r.layers); ++i) out[first + static_cast<std::size_t>(i)] = true;
    first += static_cast<std::size_t>(n);
  }
  return out;
}

std::vector<bool> keep_gelu_layers(const config& c) {
  const int L = c.model.num_layers;
  std::vector<bool> out(static_cast<std::size_t>(L), false);
  for (int l = std::max(0, L - c.recompute.keep_gelu); l < L; ++l)
    out[static_cast<std::size_t>(l)] = true;
  return out;
}

}  // namespace troupe::core
