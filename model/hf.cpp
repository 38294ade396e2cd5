#include "model/hf.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/files.hpp"
#include "kernels/select.hpp"
#include "model/checkpoint.hpp"
#include "model/params.hpp"
#include "model/tensor_parallel.hpp"
#include "model/safetensors.hpp"
#include "model/text_tokenizer.hpp"

namespace troupe::model::hf {
namespace {

namespace fs = std::filesystem;
using core::arch_kind;
using core::error;
using json = nlohmann::json;

const char* const supported_types = "supported: \"gpt2\" (GPT2LMHeadModel) and \"llama\" (LlamaForCausalLM)";
const char* const supported_dtypes = "supported tensor dtypes: F32, BF16, F16";

core::input_spec json_spec(const std::string& what) {
  core::input_spec s;
  s.what = what;
  s.max_bytes = std::uint64_t(1) << 30;
  s.hint = "a Hugging Face model directory as save_pretrained writes it";
  return s;
}

error key_error(const std::string& file, const std::string& key, std::string message,
                std::string hint = {}) {
  return error::at_key(file, key, 0, 0, std::move(message), std::move(hint));
}

core::result<json> read_json(const std::string& path, const std::string& what) {
  auto text = core::read_input(path, json_spec(what));
  if (!text) return text.err();
  try {
    return json::parse(text.value());
  } catch (const json::exception& e) {
    return error::at_file(path, std::string("invalid JSON: ") + e.what(),
                          "the file is damaged or not a " + what);
  }
}

// A typed field of config.json with the transformers class default when absent (null counts as
// absent). Throws the error out of read_config.
struct fields {
  const json& j;
  std::string file;

  const json* find(const std::string& key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  std::int64_t integer(const std::string& key, std::optional<std::int64_t> fallback,
                       std::int64_t lo = 1, std::int64_t hi = 1 << 24) const {
    const json* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      throw key_error(file, key, "missing", "config.json must give " + key);
    }
    if (!v->is_number_integer())
      throw key_error(file, key, "is " + v->dump() + ", expected a whole number");
    const std::int64_t x = v->get<std::int64_t>();
    if (x < lo || x > hi)
      throw key_error(file, key,
                      "is " + std::to_string(x) + ", outside " + std::to_string(lo) + ".." +
                          std::to_string(hi) + " (what troupe runs)");
    return x;
  }
  double number(const std::string& key, double fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) throw key_error(file, key, "is " + v->dump() + ", expected a number");
    const double x = v->get<double>();
    if (!std::isfinite(x) || x <= 0)
      throw key_error(file, key, "is " + v->dump() + ", expected a positive number");
    return x;
  }
  bool boolean(const std::string& key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) throw key_error(file, key, "is " + v->dump() + ", expected true or false");
    return v->get<bool>();
  }
  std::string text(const std::string& key, const std::string& fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) throw key_error(file, key, "is " + v->dump() + ", expected a string");
    return v->get<std::string>();
  }
  // A key whose value must be `want` for troupe's maths to be the model's.
  template <class T>
  void require(const std::string& key, const T& value, const T& want, const std::string& why) const {
    if (!(value == want))
      throw key_error(file, key, "is " + json(value).dump() + ", troupe supports only " + json(want).dump(),
                      why);
  }
};

void read_gpt2(const fields& f, core::model_config& m) {
  m.arch = arch_kind::gpt2;
  m.num_layers = static_cast<int>(f.integer("n_layer", 12));
  m.hidden_size = static_cast<int>(f.integer("n_embd", 768));
  m.num_heads = static_cast<int>(f.integer("n_head", 12));
  m.num_kv_heads = m.num_heads;
  const std::int64_t n_ctx = f.integer("n_ctx", 1024);
  m.seq_length = static_cast<int>(f.integer("n_positions", f.find("n_ctx") ? n_ctx : 1024));
  m.vocab_size = static_cast<int>(f.integer("vocab_size", 50257));
  m.ffn_hidden_size = static_cast<int>(f.integer("n_inner", 4LL * m.hidden_size));
  m.norm_eps = f.number("layer_norm_epsilon", 1e-5);
  m.init_std = static_cast<float>(f.number("initializer_range", 0.02));
  m.tie_embeddings = f.boolean("tie_word_embeddings", true);
  const std::string act = f.text("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    throw key_error(f.file, "activation_function", "is \"" + act + "\"",
                    "troupe's GPT-2 uses the tanh GELU: supported \"gelu_new\", "
                    "\"gelu_pytorch_tanh\"");
  f.require("scale_attn_weights", f.boolean("scale_attn_weights", true), true,
            "troupe scales attention scores by 1/sqrt(head_dim)");
  f.require("scale_attn_by_inverse_layer_idx", f.boolean("scale_attn_by_inverse_layer_idx", false),
            false, "troupe does not scale attention by the layer index");
  f.require("add_cross_attention", f.boolean("add_cross_attention", false), false,
            "troupe's GPT-2 is decoder-only");
}

