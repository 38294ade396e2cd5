#include "model/params.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "kernels/backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::model {
namespace {

using core::arch_kind;

std::string layer_prefix(const core::model_config& cfg, int layer) {
  return cfg.arch == arch_kind::gpt2 ? "h." + std::to_string(layer) + "."
                                     : "model.layers." + std::to_string(layer) + ".";
}

std::string final_norm_prefix(const core::model_config& cfg) {
  return cfg.arch == arch_kind::gpt2 ? "ln_f." : "model.norm.";
}

std::int64_t padded(std::int64_t numel) {
  return (numel + kernels::norm_block - 1) / kernels::norm_block * kernels::norm_block;
}

// Every parameter of the chunk in definition order; offsets are assigned when the trainable and
// frozen ones are split into their two buffers.
struct def_builder {
  const core::model_config& cfg;
  std::vector<param_def> defs;

  void add(std::string name, core::shape_t shape, init_rule rule, bool tied = false,
           std::string stream = {}) {
    param_def d;
    d.info.name = std::move(name);
    d.info.shape = std::move(shape);
    d.info.numel = core::numel_of(d.info.shape);
    d.info.decay = d.info.shape.size() == 2;
    d.info.tied = tied;
    d.rule = rule;
    d.stream_name = stream.empty() ? d.info.name : std::move(stream);
    defs.push_back(std::move(d));
  }
  /// A linear module's weight [out, in], then its LoRA adapters when the module is a target.
  void linear(const std::string& module, std::int64_t out, std::int64_t in, init_rule rule) {
    add(module + ".weight", {out, in}, rule);
    if (cfg.lora.rank <= 0) return;
    for (const auto& t : cfg.lora.targets)
      if (module_matches(module, t)) {
        add(lora_a_name(module + ".weight"), {cfg.lora.rank, in}, init_rule::lora_a);
        add(lora_b_name(module + ".weight"), {out, cfg.lora.rank}, init_rule::zeros);
        return;
      }
  }
  static bool module_matches(const std::string& module, const std::string& entry) {
    return module == entry ||
           (module.size() > entry.size() &&
            module.compare(module.size() - entry.size(), entry.size(), entry) == 0 &&
            module[module.size() - entry.size() - 1] == '.');
  }
};

bool is_adapter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

// The module of a parameter name: everything before its last component ("h.0.ln_1").
std::string module_of(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

bool listed(const std::vector<std::string>& entries, const std::string& module) {
  for (const auto& e : entries)
    if (def_builder::module_matches(module, e)) return true;
  return false;
}

std::vector<param_def> all_params(const core::model_config& cfg, const chunk_spec& spec);

std::vector<param_def> assign(std::vector<param_def> defs) {
  std::int64_t next = 0;
  for (auto& d : defs) {
    d.info.offset = next;
    next += padded(d.info.numel);
  }
  return defs;
}

}  // namespace

int ffn_hidden(const core::model_config& cfg) { return cfg.ffn_size(); }

kernels::rope_spec rope_of(const core::model_config& cfg) {
  kernels::rope_spec r;
  r.theta = cfg.rope_theta;
  if (cfg.rope_scaling == core::rope_scaling_kind::llama3) {
    r.factor = cfg.rope_scaling_factor;
    r.low_freq_factor = cfg.rope_low_freq_factor;
    r.high_freq_factor = cfg.rope_high_freq_factor;
    r.original_max_positions = cfg.rope_original_max_positions;
  }
  return r;
}

std::string embedding_name(const core::model_config& cfg) {
  return cfg.arch == arch_kind::gpt2 ? "wte.weight" : "model.embed_tokens.weight";
}

std::string lora_a_name(const std::string& weight_name) {
  return module_of(weight_name) + ".lora_A.weight";
}
std::string lora_b_name(const std::string& weight_name) {
  return module_of(weight_name) + ".lora_B.weight";
}

float lora_scale(const core::model_config& cfg) {
  return cfg.lora.rank > 0 ? static_cast<float>(cfg.lora.alpha / cfg.lora.rank) : 0.0f;
}

bool base_trainable(const core::model_config& cfg, const std::string& name) {
  const core::lora_config& l = cfg.lora;
  if (!l.partial()) return true;
  std::vector<std::string> modules{module_of(name)};
  // A tied embedding and its head copy are one weight.
  const std::string emb = embedding_name(cfg);
  if (cfg.tie_embeddings && (name == emb || name == "lm_head.weight"))
    modules = {module_of(emb), "lm_head"};
  bool hit = false;
  for (const auto& m : modules) hit = hit || listed(l.freeze.empty() ? l.trainable : l.freeze, m);
  return l.freeze.empty() ? hit : !hit;
}

bool tied_gradients(const core::model_config& cfg) {
  return cfg.tie_embeddings && base_trainable(cfg, embedding_name(cfg));
}

bool shares_head(const core::model_config& cfg, const chunk_spec& spec, int tp) {
  return spec.has_embedding && spec.has_head && tp <= 1 && tied_gradients(cfg);
}

std::vector<param_def> define_params(const core::model_config& cfg, const chunk_spec& spec,
                                     int tp) {
  const bool shared_head = shares_head(cfg, spec, tp);
  std::vector<param_def> out;
  for (auto& d : all_params(cfg, spec))
    if ((is_adapter(d.info.name) || base_trainable(cfg, d.info.name)) &&
        !(shared_head && d.info.tied))
      out.push_back(std::move(d));
  return assign(std::move(out));
}

std::vector<param_def> define_frozen_params(const core::model_config& cfg, const chunk_spec& spec) {
  std::vector<param_def> out;
  for (auto& d : all_params(cfg, spec))
    if (!is_adapter(d.info.name) && !base_trainable(cfg, d.info.name)) out.push_back(std::move(d));
  return assign(std::move(out));
}

namespace {

std::vector<param_def> all_params(const core::model_config& cfg, const chunk_spec& spec) {
  const std::int64_t c = cfg.hidden_size, v = cfg.vocab_size, f = ffn_hidden(cfg);
  const std::int64_t d = cfg.head_dim(), q = cfg.num_heads * d, kv = cfg.kv_heads() * d;
  const bool gpt2 = cfg.arch == arch_kind::gpt2;
  def_builder b{cfg, {}};
  if (spec.has_embedding) {
    b.add(embedding_name(cfg), {v, c}, init_rule::normal);
    if (gpt2) b.add("wpe.weight", {cfg.seq_length, c}, init_rule::normal);
  }
  for (int l = spec.first_layer; l < spec.first_layer + spec.num_layers; ++l) {
    const std::string p = layer_prefix(cfg, l);
    if (gpt2) {
      b.add(p + "ln_1.weight", {c}, init_rule::ones);
      b.add(p + "ln_1.bias", {c}, init_rule::zeros);
      b.linear(p + "attn.c_attn", q + 2 * kv, c, init_rule::normal);
      b.add(p + "attn.c_attn.bias", {q + 2 * kv}, init_rule::zeros);
      b.linear(p + "attn.c_proj", c, q, init_rule::residual);
      b.add(p + "attn.c_proj.bias", {c}, init_rule::zeros);
      b.add(p + "ln_2.weight", {c}, init_rule::ones);
      b.add(p + "ln_2.bias", {c}, init_rule::zeros);
      b.linear(p + "mlp.c_fc", f, c, init_rule::normal);
      b.add(p + "mlp.c_fc.bias", {f}, init_rule::zeros);
      b.linear(p + "mlp.c_proj", c, f, init_rule::residual);
      b.add(p + "mlp.c_proj.bias", {c}, init_rule::zeros);
    } else {
      b.add(p + "input_layernorm.weight", {c}, init_rule::ones);
      b.linear(p + "self_attn.q_proj", q, c, init_rule::normal);
      b.linear(p + "self_attn.k_proj", kv, c, init_rule::normal);
      b.linear(p + "self_attn.v_proj", kv, c, init_rule::normal);
      b.linear(p + "self_attn.o_proj", c, q, init_rule::residual);
      b.add(p + "post_attention_layernorm.weight", {c}, init_rule::ones);
      b.linear(p + "mlp.gate_proj", f, c, init_rule::normal);
      b.linear(p + "mlp.up_proj", f, c, init_rule::normal);
      b.linear(p + "mlp.down_proj", c, f, init_rule::residual);
    }
  }
  if (spec.has_head) {
    const std::string n = final_norm_prefix(cfg);
    b.add(n + "weight", {c}, init_rule::ones);
    if (gpt2) b.add(n + "bias", {c}, init_rule::zeros);
    // A tied head starts as a copy of the embedding: same stream, same values.
    if (cfg.tie_embeddings)
      b.add("lm_head.weight", {v, c}, init_rule::normal, true, embedding_name(cfg));
    else
      b.add("lm_head.weight", {v, c}, init_rule::normal);
  }
  return std::move(b.defs);
}

}  // namespace

std::int64_t flat_numel(const std::vector<param_def>& defs) {
  if (defs.empty()) return 0;
  const auto& last = defs.back().info;
  return last.offset +
         (last.numel + kernels::norm_block - 1) / kernels::norm_block * kernels::norm_block;
}

void init_param(const param_def& def, const core::model_config& cfg, std::uint64_t seed,
                float* out) {
  const std::int64_t n = def.info.numel;
  if (def.rule == init_rule::ones || def.rule == init_rule::zeros) {
    const float value = def.rule == init_rule::ones ? 1.0f : 0.0f;
    for (std::int64_t i = 0; i < n; ++i) out[i] = value;
    return;
  }
  const std::uint64_t key = core::stream_key(seed, core::hash_name(def.stream_name));
  if (def.rule == init_rule::lora_a) {
    const float bound = static_cast<float>(1.0 / std::sqrt(static_cast<double>(def.info.shape[1])));
    core::rng_stream rng(key);
    for (std::int64_t i = 0; i < n; ++i) out[i] = (2.0f * rng.uniform() - 1.0f) * bound;
    return;
  }
  float std = cfg.init_std;
  if (def.rule == init_rule::residual)
    std = static_cast<float>(cfg.init_std / std::sqrt(2.0 * cfg.num_layers));
  // Element i draws counters 2i and 2i + 1 of the parameter's stream, so ranges of elements can be
  // filled on several threads with the values one thread would give (a 1.5B-parameter model took
  // about a minute on one core).
  kernels::cpu::parallel_for(n, std::int64_t{1} << 18, [&](std::int64_t begin, std::int64_t end) {
    core::rng_stream rng(key, static_cast<std::uint64_t>(2 * begin));
    for (std::int64_t i = begin; i < end; ++i) out[i] = rng.normal() * std;
  });
}

namespace {

lora_pair adapter(const core::model_config& cfg, const std::string& module,
                  const std::function<tensor(const std::string&)>& view) {
  if (cfg.lora.rank <= 0) return {};
  for (const auto& t : cfg.lora.targets)
    if (def_builder::module_matches(module, t))
      return {view(lora_a_name(module + ".weight")), view(lora_b_name(module + ".weight"))};
  return {};
}

}  // namespace

layer_tensors layer_views(const core::model_config& cfg, int layer,
                          const std::function<tensor(const std::string&)>& view) {
  const std::string p = layer_prefix(cfg, layer);
  layer_tensors t;
  const auto lora = [&](const std::string& module) { return adapter(cfg, p + module, view); };
  if (cfg.arch == arch_kind::gpt2) {
    t.norm1_w = view(p + "ln_1.weight");
    t.norm1_b = view(p + "ln_1.bias");
    t.qkv_w = view(p + "attn.c_attn.weight");
    t.qkv_b = view(p + "attn.c_attn.bias");
    t.proj_w = view(p + "attn.c_proj.weight");
    t.proj_b = view(p + "attn.c_proj.bias");
    t.norm2_w = view(p + "ln_2.weight");
    t.norm2_b = view(p + "ln_2.bias");
    t.fc_w = view(p + "mlp.c_fc.weight");
    t.fc_b = view(p + "mlp.c_fc.bias");
    t.out_w = view(p + "mlp.c_proj.weight");
    t.out_b = view(p + "mlp.c_proj.bias");
    t.qkv_l = lora("attn.c_attn");
    t.proj_l = lora("attn.c_proj");
    t.fc_l = lora("mlp.c_fc");
    t.out_l = lora("mlp.c_proj");
  } else {
    t.norm1_w = view(p + "input_layernorm.weight");
    t.q_w = view(p + "self_attn.q_proj.weight");
    t.k_w = view(p + "self_attn.k_proj.weight");
    t.v_w = view(p + "self_attn.v_proj.weight");
    t.proj_w = view(p + "self_attn.o_proj.weight");
    t.norm2_w = view(p + "post_attention_layernorm.weight");
    t.fc_w = view(p + "mlp.gate_proj.weight");
    t.up_w = view(p + "mlp.up_proj.weight");
    t.out_w = view(p + "mlp.down_proj.weight");
    t.q_l = lora("self_attn.q_proj");
    t.k_l = lora("self_attn.k_proj");
    t.v_l = lora("self_attn.v_proj");
    t.proj_l = lora("self_attn.o_proj");
    t.fc_l = lora("mlp.gate_proj");
    t.up_l = lora("mlp.up_proj");
    t.out_l = lora("mlp.down_proj");
  }
  return t;
}

head_tensors head_views(const core::model_config& cfg,
                        const std::function<tensor(const std::string&)>& view) {
  const std::string n = final_norm_prefix(cfg);
  head_tensors t;
  t.norm_w = view(n + "weight");
  if (cfg.arch == arch_kind::gpt2) t.norm_b = view(n + "bias");
  t.head_w = view("lm_head.weight");
  return t;
}

embedding_tensors embedding_views(const core::model_config& cfg,
                                  const std::function<tensor(const std::string&)>& view) {
  embedding_tensors t;
  t.wte = view(embedding_name(cfg));
  if (cfg.arch == arch_kind::gpt2) t.wpe = view("wpe.weight");
  return t;
}

}  // namespace troupe::model
