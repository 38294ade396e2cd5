// Merging LoRA adapters into their base weights and writing them in PEFT's layout (lora.hpp).
#include "model/lora.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/files.hpp"
#include "model/hf.hpp"
#include "model/params.hpp"
#include "model/safetensors.hpp"

namespace troupe::model {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ", ") + i;
  return out;
}

const std::string a_tail = ".lora_A.weight", b_tail = ".lora_B.weight";

core::error missing(const std::string& name, const std::string& what) {
  return core::error::make("LoRA merge: tensor '" + name + "' " + what,
                           "the parameters must come from one model with its [lora] table");
}

}  // namespace

base_identity identify_base(const core::config& cfg) {
  base_identity id;
  const auto defs = define_frozen_params(cfg.model, partition(cfg.model, 1)[0]);
  if (defs.empty()) return id;
  std::string lines;
  if (!cfg.model.init.empty()) {
    // The base is model.init's weights (hf::load_frozen_base).
    id.source = "model.init " + cfg.model.init;
    auto w = hf::weights::open(cfg.model.init, cfg.model, cfg.source);
    if (!w) {
      id.source += " (unreadable: " + w.err().message + ")";
      return id;
    }
    for (const auto& d : defs) {
      auto t = w.value()->load(d.info.tied ? embedding_name(cfg.model) : d.info.name, d.info.shape);
      if (!t) {
        id.source += " (unreadable: " + t.err().message + ")";
        id.xxh64.clear();
        return id;
      }
      lines += d.info.name + " " +
               safetensors::hex64(safetensors::xxh64(t->data<float>(), static_cast<std::size_t>(t->numel()) * sizeof(float))) + "\n";
    }
    id.xxh64 = safetensors::hex64(safetensors::xxh64(lines.data(), lines.size()));
    return id;
  }
  id.source = "seed " + std::to_string(cfg.train.seed);
  std::vector<float> buf;
  for (const auto& d : defs) {
    buf.assign(static_cast<std::size_t>(d.info.numel), 0.0f);
    init_param(d, cfg.model, cfg.train.seed, buf.data());
    lines += d.info.name + " " +
             safetensors::hex64(safetensors::xxh64(buf.data(), buf.size() * sizeof(float))) + "\n";
  }
  id.xxh64 = safetensors::hex64(safetensors::xxh64(lines.data(), lines.size()));
  return id;
}

named_tensors gather_parameters(std::vector<chunk>& chunks, kernels::backend& be) {
  named_tensors out;
  for (auto& c : chunks)
    for (const auto* list : {&c.params(), &c.frozen_params()})
      for (const auto& p : *list) out[p.name] = be.to_host(c.param(p.name)).clone();
  return out;
}

core::model_config without_lora(const core::model_config& cfg) {
  core::model_config m = cfg;
  m.lora = {};
  return m;
}

core::result<named_tensors> merge_lora(const core::model_config& cfg, const named_tensors& params) {
  named_tensors out;
  const double s = cfg.lora.rank > 0 ? cfg.lora.alpha / cfg.lora.rank : 0.0;
  for (const auto& [name, t] : params) {
    if (ends_with(name, a_tail) || ends_with(name, b_tail)) continue;
    out[name] = t.clone();
  }
  for (const auto& [name, a] : params) {
    if (!ends_with(name, a_tail)) continue;
    const std::string module = name.substr(0, name.size() - a_tail.size());
    auto b_it = params.find(module + b_tail);
    if (b_it == params.end()) return missing(module + b_tail, "is missing beside " + name);
    auto w_it = out.find(module + ".weight");
    if (w_it == out.end()) return missing(module + ".weight", "is missing: " + name + " has no base");
    core::tensor& w = w_it->second;
    const core::tensor& b = b_it->second;
    if (a.type() != core::dtype::f32 || b.type() != core::dtype::f32 || w.type() != core::dtype::f32 ||
        a.rank() != 2 || b.rank() != 2 || w.rank() != 2 || b.dim(1) != a.dim(0) ||
        w.dim(0) != b.dim(0) || w.dim(1) != a.dim(1))
      return missing(name, "(" + core::shape_string(a.shape()) + ") does not fit " + module +
                               ".weight " + core::shape_string(w.shape()) + " and its B " +
                               core::shape_string(b.shape()));
    const std::int64_t rows = w.dim(0), cols = w.dim(1), r = a.dim(0);
    const float* pa = a.data<float>();
    const float* pb = b.data<float>();
    float* pw = w.data<float>();
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) {
        double acc = 0;
        for (std::int64_t k = 0; k < r; ++k)
          acc += static_cast<double>(pb[i * r + k]) * static_cast<double>(pa[k * cols + j]);
        pw[i * cols + j] = static_cast<float>(static_cast<double>(pw[i * cols + j]) + s * acc);
      }
  }
  return out;
}

std::string peft_name(const core::model_config& cfg, const std::string& troupe_name) {
  const std::string under = cfg.arch == core::arch_kind::gpt2 ? "transformer." : "";
  return "base_model.model." + under + troupe_name;
}

core::status write_peft_adapter(const core::model_config& cfg, const named_tensors& params,
                                const std::string& dir) {
  if (cfg.lora.rank <= 0)
    return core::error::make("the model has no LoRA adapters (no lora.rank) to export",
                             "export the model itself instead");
  if (!cfg.lora.trainable.empty())
    return core::error::make(
        "the model trains base modules in full beside its adapters (lora.trainable = " +
            join(cfg.lora.trainable) + "); a PEFT adapter holds only adapters",
        "export the merged model (--merge-lora) instead");
  std::vector<safetensors::named_tensor> tensors;
  for (const auto& [name, t] : params)
    if (ends_with(name, a_tail) || ends_with(name, b_tail))
      tensors.push_back({peft_name(cfg, name), t});
  if (tensors.empty())
    return core::error::make("no adapter tensors (*.lora_A.weight) among the parameters",
                             "the parameters must come from a model with its [lora] table");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return core::error::at_file(dir, "cannot create the folder: " + ec.message(),
                                "check the path and its permissions");
  auto w = safetensors::write(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  if (!w) return w.err();
  // PEFT's LoraConfig fields; GPT-2's Conv1D modules store weights [in, out] (fan_in_fan_out).
  nlohmann::json c = {{"peft_type", "LORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"r", cfg.lora.rank},
                      {"lora_alpha", cfg.lora.alpha},
                      {"target_modules", cfg.lora.targets},
                      {"lora_dropout", 0.0},
                      {"bias", "none"},
                      {"fan_in_fan_out", cfg.arch == core::arch_kind::gpt2},
                      {"use_rslora", false},
                      {"init_lora_weights", true},
                      {"inference_mode", true},
                      {"modules_to_save", nullptr},
                      {"base_model_name_or_path", nullptr}};
  return core::write_file_atomic(dir + "/adapter_config.json", c.dump(2) + "\n");
}

}  // namespace troupe::model