void read_rope_scaling(const fields& f, const json& r, const std::string& key,
                       core::model_config& m) {
  if (!r.is_object()) throw key_error(f.file, key, "is " + r.dump() + ", expected an object or null");
  std::string type;
  for (const char* k : {"rope_type", "type"})
    if (auto it = r.find(k); it != r.end() && it->is_string()) type = it->get<std::string>();
  if (type.empty() || type == "default") return;
  if (type != "llama3")
    throw key_error(f.file, key + ".rope_type", "\"" + type + "\" is not supported",
                    "supported rope scaling: \"llama3\" (or none: null / \"default\")");
  const fields sub{r, f.file};
  const auto need = [&](const char* k) {
    if (!sub.find(k))
      throw key_error(f.file, key + "." + k, "missing",
                      "llama3 rope scaling needs factor, low_freq_factor, high_freq_factor and "
                      "original_max_position_embeddings");
  };
  for (const char* k : {"factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"})
    need(k);
  m.rope_scaling = core::rope_scaling_kind::llama3;
  try {
    m.rope_scaling_factor = sub.number("factor", 8.0);
    m.rope_low_freq_factor = sub.number("low_freq_factor", 1.0);
    m.rope_high_freq_factor = sub.number("high_freq_factor", 4.0);
    m.rope_original_max_positions =
        static_cast<int>(sub.integer("original_max_position_embeddings", 8192));
  } catch (error& e) {
    e.where.key = key + "." + e.where.key;
    throw;
  }
  if (!(m.rope_high_freq_factor > m.rope_low_freq_factor) || m.rope_scaling_factor < 1)
    throw key_error(f.file, key,
                    "needs factor >= 1 and high_freq_factor > low_freq_factor, got " + r.dump());
}

void read_llama(const fields& f, core::model_config& m) {
  m.arch = arch_kind::llama;
  m.hidden_size = static_cast<int>(f.integer("hidden_size", 4096));
  m.ffn_hidden_size = static_cast<int>(f.integer("intermediate_size", 11008));
  m.num_layers = static_cast<int>(f.integer("num_hidden_layers", 32));
  m.num_heads = static_cast<int>(f.integer("num_attention_heads", 32));
  m.num_kv_heads = static_cast<int>(f.integer("num_key_value_heads", m.num_heads));
  m.seq_length = static_cast<int>(f.integer("max_position_embeddings", 2048));
  m.vocab_size = static_cast<int>(f.integer("vocab_size", 32000));
  m.norm_eps = f.number("rms_norm_eps", 1e-6);
  m.init_std = static_cast<float>(f.number("initializer_range", 0.02));
  m.tie_embeddings = f.boolean("tie_word_embeddings", false);
  if (m.hidden_size % m.num_heads != 0)
    throw key_error(f.file, "num_attention_heads",
                    std::to_string(m.num_heads) + " does not divide hidden_size " +
                        std::to_string(m.hidden_size),
                    "troupe's head_dim is hidden_size / num_attention_heads");
  if (m.num_heads % m.num_kv_heads != 0)
    throw key_error(f.file, "num_key_value_heads",
                    std::to_string(m.num_kv_heads) + " does not divide num_attention_heads " +
                        std::to_string(m.num_heads));
  if (const json* hd = f.find("head_dim"))
    if (!hd->is_number_integer() || hd->get<std::int64_t>() != m.hidden_size / m.num_heads)
      throw key_error(f.file, "head_dim",
                      "is " + hd->dump() + ", troupe supports only hidden_size / num_attention_heads = " +
                          std::to_string(m.hidden_size / m.num_heads));
  const std::string act = f.text("hidden_act", "silu");
  if (act != "silu")
    throw key_error(f.file, "hidden_act", "is \"" + act + "\"", "troupe's LLaMA MLP is SwiGLU: supported \"silu\"");
  f.require("attention_bias", f.boolean("attention_bias", false), false,
            "troupe's LLaMA projections have no biases");
  f.require("mlp_bias", f.boolean("mlp_bias", false), false,
            "troupe's LLaMA projections have no biases");
  // transformers 5 writes rope_parameters {"rope_type", "rope_theta", ...}; 4.x writes rope_theta
  // beside rope_scaling.
  m.rope_theta = f.number("rope_theta", 10000.0);
  if (const json* p = f.find("rope_parameters")) {
    if (!p->is_object())
      throw key_error(f.file, "rope_parameters", "is " + p->dump() + ", expected an object");
    const fields sub{*p, f.file};
    try {
      m.rope_theta = sub.number("rope_theta", m.rope_theta);
    } catch (error& e) {
      e.where.key = "rope_parameters." + e.where.key;
      throw;
    }
    read_rope_scaling(f, *p, "rope_parameters", m);
  } else if (const json* r = f.find("rope_scaling")) {
    read_rope_scaling(f, *r, "rope_scaling", m);
  }
}

