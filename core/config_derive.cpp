// Values derived from a config: batch and worker arithmetic, and the exact parameter count of
// both architectures (weights as model/ lays them out, tied embeddings counted once).
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

derived_values derive(const config& c) {
  const parallel_config& p = c.parallel;
  derived_values d;
  d.global_batch = static_cast<std::int64_t>(p.micro_batch_size) * p.micro_batch_num *
                   c.train.gradient_accumulation_steps * p.data_parallel;
  d.tokens_per_step = d.global_batch * c.model.seq_length;
  d.workers = p.data_parallel * p.model_parallel * p.pipeline_stage;
  d.layers_per_stage = c.model.num_layers / p.pipeline_stage;
  d.parameters = parameter_count(c.model);
  return d;
}

}  // namespace troupe::core
