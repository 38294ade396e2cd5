// The key table of the run configuration (see config_schema.hpp). Ranges are what the code can run,
// not what is sensible: a 1-layer model is fine, a negative one is not. Upper bounds keep every
// derived product (parameter count, tokens per step) inside 64 bits.
#include "core/config_schema.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <type_traits>

namespace troupe::core {

namespace detail {
namespace {

constexpr std::int64_t int_max = std::numeric_limits<int>::max();
constexpr double inf = std::numeric_limits<double>::infinity();

// A float member reads back as the double with the float's shortest decimal form (0.02f reads as
// 0.02, not 0.0199999995529651641845703125), so printed configs look like what the user wrote and
// still convert back to the same float.
double widen(float f) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, f);
  return ec == std::errc{} ? std::strtod(std::string(buf, end).c_str(), nullptr) : double(f);
}

template <class S, class T>
key_spec int_key(std::string table, std::string name, S config::*section, T S::*member,
                 std::int64_t lo, std::int64_t hi, std::string hint = {}) {
  key_spec k;
  k.table = std::move(table);
  k.name = std::move(name);
  k.kind = value_kind::integer;
  k.min_int = lo;
  k.max_int = hi;
  k.range_hint = std::move(hint);
  k.set = [section, member](config& c, const config_value& v) {
    (c.*section).*member = static_cast<T>(std::get<std::int64_t>(v));
  };
  k.get = [section, member](const config& c) -> config_value {
    return static_cast<std::int64_t>((c.*section).*member);
  };
  return k;
}

template <class S, class T>
key_spec float_key(std::string table, std::string name, S config::*section, T S::*member, double lo,
                   bool lo_open, double hi, bool hi_open, std::string hint = {}) {
  key_spec k;
  k.table = std::move(table);
  k.name = std::move(name);
  k.kind = value_kind::floating;
  k.min_float = lo;
  k.max_float = hi;
  k.min_open = lo_open;
  k.max_open = hi_open;
  k.range_hint = std::move(hint);
  k.set = [section, member](config& c, const config_value& v) {
    (c.*section).*member = static_cast<T>(std::get<double>(v));
  };
  k.get = [section, member](const config& c) -> config_value {
    if constexpr (std::is_same_v<T, float>)
      return widen((c.*section).*member);
    else
      return static_cast<double>((c.*section).*member);
  };
  return k;
}

template <class S>
key_spec bool_key(std::string table, std::string name, S config::*section, bool S::*member) {
  key_spec k;
  k.table = std::move(table);
  k.name = std::move(name);
  k.kind = value_kind::boolean;
  k.set = [section, member](config& c, const config_value& v) {
    (c.*section).*member = std::get<bool>(v);
  };
  k.get = [section, member](const config& c) -> config_value { return (c.*section).*member; };
  return k;
}

template <class S>
key_spec string_key(std::string table, std::string name, S config::*section,
                    std::string S::*member) {
  key_spec k;
  k.table = std::move(table);
  k.name = std::move(name);
  k.kind = value_kind::string;
  k.set = [section, member](config& c, const config_value& v) {
    (c.*section).*member = std::get<std::string>(v);
  };
  k.get = [section, member](const config& c) -> config_value { return (c.*section).*member; };
  return k;
}

// A choice stored as an enum whose values are 0, 1, 2, ... in the order of `choices`.
template <class S, class E>
key_spec choice_key(std::string table, std::string name, S config::*section, E S::*member,
                    std::vector<std::string> choices) {
  key_spec k;
  k.table = std::move(table);
  k.name = std::move(name);
  k.kind = value_kind::choice;
  k.choices = choices;
  k.set = [section, member, choices](config& c, const config_value& v) {
    auto it = std::find(choices.begin(), choices.end(), std::get<std::string>(v));
    (c.*section).*member = static_cast<E>(it - choices.begin());
  };
  k.get = [section, member, choices](const config& c) -> config_value {
    return choices.at(static_cast<std::size_t>((c.*section).*member));
  };
  return k;
}

// A choice stored as its string (runtime.device: later backends add names without an enum change).
template <class S>
key_spec choice_key(std::string table, std::string name, S config::*section,
                    std::string S::*member, std::vector<std::string> choices) {
  key_spec k = string_key(std::move(table), std::move(name), section, member);
  k.kind = value_kind::choice;
  k.choices = std::move(choices);
  return k;
}

// A list of integers (parallel.stage_layers, recompute.layer_list), each in [lo, hi].
template <class S>
key_spec int_list_key(std::string table, std::string name, S config::*section,
                      std::vector<int> S::*member, std::int64_t lo, std::int64_t hi,
                      std::string hint = {}) {
  key_spec k;
  k.table = std::move(table);
  k.name = std::move(name);
  k.kind = value_kind::int_list;
  k.min_int = lo;
  k.max_int = hi;
  k.range_hint = std::move(hint);
  k.set = [section, member](config& c, const config_value& v) {
    (c.*section).*member = split_int_list(std::get<std::string>(v));
  };
  k.get = [section, member](const config& c) -> config_value {
    return join_int_list((c.*section).*member);
  };
  return k;
}

// A key of the [lora] table, stored in model_config::lora.
template <class T>
key_spec lora_key(std::string name, value_kind kind, T lora_config::*member) {
  key_spec k;
  k.table = "lora";
  k.name = std::move(name);
  k.kind = kind;
  k.set = [member](config& c, const config_value& v) {
    if constexpr (std::is_same_v<T, int>)
      c.model.lora.*member = static_cast<int>(std::get<std::int64_t>(v));
    else if constexpr (std::is_same_v<T, double>)
      c.model.lora.*member = std::get<double>(v);
    else
      c.model.lora.*member = split_list(std::get<std::string>(v));
  };
  k.get = [member](const config& c) -> config_value {
    if constexpr (std::is_same_v<T, int>)
      return static_cast<std::int64_t>(c.model.lora.*member);
    else if constexpr (std::is_same_v<T, double>)
      return c.model.lora.*member;
    else
      return join_list(c.model.lora.*member);
  };
  return k;
}

std::vector<key_spec> make_specs() {
  using C = config;
  using M = model_config;
  using P = parallel_config;
  using O = optimizer_config;
  using T = train_config;
  std::vector<key_spec> s;
  s.push_back(choice_key("model", "arch", &C::model, &M::arch, {"gpt2", "llama"}));
  s.push_back(int_key("model", "num_layers", &C::model, &M::num_layers, 1, 10000));
  s.push_back(int_key("model", "hidden_size", &C::model, &M::hidden_size, 1, 1 << 20));
  s.push_back(int_key("model", "num_heads", &C::model, &M::num_heads, 1, 1 << 16));
  s.push_back(int_key("model", "num_kv_heads", &C::model, &M::num_kv_heads, 0, 1 << 16,
                      "0 means num_heads (multi-head attention)"));
  s.push_back(int_key("model", "ffn_hidden_size", &C::model, &M::ffn_hidden_size, 0, 1 << 22,
                      "0 means 4 * hidden_size for gpt2 and the LLaMA rule for llama"));
  s.push_back(int_key("model", "seq_length", &C::model, &M::seq_length, 1, 1 << 24));
  s.push_back(int_key("model", "vocab_size", &C::model, &M::vocab_size, 1, 1 << 24,
                      "LLaMA-3 has 128256 tokens; token shards hold uint16 ids up to 65536 "
                      "tokens and uint32 ids above"));
  s.push_back(bool_key("model", "tie_embeddings", &C::model, &M::tie_embeddings));
  s.push_back(float_key("model", "rope_theta", &C::model, &M::rope_theta, 0, true, inf, false));
  s.push_back(choice_key("model", "rope_scaling", &C::model, &M::rope_scaling, {"none", "llama3"}));
  const auto llama3 = [](const config& c) { return c.model.rope_scaling == rope_scaling_kind::llama3; };
  s.push_back(float_key("model", "rope_scaling_factor", &C::model, &M::rope_scaling_factor, 1,
                        false, inf, false));
  s.back().applies = llama3;
  s.push_back(float_key("model", "rope_low_freq_factor", &C::model, &M::rope_low_freq_factor, 0,
                        true, inf, false));
  s.back().applies = llama3;
  s.push_back(float_key("model", "rope_high_freq_factor", &C::model, &M::rope_high_freq_factor, 0,
                        true, inf, false));
  s.back().applies = llama3;
  s.push_back(int_key("model", "rope_original_max_position_embeddings", &C::model,
                      &M::rope_original_max_positions, 1, 1 << 24));
  s.back().applies = llama3;
  s.push_back(float_key("model", "norm_eps", &C::model, &M::norm_eps, 0, true, 1, false));
  s.push_back(float_key("model", "init_std", &C::model, &M::init_std, 0, true, 1, false));
  s.push_back(float_key("model", "attention_dropout", &C::model, &M::attention_dropout, 0, false,
                        1, true, "the probability an attention probability is dropped; 0 = off"));
  s.push_back(float_key("model", "hidden_dropout", &C::model, &M::hidden_dropout, 0, false, 1,
                        true, "the probability a hidden element is dropped; 0 = off"));
  s.push_back(string_key("model", "init", &C::model, &M::init));

  key_spec rank = lora_key("rank", value_kind::integer, &lora_config::rank);
  rank.min_int = 0;
  rank.max_int = 1 << 16;
  rank.range_hint = "the rank of the adapters B·A; 0 = no adapters";
  s.push_back(std::move(rank));
  key_spec alpha = lora_key("alpha", value_kind::floating, &lora_config::alpha);
  alpha.min_float = 0;
  alpha.max_float = inf;
  alpha.range_hint = "the adapters' output is scaled by alpha / rank; 0 means alpha = rank";
  s.push_back(std::move(alpha));
  s.push_back(lora_key("targets", value_kind::list, &lora_config::targets));
  s.push_back(lora_key("trainable", value_kind::list, &lora_config::trainable));
  s.push_back(lora_key("freeze", value_kind::list, &lora_config::freeze));

  s.push_back(int_key("parallel", "data_parallel", &C::parallel, &P::data_parallel, 1, 1 << 16));
  s.push_back(int_key("parallel", "model_parallel", &C::parallel, &P::model_parallel, 1, 1024));
  s.push_back(bool_key("parallel", "sequence_parallel", &C::parallel, &P::sequence_parallel));
  s.push_back(int_key("parallel", "pipeline_stage", &C::parallel, &P::pipeline_stage, 1, 1024));
  s.push_back(int_key("parallel", "micro_batch_num", &C::parallel, &P::micro_batch_num, 1, 1 << 20));
  s.push_back(int_key("parallel", "micro_batch_size", &C::parallel, &P::micro_batch_size, 1, 1 << 20));
  s.push_back(int_key("parallel", "virtual_pipeline", &C::parallel, &P::virtual_pipeline, 1, 1024));
  s.push_back(int_list_key("parallel", "stage_layers", &C::parallel, &P::stage_layers, 1, 10000,
                           "each model chunk holds at least one layer"));
  s.push_back(int_key("parallel", "first_stage_layers", &C::parallel, &P::first_stage_layers, 0,
                      10000, "0 splits the layers evenly"));
  s.push_back(int_key("parallel", "last_stage_layers", &C::parallel, &P::last_stage_layers, 0,
                      10000, "0 splits the layers evenly"));

  s.push_back(string_key("schedule", "name", &C::schedule, &schedule_config::name));
  s.push_back(string_key("schedule", "file", &C::schedule, &schedule_config::file));

  s.push_back(choice_key("recompute", "mode", &C::recompute, &recompute_config::mode,
                         {"none", "full", "selective"}));
  s.push_back(int_key("recompute", "layers", &C::recompute, &recompute_config::layers, 0, 10000,
                      "0 recomputes every layer; N the first N layers of each model chunk"));
  s.push_back(int_list_key("recompute", "layer_list", &C::recompute, &recompute_config::layer_list,
                           0, 9999, "global layer indices, 0 to num_layers - 1"));
  s.push_back(int_key("recompute", "keep_gelu", &C::recompute, &recompute_config::keep_gelu, 0,
                      10000, "0 recomputes GELU in every layer; N keeps it in the last N layers"));

  s.push_back(choice_key("precision", "compute", &C::precision, &precision_config::compute,
                         {"fp32", "bf16", "fp16"}));
  s.push_back(float_key("precision", "loss_scale", &C::precision, &precision_config::loss_scale, 0,
                        true, std::numeric_limits<float>::max(), false,
                        "the loss is multiplied by the scale as an fp32 number"));
  s.push_back(int_key("precision", "loss_scale_window", &C::precision,
                      &precision_config::loss_scale_window, 1, int_max));
  s.push_back(bool_key("precision", "dynamic_loss_scale", &C::precision,
                       &precision_config::dynamic_loss_scale));

  s.push_back(float_key("optimizer", "lr", &C::optimizer, &O::lr, 0, false, inf, false));
  s.push_back(float_key("optimizer", "min_lr", &C::optimizer, &O::min_lr, 0, false, inf, false));
  s.push_back(float_key("optimizer", "weight_decay", &C::optimizer, &O::weight_decay, 0, false, inf,
                        false));
  s.push_back(float_key("optimizer", "beta1", &C::optimizer, &O::beta1, 0, false, 1, true));
  s.push_back(float_key("optimizer", "beta2", &C::optimizer, &O::beta2, 0, false, 1, true));
  s.push_back(float_key("optimizer", "eps", &C::optimizer, &O::eps, 0, true, inf, false));
  s.push_back(int_key("optimizer", "zero_stage", &C::optimizer, &O::zero_stage, 0, 2,
                      "0 = every replica updates everything, 1 = optimizer state sharded, 2 = "
                      "gradients sharded too; ZeRO-3 is not supported"));
  s.push_back(bool_key("optimizer", "offload", &C::optimizer, &O::offload));

  s.push_back(int_key("train", "steps", &C::train, &T::steps, 1, int_max));
  s.push_back(int_key("train", "gradient_accumulation_steps", &C::train,
                      &T::gradient_accumulation_steps, 1, 1 << 20));
  s.push_back(int_key("train", "seed", &C::train, &T::seed, 0,
                      std::numeric_limits<std::int64_t>::max()));
  s.push_back(float_key("train", "grad_clip", &C::train, &T::grad_clip, 0, false, inf, false,
                        "0 turns clipping off"));
  s.push_back(int_key("train", "warmup_steps", &C::train, &T::warmup_steps, 0, int_max));
  s.push_back(int_key("train", "log_interval", &C::train, &T::log_interval, 1, int_max));
  s.push_back(int_key("train", "eval_interval", &C::train, &T::eval_interval, 0, int_max,
                      "0 evaluates only at the end"));
  s.push_back(int_key("train", "eval_batches", &C::train, &T::eval_batches, 1, int_max));

  s.push_back(string_key("data", "train", &C::data, &data_config::train));
  s.push_back(string_key("data", "val", &C::data, &data_config::val));
  s.push_back(string_key("data", "tokenizer", &C::data, &data_config::tokenizer));
  s.push_back(string_key("data", "tokenizer_dir", &C::data, &data_config::tokenizer_dir));
  s.push_back(choice_key("data", "template", &C::data, &data_config::chat_template,
                         {"plain", "llama3"}));
  s.push_back(bool_key("data", "packing", &C::data, &data_config::packing));

  s.push_back(string_key("checkpoint", "dir", &C::checkpoint, &checkpoint_config::dir));
  s.push_back(int_key("checkpoint", "interval", &C::checkpoint, &checkpoint_config::interval, 0,
                      int_max, "0 writes only the final checkpoint"));
  s.push_back(int_key("checkpoint", "keep", &C::checkpoint, &checkpoint_config::keep, 0, int_max,
                      "0 keeps every checkpoint"));

  s.push_back(choice_key("runtime", "device", &C::runtime, &runtime_config::device,
                         {"cpu", "cuda"}));
  s.push_back(bool_key("runtime", "deterministic", &C::runtime, &runtime_config::deterministic));
  s.push_back(bool_key("runtime", "cuda_graph", &C::runtime, &runtime_config::cuda_graph));
  s.push_back(bool_key("runtime", "split_gpu", &C::runtime, &runtime_config::split_gpu));
  s.push_back(string_key("runtime", "gemm_tune_file", &C::runtime,
                         &runtime_config::gemm_tune_file));
  s.push_back(string_key("runtime", "run_dir", &C::runtime, &runtime_config::run_dir));
  s.push_back(int_key("runtime", "threads", &C::runtime, &runtime_config::threads, 0, 4096,
                      "0 uses every core"));
  s.push_back(string_key("runtime", "fault_inject", &C::runtime, &runtime_config::fault_inject));
  s.push_back(bool_key("runtime", "record", &C::runtime, &runtime_config::record));
  s.push_back(bool_key("runtime", "record_tensors", &C::runtime, &runtime_config::record_tensors));
  s.push_back(int_key("runtime", "watchdog_s", &C::runtime, &runtime_config::watchdog_s, 1, 86400,
                      "seconds without progress before the job is stopped with a hang report"));
  s.push_back(choice_key("runtime", "forensics", &C::runtime, &runtime_config::forensics,
                         {"off", "stop", "skip"}));
  s.push_back(float_key("runtime", "forensics_loss_jump", &C::runtime,
                        &runtime_config::forensics_loss_jump, 0, false, inf, false,
                        "0 turns the loss-jump check off; otherwise more than 1"));
  s.push_back(int_key("runtime", "report_interval", &C::runtime, &runtime_config::report_interval, 0,
                      int_max, "0 writes no report during the run; troupe report RUN_DIR draws one"));
  return s;
}

}  // namespace