std::string config_path(const std::string& dir) { return (fs::path(dir) / "config.json").string(); }

bool is_conv1d(const std::string& name) {
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
                        ".mlp.c_proj.weight"}) {
    const std::size_t n = std::strlen(s);
    if (name.size() >= n && name.compare(name.size() - n, n, s) == 0) return true;
  }
  return false;
}

// fp32 copy of a stored tensor of dtype F32, BF16 or F16 (`code`).
core::tensor to_f32(const std::byte* data, const std::string& code, const core::shape_t& shape) {
  core::tensor t = core::tensor::zeros(shape);
  float* out = t.data<float>();
  const std::int64_t n = t.numel();
  if (code == "F32") {
    std::memcpy(out, data, static_cast<std::size_t>(n) * 4);
  } else {
    const bool bf = code == "BF16";
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      out[i] = bf ? core::bf16_to_f32(h) : core::f16_to_f32(h);
    }
  }
  return t;
}

core::tensor transpose(const core::tensor& t) {
  const std::int64_t r = t.dim(0), c = t.dim(1);
  core::tensor o = core::tensor::zeros({c, r});
  const float* a = t.data<float>();
  float* b = o.data<float>();
  for (std::int64_t i = 0; i < r; ++i)
    for (std::int64_t j = 0; j < c; ++j) b[j * r + i] = a[i * c + j];
  return o;
}

std::string arch_name(arch_kind a) { return a == arch_kind::gpt2 ? "gpt2" : "llama"; }

// Cuts GPT-2's position table to the rows the run uses; other shapes must match exactly.
core::result<core::tensor> fit(core::tensor t, const std::string& name, const core::shape_t& shape,
                               const std::string& file, const std::string& stored_name,
                               const std::string& layout_note) {
  if (name == "wpe.weight" && t.rank() == 2 && shape.size() == 2 && t.dim(1) == shape[1] &&
      t.dim(0) >= shape[0]) {
    if (t.dim(0) == shape[0]) return t;
    return t.rows(0, shape[0]).clone();
  }
  if (t.shape() == shape) return t;
  return key_error(file, "tensor '" + stored_name + "'",
                   "has shape " + core::shape_string(t.shape()) + layout_note + ", the model needs " +
                       core::shape_string(shape),
                   "the weights belong to a different model than the [model] table describes");
}

}  // namespace

bool is_model_dir(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / "config.json", ec);
}

core::result<core::model_config> read_config(const std::string& dir) {
  const std::string path = config_path(dir);
  auto j = read_json(path, "model config (config.json)");
  if (!j) return j.err();
  if (!j->is_object()) return error::at_file(path, "is not a JSON object", "a Hugging Face config.json");
  const fields f{j.value(), path};
  core::model_config m;
  try {
    const std::string type = f.text("model_type", "");
    if (type.empty())
      return key_error(path, "model_type", "missing", std::string(supported_types));
    if (type == "gpt2")
      read_gpt2(f, m);
    else if (type == "llama")
      read_llama(f, m);
    else
      return key_error(path, "model_type", "\"" + type + "\" is not supported", supported_types);
  } catch (const error& e) {
    return e;
  }
  return m;
}

core::status check_same_model(const core::model_config& s, const std::string& source_file,
                              const core::model_config& c, const std::string& cfg_file) {
  const bool hf_source = fs::path(source_file).filename() == "config.json";
  const bool gpt2 = s.arch == arch_kind::gpt2;
  struct diff {
    const char* hf_key;
    const char* troupe_key;
    std::string source, run;
  };
  std::vector<diff> diffs;
  auto add = [&](const char* hf, const char* tk, auto a, auto b) {
    if (!(a == b)) diffs.push_back({hf, tk, json(a).dump(), json(b).dump()});
  };
  add("model_type", "arch", arch_name(s.arch), arch_name(c.arch));
  if (diffs.empty()) {
    add(gpt2 ? "n_layer" : "num_hidden_layers", "num_layers", s.num_layers, c.num_layers);
    add(gpt2 ? "n_embd" : "hidden_size", "hidden_size", s.hidden_size, c.hidden_size);
    add(gpt2 ? "n_head" : "num_attention_heads", "num_heads", s.num_heads, c.num_heads);
    add("num_key_value_heads", "num_kv_heads", s.kv_heads(), c.kv_heads());
    add(gpt2 ? "n_inner" : "intermediate_size", "ffn_hidden_size", s.ffn_size(), c.ffn_size());
    add("vocab_size", "vocab_size", s.vocab_size, c.vocab_size);
    add("tie_word_embeddings", "tie_embeddings", s.tie_embeddings, c.tie_embeddings);
    add(gpt2 ? "layer_norm_epsilon" : "rms_norm_eps", "norm_eps", s.norm_eps, c.norm_eps);
    if (!gpt2) {
      add("rope_theta", "rope_theta", s.rope_theta, c.rope_theta);
      const bool s3 = s.rope_scaling == core::rope_scaling_kind::llama3;
      add("rope_scaling.rope_type", "rope_scaling", std::string(s3 ? "llama3" : "none"),
          std::string(c.rope_scaling == core::rope_scaling_kind::llama3 ? "llama3" : "none"));
      if (s3 && c.rope_scaling == s.rope_scaling) {
        add("rope_scaling.factor", "rope_scaling_factor", s.rope_scaling_factor, c.rope_scaling_factor);
        add("rope_scaling.low_freq_factor", "rope_low_freq_factor", s.rope_low_freq_factor,
            c.rope_low_freq_factor);
        add("rope_scaling.high_freq_factor", "rope_high_freq_factor", s.rope_high_freq_factor,
            c.rope_high_freq_factor);
        add("rope_scaling.original_max_position_embeddings", "rope_original_max_position_embeddings",
            s.rope_original_max_positions, c.rope_original_max_positions);
      }
    }
  }
  if (c.seq_length > s.seq_length)
    diffs.push_back({gpt2 ? "n_positions" : "max_position_embeddings", "seq_length",
                     std::to_string(s.seq_length), std::to_string(c.seq_length) + " (above it)"});
  if (diffs.empty()) return {};
  const diff& d = diffs.front();
  std::string msg = "is " + d.source + ", but the run's [model] has " + d.troupe_key + " = " + d.run;
  if (diffs.size() > 1) msg += " (and " + std::to_string(diffs.size() - 1) + " more differences)";
  error e = key_error(source_file, hf_source ? d.hf_key : std::string("model.") + d.troupe_key,
                      msg,
                      std::string("the [model] table") + (cfg_file.empty() ? "" : " of " + cfg_file) +
                          " must describe the weights model.init names (seq_length may be "
                          "shorter); `troupe import DIR --out CONFIG.toml` writes a matching one");
  return e;
}

// ------------------------------------------------------------------------------------------------
// weights

struct weights::impl {
  std::string path;
  core::model_config source;
  core::model_config cfg;
  // A Hugging Face directory: its files and where each tensor lives.
  std::vector<std::unique_ptr<safetensors::file>> files;
  std::map<std::string, std::pair<std::size_t, const safetensors::entry*>> where;
  std::string listing;  // model.safetensors or the index, for "missing" messages
  bool prefix = false;  // GPT-2 names carry "transformer."
  // A troupe checkpoint.
  std::optional<checkpoint::reader> ck;

  std::string stored_name(const std::string& name) const {
    if (ck || cfg.arch != arch_kind::gpt2 || name == "lm_head.weight" || !prefix) return name;
    return "transformer." + name;
  }

  core::result<core::tensor> raw(const std::string& name) const {
    if (ck) return ck->load(name);
    auto it = where.find(name);
    if (it == where.end())
      return key_error(listing, "tensor '" + name + "'", "missing",
                       "the directory holds a different or incomplete " + arch_name(cfg.arch) +
                           " model; names follow GPT2LMHeadModel / LlamaForCausalLM");
    const auto& f = *files[it->second.first];
    const safetensors::entry& e = *it->second.second;
    if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16")
      return key_error(f.path(), "tensor '" + name + "'", "has dtype " + e.dtype + ", which troupe cannot read",
                       std::string(supported_dtypes) + " (converted to fp32 masters)");
    return to_f32(f.bytes(e).first, e.dtype, e.shape);
  }

  std::string file_of(const std::string& stored) const {
    if (ck) return (fs::path(ck->dir()) / "manifest.json").string();
    auto it = where.find(stored);
    return it == where.end() ? listing : files[it->second.first]->path();
  }
};

weights::weights(std::unique_ptr<impl> p) : p_(std::move(p)) {}
weights::~weights() = default;

const core::model_config& weights::source_config() const { return p_->source; }
const std::string& weights::path() const { return p_->path; }