const std::vector<key_spec>& key_specs() {
  static const std::vector<key_spec> specs = make_specs();
  return specs;
}

const std::vector<std::string>& table_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& k : key_specs())
      if (n.empty() || n.back() != k.table) n.push_back(k.table);
    return n;
  }();
  return names;
}

const key_spec* find_key(std::string_view dotted) {
  for (const auto& k : key_specs())
    if (k.dotted() == dotted) return &k;
  return nullptr;
}

int edit_distance(std::string_view a, std::string_view b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

namespace {

// A third of the name's letters may be wrong before a suggestion stops being a plausible typo.
int typo_budget(std::string_view name) { return std::max<int>(1, static_cast<int>(name.size()) / 3); }

}  // namespace

std::string nearest(std::string_view name, const std::vector<std::string>& candidates) {
  std::string best;
  int best_d = typo_budget(name) + 1;
  for (const auto& c : candidates) {
    const int d = edit_distance(name, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::string nearest_key(std::string_view dotted) {
  const auto dot = dotted.rfind('.');
  const std::string_view table = dot == std::string_view::npos ? "" : dotted.substr(0, dot);
  const std::string_view leaf = dot == std::string_view::npos ? dotted : dotted.substr(dot + 1);
  // Rank by the distance of the key names, and prefer the table the user wrote: a right name in
  // the wrong table ("train.lr") costs two edits.
  std::string best;
  int best_score = std::numeric_limits<int>::max();
  for (const auto& k : key_specs()) {
    const int d = edit_distance(leaf, k.name);
    if (d > typo_budget(leaf)) continue;
    const int score = d + (k.table == table ? 0 : 2);
    if (score < best_score) {
      best_score = score;
      best = k.dotted();
    }
  }
  return best;
}

std::vector<std::string> split_list(std::string_view joined) {
  std::vector<std::string> out;
  std::size_t from = 0;
  while (from <= joined.size()) {
    std::size_t to = joined.find(',', from);
    if (to == std::string_view::npos) to = joined.size();
    std::string_view item = joined.substr(from, to - from);
    const auto b = item.find_first_not_of(" \t");
    if (b != std::string_view::npos) {
      const auto e = item.find_last_not_of(" \t");
      out.emplace_back(item.substr(b, e - b + 1));
    }
    from = to + 1;
  }
  return out;
}

std::string join_list(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ",") + i;
  return out;
}

std::string toml_list_literal(const config_value& v, bool integers) {
  std::string out = "[";
  for (const auto& item : split_list(std::get<std::string>(v)))
    out += (out.size() > 1 ? ", " : "") + (integers ? item : toml_literal(item));
  return out + "]";
}

std::vector<int> split_int_list(std::string_view joined) {
  std::vector<int> out;
  for (const auto& item : split_list(joined)) {
    int v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec == std::errc{} && end == item.data() + item.size()) out.push_back(v);
  }
  return out;
}

std::string join_int_list(const std::vector<int>& items) {
  std::string out;
  for (int i : items) out += (out.empty() ? "" : ",") + std::to_string(i);
  return out;
}

std::string toml_literal(const config_value& v) {
  if (const auto* i = std::get_if<std::int64_t>(&v)) return std::to_string(*i);
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const auto* d = std::get_if<double>(&v)) {
    if (std::isinf(*d)) return *d > 0 ? "inf" : "-inf";
    if (std::isnan(*d)) return "nan";
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, *d);
    std::string s(buf, ec == std::errc{} ? end : buf);
    // TOML reads "3" as an integer; keep floats floats.
    if (s.find_first_of(".e") == std::string::npos) s += ".0";
    return s;
  }
  std::string out = "\"";
  for (unsigned char ch : std::get<std::string>(v)) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (ch < 0x20 || ch == 0x7f) {
          char esc[8];
          std::snprintf(esc, sizeof esc, "\\u%04x", ch);
          out += esc;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

}  // namespace detail

bool operator==(const config& a, const config& b) {
  return a.model == b.model && a.parallel == b.parallel && a.schedule == b.schedule &&
         a.recompute == b.recompute && a.precision == b.precision && a.optimizer == b.optimizer &&
         a.train == b.train && a.data == b.data && a.checkpoint == b.checkpoint &&
         a.runtime == b.runtime;
}

std::vector<config_entry> config_entries(const config& c) {
  std::vector<config_entry> out;
  for (const auto& k : detail::key_specs()) {
    if (k.applies && !k.applies(c)) continue;
    const std::string key = k.dotted();
    std::string origin = "default";
    if (auto it = c.origins.find(key); it != c.origins.end())
      origin = it->second.file.rfind("--set", 0) == 0 ? "--set" : "file";
    out.push_back({key, k.get(c), origin});
  }
  return out;
}

error config_error(const config& c, const std::string& key, std::string message, std::string hint) {
  error e{std::move(message), {}, std::move(hint)};
  if (auto it = c.origins.find(key); it != c.origins.end()) e.where = it->second;
  else e.where.file = c.source;
  e.where.key = key;
  return e;
}

}  // namespace troupe::core