core::result<std::shared_ptr<const weights>> weights::open(const std::string& path,
                                                           const core::model_config& cfg,
                                                           const std::string& cfg_file) {
  auto p = std::make_unique<impl>();
  p->cfg = cfg;
  if (is_model_dir(path)) {
    p->path = path;
    auto src = read_config(path);
    if (!src) return src.err();
    p->source = src.value();
    if (auto st = check_same_model(p->source, config_path(path), cfg, cfg_file); !st) return st.err();
    const fs::path single = fs::path(path) / "model.safetensors";
    const fs::path index = fs::path(path) / "model.safetensors.index.json";
    std::error_code ec;
    std::vector<std::string> file_names;
    std::map<std::string, std::string> weight_map;
    if (fs::exists(index, ec)) {
      p->listing = index.string();
      auto j = read_json(index.string(), "safetensors index");
      if (!j) return j.err();
      auto wm = j->find("weight_map");
      if (!j->is_object() || wm == j->end() || !wm->is_object())
        return key_error(index.string(), "weight_map", "missing or not an object",
                         "an index maps each tensor name to its shard file");
      for (auto& [name, file] : wm->items()) {
        if (!file.is_string())
          return key_error(index.string(), "weight_map." + name, "is " + file.dump() + ", expected a file name");
        const std::string fn = file.get<std::string>();
        if (fn.find('/') != std::string::npos || fn == "." || fn == "..")
          return key_error(index.string(), "weight_map." + name,
                           "names '" + fn + "', not a file in the directory",
                           "shards live beside the index");
        weight_map[name] = fn;
        if (std::find(file_names.begin(), file_names.end(), fn) == file_names.end())
          file_names.push_back(fn);
      }
    } else if (fs::exists(single, ec)) {
      p->listing = single.string();
      file_names.push_back("model.safetensors");
    } else {
      return error::at_file(path, "has config.json but neither model.safetensors nor "
                                  "model.safetensors.index.json",
                            "troupe reads safetensors weights (save_pretrained's default); "
                            "pytorch_model.bin is not supported");
    }
    for (const std::string& fn : file_names) {
      auto f = safetensors::file::open((fs::path(path) / fn).string());
      if (!f) return f.err();
      p->files.push_back(std::make_unique<safetensors::file>(std::move(f.value())));
      const std::size_t k = p->files.size() - 1;
      for (const auto& e : p->files[k]->entries()) {
        auto wm = weight_map.find(e.name);
        if (!weight_map.empty() && (wm == weight_map.end() || wm->second != fn)) continue;
        p->where[e.name] = {k, p->files[k]->find(e.name)};
      }
    }
    for (const auto& [name, fn] : weight_map)
      if (!p->where.count(name))
        return key_error((fs::path(path) / fn).string(), "tensor '" + name + "'",
                         "listed in model.safetensors.index.json but not in the shard",
                         "the shards and the index do not belong together");
    p->prefix = p->where.count("transformer.wte.weight") > 0;
  } else {
    auto dir = checkpoint::resolve(path);
    if (!dir)
      return key_error(path, "model.init",
                       "is neither a Hugging Face model directory (no config.json) nor a troupe "
                       "checkpoint: " + dir.err().message,
                       "name a directory with config.json + model.safetensors, or a troupe run / "
                       "checkpoint directory");
    auto ck = checkpoint::reader::open(dir.value());
    if (!ck) return ck.err();
    const std::string manifest = (fs::path(dir.value()) / "manifest.json").string();
    auto saved = core::parse_config(ck->info().config_toml, manifest);
    if (!saved) return saved.err();
    p->path = dir.value();
    p->source = saved->model;
    if (auto st = check_same_model(p->source, manifest, cfg, cfg_file); !st) return st.err();
    p->ck.emplace(std::move(ck.value()));
  }
  return std::shared_ptr<const weights>(new weights(std::move(p)));
}

core::result<core::tensor> weights::load(const std::string& name, const core::shape_t& shape) const {
  const std::string stored = p_->stored_name(name);
  const bool conv = !p_->ck && p_->cfg.arch == arch_kind::gpt2 && is_conv1d(name);
  auto t = p_->raw(stored);
  if (!t) return t.err();
  if (!conv) return fit(t.value(), name, shape, p_->file_of(stored), stored, "");
  if (t->rank() != 2)
    return key_error(p_->file_of(stored), "tensor '" + stored + "'",
                     "has shape " + core::shape_string(t->shape()) + ", a Conv1D weight is 2-D");
  return fit(transpose(t.value()), name, shape, p_->file_of(stored), stored,
             " after the Conv1D transpose (stored [in, out] " + core::shape_string(t->shape()) + ")");
}

namespace {
bool is_adapter(const std::string& name) {
  auto ends = [&](const char* tail) {
    const std::string t = tail;
    return name.size() >= t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
  };
  return ends(".lora_A.weight") || ends(".lora_B.weight");
}
}  // namespace

core::status load_frozen_base(const core::config& cfg, kernels::backend& be, chunk& c) {
  if (cfg.model.init.empty() || c.frozen_params().empty()) return {};
  auto w = weights::open(cfg.model.init, cfg.model, cfg.source);
  if (!w) return w.err();
  return load_chunk(*w.value(), be, cfg.model, c);
}

core::status load_chunk(const weights& w, kernels::backend& be, const core::model_config& cfg,
                        chunk& c) {
  for (const auto* list : {&c.params(), &c.frozen_params()}) {
    for (const param_info& p : *list) {
      if (is_adapter(p.name)) continue;
      // A tied head starts as the embedding (open() checked the source is tied too). A
      // tensor-parallel chunk reads the whole tensor and keeps its slice.
      const chunk_tp& tp = c.tp();
      auto t = w.load(p.tied ? embedding_name(cfg) : p.name,
                      tp.size > 1 ? c.whole_shape(p.name) : p.shape);
      if (!t) return t.err();
      if (tp.size > 1) t = shard_tensor(cfg, p.name, t.value(), tp.size, tp.rank);
      tensor dst = c.param(p.name);
      be.copy(t.value(), dst);
    }
  }
  c.params_updated();
  return {};
}

// ------------------------------------------------------------------------------------------------
// export

core::result<std::uint64_t> parse_size(const std::string& text) {
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  const std::string digits = text.substr(0, i), unit = text.substr(i);
  static const std::pair<const char*, std::uint64_t> units[] = {
      {"", 1},          {"B", 1},           {"KB", 1000},          {"MB", 1000'000},
      {"GB", 1000'000'000}, {"KiB", 1ULL << 10}, {"MiB", 1ULL << 20}, {"GiB", 1ULL << 30}};
  for (const auto& [u, mult] : units)
    if (unit == u && !digits.empty() && digits.size() <= 12) {
      const std::uint64_t v = std::stoull(digits) * mult;
      if (v > 0) return v;
    }
  return error::make("size '" + text + "' is not a positive whole number with an optional unit",
                     "e.g. 5GB (the default), 500MB, 2GiB or 1000000 (bytes)");
}

core::result<export_options> tokenizer_export(const core::config& run, const core::model_config& m) {
  export_options o;
  const std::string& spec = run.data.tokenizer_spec();
  if (spec.empty()) return o;
  auto tok = load_tokenizer(spec);
  if (!tok) return tok.err();
  if ((*tok)->vocab_size() > m.vocab_size)
    return key_error(spec, "data.tokenizer",
                     "the tokenizer has " + std::to_string((*tok)->vocab_size()) +
                         " tokens, the model's vocab_size is " + std::to_string(m.vocab_size),
                     "pass --tokenizer with the tokenizer the model was trained with");
  std::error_code ec;
  const fs::path p(spec);
  const fs::path json_file = fs::is_regular_file(p, ec) ? p : p / "tokenizer.json";
  if (fs::is_regular_file(json_file, ec)) o.tokenizer.push_back({json_file.string(), "tokenizer.json"});
  // GPT-2's encoder.json and vocab.bpe are, byte for byte, the vocab.json and merges.txt
  // transformers' GPT2Tokenizer reads.
  const fs::path folder = fs::is_directory(p, ec) ? p : p.parent_path();
  if (fs::is_regular_file(folder / "encoder.json", ec) && fs::is_regular_file(folder / "vocab.bpe", ec)) {
    o.tokenizer.push_back({(folder / "encoder.json").string(), "vocab.json"});
    o.tokenizer.push_back({(folder / "vocab.bpe").string(), "merges.txt"});
    o.tokenizer_class = "GPT2Tokenizer";
  } else {
    o.tokenizer_class = "PreTrainedTokenizerFast";
  }
  if (auto b = (*tok)->bos_id()) o.tokens.bos = *b;
  if (auto e = (*tok)->eos_id()) o.tokens.eos = *e;
  if (auto pd = (*tok)->pad_id()) o.tokens.pad = *pd;
  if (o.tokenizer_class == "GPT2Tokenizer" && o.tokens.eos < 0)
    if (auto eot = (*tok)->token_id("<|endoftext|>")) o.tokens.bos = o.tokens.eos = *eot;
  return o;
}

core::result<std::pair<core::config, param_map>> read_checkpoint(const std::string& path) {
  auto dir = checkpoint::resolve(path);
  if (!dir) return dir.err();
  auto ck = checkpoint::reader::open(dir.value());
  if (!ck) return ck.err();
  auto cfg = core::parse_config(ck->info().config_toml,
                                (fs::path(dir.value()) / "manifest.json").string());
  if (!cfg) return cfg.err();
  param_map params;
  if (cfg->model.lora.partial()) {
    // The checkpoint holds the trainable weights (adapters included); the frozen base is the
    // run's starting point, remade as the run made it.
    auto be = kernels::make_backend("cpu");
    chunk c(cfg->model, partition(cfg->model, 1)[0], *be);
    c.init(cfg->train.seed);
    if (auto st = load_frozen_base(cfg.value(), *be, c); !st) return st.err();
    if (auto st = checkpoint::restore(ck.value(), *be, cfg->model, c, nullptr); !st)
      return st.err();
    for (const auto* list : {&c.params(), &c.frozen_params()})
      for (const param_info& p : *list)
        if (!p.tied) params[p.name] = c.param(p.name).clone();
    return std::pair<core::config, param_map>{std::move(cfg.value()), std::move(params)};
  }
  for (const param_def& d : define_params(cfg->model, chunk_spec{0, cfg->model.num_layers, true, true})) {
    if (d.info.tied) continue;
    auto t = ck->load(d.info.name);
    if (!t) return t.err();
    if (t->type() != core::dtype::f32 || t->shape() != d.info.shape)
      return key_error((fs::path(dir.value()) / "manifest.json").string(), "tensor '" + d.info.name + "'",
                       "is " + std::string(core::dtype_name(t->type())) + " " +
                           core::shape_string(t->shape()) + ", the model needs fp32 " +
                           core::shape_string(d.info.shape));
    params[d.info.name] = t.value();
  }
  return std::pair<core::config, param_map>{std::move(cfg.value()), std::move(params)};
}

namespace {

// A float as the double with its shortest decimal form (0.02f as 0.02, not 0.0199999995...).
double widen(float f) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, f);
  return ec == std::errc{} ? std::strtod(std::string(buf, end).c_str(), nullptr) : double(f);
}

json config_json(const core::model_config& m, const export_options& o) {
  json j;
  const char* dtype = o.dtype == core::dtype::bf16 ? "bfloat16" : "float32";
  if (m.arch == arch_kind::gpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"n_layer", m.num_layers},
         {"n_embd", m.hidden_size},
         {"n_head", m.num_heads},
         {"n_inner", m.ffn_size()},
         {"n_positions", m.seq_length},
         {"n_ctx", m.seq_length},
         {"vocab_size", m.vocab_size},
         {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", m.norm_eps},
         {"initializer_range", widen(m.init_std)},
         // The run's dropout rates (model.hidden_dropout drops the embedding output and both
         // residual branches, as resid_pdrop and embd_pdrop do).
         {"resid_pdrop", widen(m.hidden_dropout)},
         {"embd_pdrop", widen(m.hidden_dropout)},
         {"attn_pdrop", widen(m.attention_dropout)},
         {"scale_attn_weights", true},
         {"scale_attn_by_inverse_layer_idx", false},
         {"reorder_and_upcast_attn", false},
         {"use_cache", true}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"hidden_size", m.hidden_size},
         {"intermediate_size", m.ffn_size()},
         {"num_hidden_layers", m.num_layers},
         {"num_attention_heads", m.num_heads},
         {"num_key_value_heads", m.kv_heads()},
         {"head_dim", m.head_dim()},
         {"max_position_embeddings", m.seq_length},
         {"vocab_size", m.vocab_size},
         {"hidden_act", "silu"},
         {"rms_norm_eps", m.norm_eps},
         {"initializer_range", widen(m.init_std)},
         {"attention_bias", false},
         {"attention_dropout", widen(m.attention_dropout)},
         {"mlp_bias", false},
         {"pretraining_tp", 1},
         {"rope_theta", m.rope_theta},
         {"use_cache", true}};
    // transformers 5 reads rope_parameters; rope_theta above is what 4.x reads.
    json rp = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
    if (m.rope_scaling == core::rope_scaling_kind::llama3)
      rp = {{"rope_type", "llama3"},
            {"rope_theta", m.rope_theta},
            {"factor", m.rope_scaling_factor},
            {"low_freq_factor", m.rope_low_freq_factor},
            {"high_freq_factor", m.rope_high_freq_factor},
            {"original_max_position_embeddings", m.rope_original_max_positions}};
    j["rope_parameters"] = rp;
  }
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["torch_dtype"] = dtype;
  if (o.tokens.bos >= 0) j["bos_token_id"] = o.tokens.bos;
  if (o.tokens.eos >= 0) j["eos_token_id"] = o.tokens.eos;
  if (o.tokens.pad >= 0) j["pad_token_id"] = o.tokens.pad;
  return j;
}

// Hugging Face's name for a troupe parameter, and whether its layout is Conv1D ([in, out]).
std::pair<std::string, bool> hf_name(const core::model_config& m, const std::string& name) {
  if (m.arch != arch_kind::gpt2 || name == "lm_head.weight") return {name, false};
  return {"transformer." + name, is_conv1d(name)};
}

core::tensor to_dtype(const core::tensor& t, core::dtype d) {
  if (d == core::dtype::f32) return t;
  core::tensor o = core::tensor::zeros(t.shape(), d);
  const float* a = t.data<float>();
  auto* b = o.data<std::uint16_t>();
  for (std::int64_t i = 0; i < t.numel(); ++i) b[i] = core::f32_to_bf16(a[i]);
  return o;
}

core::status write_json(const std::string& path, const json& j) {
  return core::write_file_atomic(path, j.dump(2) + "\n");
}

}  // namespace

core::status write_dir(const std::string& dir, const core::model_config& m, const param_map& params,
                       const export_options& opt) {
  if (opt.dtype != core::dtype::f32 && opt.dtype != core::dtype::bf16)
    return error::make("export dtype must be fp32 or bf16");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return error::at_file(dir, "cannot create the output directory: " + ec.message());
  // Stored tensors in model order, named and laid out as transformers expects.
  std::vector<safetensors::named_tensor> out;
  for (const param_def& d : define_params(m, chunk_spec{0, m.num_layers, true, true})) {
    if (d.info.tied) continue;
    auto it = params.find(d.info.name);
    if (it == params.end())
      return key_error(dir, "tensor '" + d.info.name + "'", "missing from the weights to export");
    if (it->second.shape() != d.info.shape || it->second.type() != core::dtype::f32)
      return key_error(dir, "tensor '" + d.info.name + "'",
                       "is " + core::shape_string(it->second.shape()) + ", the model needs fp32 " +
                           core::shape_string(d.info.shape));
    auto [name, conv] = hf_name(m, d.info.name);
    core::tensor t = conv ? transpose(it->second) : it->second;
    out.push_back({name, to_dtype(t, opt.dtype)});
  }
  // Shards as transformers cuts them: in order, a new file when the next tensor would pass the
  // limit; a tensor larger than the limit gets a file of its own.
  std::vector<std::vector<safetensors::named_tensor>> shards(1);
  std::uint64_t in_shard = 0, total = 0;
  for (auto& t : out) {
    const std::uint64_t b = t.value.bytes();
    if (!shards.back().empty() && in_shard + b > opt.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(t);
    in_shard += b;
    total += b;
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  // Files a previous export left that this one does not write would confuse a reader.
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n == "model.safetensors" || n == "model.safetensors.index.json" ||
        (n.rfind("model-", 0) == 0 && n.size() > 12 && n.substr(n.size() - 12) == ".safetensors"))
      fs::remove(e.path(), ec);
  }
  if (shards.size() == 1) {
    auto w = safetensors::write((fs::path(dir) / "model.safetensors").string(), shards[0], meta);
    if (!w) return w.err();
  } else {
    json weight_map = json::object();
    char name[64];
    for (std::size_t i = 0; i < shards.size(); ++i) {
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      auto w = safetensors::write((fs::path(dir) / name).string(), shards[i], meta);
      if (!w) return w.err();
      for (auto& t : shards[i]) weight_map[t.name] = name;
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    if (auto st = write_json((fs::path(dir) / "model.safetensors.index.json").string(), index); !st)
      return st;
  }
  if (auto st = write_json((fs::path(dir) / "config.json").string(), config_json(m, opt)); !st)
    return st;
  json gen = json::object();
  if (opt.tokens.bos >= 0) gen["bos_token_id"] = opt.tokens.bos;
  if (opt.tokens.eos >= 0) gen["eos_token_id"] = opt.tokens.eos;
  if (opt.tokens.pad >= 0) gen["pad_token_id"] = opt.tokens.pad;
  if (auto st = write_json((fs::path(dir) / "generation_config.json").string(), gen); !st) return st;
  for (const tokenizer_file& f : opt.tokenizer) {
    auto text = core::read_input(f.source, json_spec("tokenizer file"));
    if (!text) return text.err();
    if (auto st = core::write_file_atomic((fs::path(dir) / f.name).string(), text.value()); !st)
      return st;
  }
  if (!opt.tokenizer_class.empty()) {
    json tc = {{"tokenizer_class", opt.tokenizer_class}, {"model_max_length", m.seq_length}};
    if (opt.tokenizer_class == "GPT2Tokenizer")
      for (const char* k : {"bos_token", "eos_token", "unk_token"}) tc[k] = "<|endoftext|>";
    if (auto st = write_json((fs::path(dir) / "tokenizer_config.json").string(), tc); !st) return st;
  }
  return {};
}

std::string model_table_toml(const core::model_config& m) {
  std::string s = "[model]\n";
  auto line = [&](const std::string& k, const std::string& v) { s += k + " = " + v + "\n"; };
  auto num = [](double v) {
    std::string t = json(v).dump();
    if (t.find_first_of(".eE") == std::string::npos) t += ".0";
    return t;
  };
  line("arch", m.arch == arch_kind::gpt2 ? "\"gpt2\"" : "\"llama\"");
  line("num_layers", std::to_string(m.num_layers));
  line("hidden_size", std::to_string(m.hidden_size));
  line("num_heads", std::to_string(m.num_heads));
  if (m.arch == arch_kind::llama) line("num_kv_heads", std::to_string(m.kv_heads()));
  line("ffn_hidden_size", std::to_string(m.ffn_size()));
  line("seq_length", std::to_string(m.seq_length));
  line("vocab_size", std::to_string(m.vocab_size));
  line("tie_embeddings", m.tie_embeddings ? "true" : "false");
  if (m.arch == arch_kind::llama) {
    line("rope_theta", num(m.rope_theta));
    if (m.rope_scaling == core::rope_scaling_kind::llama3) {
      line("rope_scaling", "\"llama3\"");
      line("rope_scaling_factor", num(m.rope_scaling_factor));
      line("rope_low_freq_factor", num(m.rope_low_freq_factor));
      line("rope_high_freq_factor", num(m.rope_high_freq_factor));
      line("rope_original_max_position_embeddings", std::to_string(m.rope_original_max_positions));
    }
  }
  line("norm_eps", num(m.norm_eps));
  line("init_std", num(widen(m.init_std)));
  return s;
}

}  // namespace troupe::model::hf
