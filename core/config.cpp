// Reading a run configuration: TOML text and `--set key=value` overrides into the structs of
// core/config.hpp, then the checks that need several keys at once, and the defaults that depend
// on the architecture. The first error wins and names file, line, column and key; the order is:
// overrides (the command line), then the file in document order, then the cross-key checks.
#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <deque>
#include <fmt/format.h>
#include <fstream>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string_view>

#include "core/config.hpp"
#include "core/config_schema.hpp"
#include "core/files.hpp"

namespace troupe::core {

namespace {

using detail::key_spec;
using detail::value_kind;
using namespace std::string_view_literals;

// One value to apply: a known key, its TOML node and where it was written.
struct setting {
  const key_spec* spec = nullptr;
  const toml::node* node = nullptr;
  location where;
};

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : std::string(sep)) + s;
  return out;
}

std::string table_list() {
  std::vector<std::string> t;
  for (const auto& n : detail::table_names()) t.push_back("[" + n + "]");
  return join(t, ", ");
}

std::string keys_of(const std::string& table) {
  std::vector<std::string> k;
  for (const auto& s : detail::key_specs())
    if (s.table == table) k.push_back(s.name);
  return join(k, ", ");
}

// "a string \"4\"", "an integer (4)", "a table": what the user wrote, for type errors.
std::string describe(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string:
      return "a string " + detail::toml_literal(std::string(*n.value<std::string_view>()));
    case toml::node_type::integer:
      return "an integer (" + std::to_string(*n.value<std::int64_t>()) + ")";
    case toml::node_type::floating_point:
      return "a float (" + detail::toml_literal(*n.value<double>()) + ")";
    case toml::node_type::boolean:
      return std::string("a boolean (") + (*n.value<bool>() ? "true" : "false") + ")";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

location at(const std::string& file, const std::string& key, const toml::source_region& r) {
  return location{file, key, static_cast<int>(r.begin.line), static_cast<int>(r.begin.column), -1};
}

error located(const location& where, std::string message, std::string hint) {
  return error{std::move(message), where, std::move(hint)};
}

error unknown_key(const location& where, const std::string& dotted, const std::string& hint) {
  const std::string guess = detail::nearest_key(dotted);
  std::string message = "unknown key '" + dotted + "'";
  if (!guess.empty()) message += "; did you mean '" + guess + "'?";
  return located(where, std::move(message), hint);
}

error unknown_table(const location& where, const std::string& name) {
  const std::string guess = detail::nearest(name, detail::table_names());
  std::string message = "unknown table [" + name + "]";
  if (!guess.empty()) message += "; did you mean [" + guess + "]?";
  return located(where, std::move(message), "the tables are " + table_list());
}

// The key's value in a default config, as an example for type errors ("e.g. num_layers = 4").
std::string example(const key_spec& k) {
  config defaults;
  if (k.kind == value_kind::choice) return k.name + " = " + detail::toml_literal(k.choices.front());
  if (k.kind == value_kind::list) return k.name + " = [\"q_proj\", \"v_proj\"]";
  if (k.kind == value_kind::int_list) return k.name + " = [3, 5, 5, 3]";
  return k.name + " = " + detail::toml_literal(k.get(defaults));
}

std::string range_text(const key_spec& k) {
  if (k.kind == value_kind::integer || k.kind == value_kind::int_list)
    return fmt::format("[{}, {}]", k.min_int, k.max_int);
  const auto bound = [](double v) { return detail::toml_literal(v); };
  return std::string(k.min_open ? "(" : "[") + bound(k.min_float) + ", " + bound(k.max_float) +
         (k.max_open ? ")" : "]");
}

error type_error(const setting& s, std::string_view expected) {
  const key_spec& k = *s.spec;
  std::string hint = "write it as " + std::string(expected) + ", e.g. " + example(k);
  if (s.node->is_string() && k.kind != value_kind::string && k.kind != value_kind::choice)
    hint += " (without quotes)";
  return located(s.where, "expected " + std::string(expected) + ", got " + describe(*s.node), hint);
}

error range_error(const setting& s, const std::string& value) {
  const key_spec& k = *s.spec;
  std::string hint = k.range_hint.empty() ? "see configs/README.md for " + k.dotted() : k.range_hint;
  return located(s.where, "value " + value + " is out of range " + range_text(k), hint);
}

// Converts and range-checks one value, then stores it and remembers where it came from.
status apply(const setting& s, config& c) {
  const key_spec& k = *s.spec;
  const toml::node& n = *s.node;
  config_value v;
  switch (k.kind) {
    case value_kind::integer: {
      if (!n.is_integer()) return type_error(s, "an integer");
      const std::int64_t i = *n.value<std::int64_t>();
      if (i < k.min_int || i > k.max_int) return range_error(s, std::to_string(i));
      v = i;
      break;
    }
    case value_kind::floating: {
      // An integer is a fine float ("grad_clip = 1"); the reverse would lose information.
      if (!n.is_floating_point() && !n.is_integer()) return type_error(s, "a number");
      const double d = *n.value<double>();
      if (!std::isfinite(d))
        return located(s.where, "expected a finite number, got " + detail::toml_literal(d),
                       "write a finite number, e.g. " + example(k));
      const bool below = k.min_open ? d <= k.min_float : d < k.min_float;
      const bool above = k.max_open ? d >= k.max_float : d > k.max_float;
      if (below || above) return range_error(s, detail::toml_literal(d));
      v = d;
      break;
    }
    case value_kind::boolean:
      if (!n.is_boolean()) return type_error(s, "a boolean");
      v = *n.value<bool>();
      break;
    case value_kind::string: {
      if (!n.is_string()) return type_error(s, "a string");
      std::string text(*n.value<std::string_view>());
      // Every string key is a path or a name handed to C functions, where a NUL ends the string.
      if (const auto nul = text.find('\0'); nul != std::string::npos)
        return located(s.where,
                       "the string holds a NUL byte (\\u0000) at position " + std::to_string(nul) +
                           ", which would cut the path or name short",
                       "remove the \\u0000 from the value");
      v = std::move(text);
      break;
    }
    case value_kind::list: {
      // An array of strings; a plain string is a comma-separated list (--set lora.targets=a,b).
      std::vector<std::string> items;
      if (const toml::array* arr = n.as_array()) {
        for (std::size_t i = 0; i < arr->size(); ++i) {
          const toml::node& item = *arr->get(i);
          if (!item.is_string())
            return located(s.where,
                           "item " + std::to_string(i) + " of the list is " + describe(item) +
                               ", expected a string",
                           "write a list of names, e.g. " + example(k));
          std::string text(*item.value<std::string_view>());
          if (text.empty() || text.find_first_of(", \t") != std::string::npos ||
              text.find('\0') != std::string::npos)
            return located(s.where,
                           "item " + std::to_string(i) + " of the list, " +
                               detail::toml_literal(text) + ", is not a name",
                           "each item is one module name without blanks or commas, e.g. " +
                               example(k));
          items.push_back(std::move(text));
        }
      } else if (n.is_string()) {
        items = detail::split_list(*n.value<std::string_view>());
      } else {
        return type_error(s, "a list of strings");
      }
      v = detail::join_list(items);
      break;
    }
    case value_kind::int_list: {
      // An array of integers; a plain string is a comma-separated list (--set k=3,5,5,3).
      std::vector<std::int64_t> items;
      if (const toml::array* arr = n.as_array()) {
        for (std::size_t i = 0; i < arr->size(); ++i) {
          const toml::node& item = *arr->get(i);
          if (!item.is_integer())
            return located(s.where,
                           "item " + std::to_string(i) + " of the list is " + describe(item) +
                               ", expected an integer",
                           "write a list of integers, e.g. " + example(k));
          items.push_back(*item.value<std::int64_t>());
        }
      } else if (n.is_string()) {
        for (const auto& text : detail::split_list(*n.value<std::string_view>())) {
          std::int64_t i = 0;
          const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), i);
          if (ec != std::errc{} || end != text.data() + text.size())
            return located(s.where, "'" + text + "' in the list is not an integer",
                           "write a list of integers, e.g. " + example(k));
          items.push_back(i);
        }
      } else {
        return type_error(s, "a list of integers");
      }
      std::string joined;
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (items[i] < k.min_int || items[i] > k.max_int)
          return located(s.where,
                         "item " + std::to_string(i) + " of the list, " +
                             std::to_string(items[i]) + ", is out of range " + range_text(k),
                         k.range_hint.empty() ? "see configs/README.md for " + k.dotted()
                                              : k.range_hint);
        joined += (i ? "," : "") + std::to_string(items[i]);
      }
      v = joined;
      break;
    }
    case value_kind::choice: {
      if (!n.is_string()) return type_error(s, "a string");
      const std::string text(*n.value<std::string_view>());
      if (std::find(k.choices.begin(), k.choices.end(), text) == k.choices.end()) {
        const std::string guess = detail::nearest(text, k.choices);
        return located(s.where,
                       "'" + text + "' is not one of the allowed values: " + join(k.choices, ", "),
                       guess.empty() ? "choose one of " + join(k.choices, ", ")
                                     : "did you mean '" + guess + "'?");
      }
      v = text;
      break;
    }
  }
  k.set(c, v);
  c.origins[k.dotted()] = s.where;
  return {};
}

std::string trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t");
  return std::string(s.substr(b, e - b + 1));
}

// Parses "key=value". The value is read as a TOML value (4, 3e-3, true, "text"); anything that
// is not one, such as a bare word or a path, is taken as a string. String keys take the raw text
// even when it looks like a number, so `--set checkpoint.dir=2024` means the folder "2024".
result<setting> parse_override(const std::string& text, std::deque<toml::table>& store) {
  location where{"--set " + text, "", 0, 0, -1};
  const auto eq = text.find('=');
  if (eq == std::string::npos)
    return located(where, "expected key=value", "e.g. --set parallel.pipeline_stage=4");
  const std::string key = trim(std::string_view(text).substr(0, eq));
  const std::string raw = trim(std::string_view(text).substr(eq + 1));
  where.key = key;
  const key_spec* spec = detail::find_key(key);
  if (!spec) {
    const auto& tables = detail::table_names();
    if (std::find(tables.begin(), tables.end(), key) != tables.end())
      return located(where, "'" + key + "' is a table, not a key",
                     "set one of its keys: " + keys_of(key));
    const std::string table = key.substr(0, key.find('.'));
    const bool known_table = std::find(tables.begin(), tables.end(), table) != tables.end();
    return unknown_key(where, key,
                       known_table ? "valid keys in [" + table + "]: " + keys_of(table)
                                   : "keys are written table.key with the tables " + table_list() +
                                         "; see configs/README.md");
  }
  std::optional<toml::table> parsed;
  if (auto st = detail::check_toml_depth(raw, where.file, detail::max_toml_depth); !st) {
    error e = st.err();
    e.where = where;
    return e;
  }
  try {
    toml::table t = toml::parse("v = " + raw, "--set"sv);
    if (t.size() == 1 && t.contains("v")) parsed = std::move(t);
  } catch (const toml::parse_error&) {
    // not a TOML value: a bare word, taken as a string below
  }
  const bool wants_text = spec->kind == value_kind::string || spec->kind == value_kind::choice;
  const bool wants_list = spec->kind == value_kind::list || spec->kind == value_kind::int_list;
  if (!parsed || (wants_text && !parsed->get("v")->is_string()) ||
      (wants_list && !parsed->get("v")->is_string() && !parsed->get("v")->is_array())) {
    parsed.emplace();
    parsed->insert("v", raw);
  }
  store.push_back(std::move(*parsed));
  return setting{spec, store.back().get("v"), where};
}

// One entry of the file in document order: either a setting or the error it causes.
struct file_entry {
  toml::source_position pos;
  std::optional<setting> value;
  std::optional<error> problem;
};

std::vector<file_entry> walk(const toml::table& root, const std::string& file) {
  std::vector<file_entry> out;
  const auto& tables = detail::table_names();
  for (auto&& [tkey, tnode] : root) {
    const std::string tname(tkey.str());
    const location where = at(file, tname, tkey.source());
    const bool known = std::find(tables.begin(), tables.end(), tname) != tables.end();
    if (!known) {
      out.push_back({tkey.source().begin, {},
                     tnode.is_table()
                         ? unknown_table(where, tname)
                         : unknown_key(where, tname,
                                       "every key belongs to a table (" + table_list() +
                                           "); see configs/README.md")});
      continue;
    }
    if (!tnode.is_table()) {
      out.push_back({tkey.source().begin, {},
                     located(where, "expected a table [" + tname + "], got " + describe(tnode),
                             "write the keys under a [" + tname + "] header")});
      continue;
    }
    for (auto&& [key, node] : *tnode.as_table()) {
      const std::string dotted = tname + "." + std::string(key.str());
      const key_spec* spec = detail::find_key(dotted);
      if (!spec) {
        out.push_back({key.source().begin, {},
                       unknown_key(at(file, dotted, key.source()), dotted,
                                   "valid keys in [" + tname + "]: " + keys_of(tname))});
        continue;
      }
      out.push_back({key.source().begin, setting{spec, &node, at(file, dotted, node.source())}, {}});
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const file_entry& a, const file_entry& b) {
    return a.pos.line != b.pos.line ? a.pos.line < b.pos.line : a.pos.column < b.pos.column;
  });
  return out;
}

// Divisors of n nearest below and above v ("2 or 5"), for hints about divisibility.
std::string nearby_divisors(std::int64_t n, std::int64_t v) {
  std::int64_t lo = 0, hi = 0;
  for (std::int64_t d = std::min(v, n); d >= 1 && !lo; --d)
    if (n % d == 0) lo = d;
  for (std::int64_t d = v; d <= n && !hi; ++d)
    if (n % d == 0) hi = d;
  if (lo && hi && lo != hi) return fmt::format("{} or {}", lo, hi);
  return std::to_string(lo ? lo : hi);
}

// Multiples of m nearest below and above v ("128 or 132").
std::string nearby_multiples(std::int64_t m, std::int64_t v) {
  const std::int64_t lo = v / m * m, hi = lo + m;
  return lo > 0 ? fmt::format("{} or {}", lo, hi) : std::to_string(hi);
}

std::string int_list_text(const std::vector<int>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// `total` layers over `chunks` chunks as evenly as they go (the first chunks one more).
std::vector<int> balanced(int total, int chunks) {
  std::vector<int> out(static_cast<std::size_t>(chunks), total / chunks);
  for (int i = 0; i < total % chunks; ++i) ++out[static_cast<std::size_t>(i)];
  return out;
}

// How the layers split into model chunks: parallel.stage_layers, the first/last offsets, or even.
status check_stage_split(const config& c) {
  const parallel_config& p = c.parallel;
  const int L = c.model.num_layers, chunks = p.pipeline_stage * p.virtual_pipeline;
  const std::string count = fmt::format("pipeline_stage {} x virtual_pipeline {} = {} model chunks",
                                        p.pipeline_stage, p.virtual_pipeline, chunks);
  if (!p.stage_layers.empty()) {
    if (p.first_stage_layers != 0 || p.last_stage_layers != 0)
      return config_error(
          c, p.first_stage_layers != 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers",
          "parallel.stage_layers and first_stage_layers / last_stage_layers are both set",
          "stage_layers names every chunk's layers already: keep it and set the offsets to 0, or "
          "remove stage_layers");
    const auto n = static_cast<int>(p.stage_layers.size());
    if (n != chunks) {
      std::vector<int> fit = p.stage_layers;
      fit.resize(static_cast<std::size_t>(chunks), 1);
      return config_error(
          c, "parallel.stage_layers",
          fmt::format("stage_layers has {} entries, but {} need one each", n, count),
          chunks <= L ? fmt::format("list one layer count per chunk in model order, e.g. {}",
                                    int_list_text(balanced(L, chunks)))
                      : fmt::format("{} chunks cannot each hold one of {} layers: use fewer "
                                    "pipeline stages",
                                    chunks, L));
    }
    int sum = 0;
    for (int x : p.stage_layers) sum += x;
    if (sum != L) {
      std::vector<int> fixed = p.stage_layers;
      const int last = fixed.back() + (L - sum);
      std::string hint = fmt::format("the entries must sum to num_layers {}", L);
      if (last >= 1) {
        fixed.back() = last;
        hint += fmt::format(", e.g. {}", int_list_text(fixed));
      }
      if (chunks <= L)
        hint += fmt::format("{} {} (even)", last >= 1 ? " or" : ", e.g.",
                            int_list_text(balanced(L, chunks)));
      return config_error(c, "parallel.stage_layers",
                          fmt::format("stage_layers {} sum to {}, but model.num_layers is {}",
                                      int_list_text(p.stage_layers), sum, L),
                          hint);
    }
    return {};
  }
  const int first = p.first_stage_layers, last = p.last_stage_layers;
  if (first == 0 && last == 0) {
    if (L % chunks != 0)
      return config_error(
          c, "model.num_layers",
          fmt::format("num_layers {} is not divisible by pipeline_stage {} x virtual_pipeline {} = {}",
                      L, p.pipeline_stage, p.virtual_pipeline, chunks),
          fmt::format("an even split gives each chunk the same number of layers: use num_layers "
                      "= {}, or pipeline_stage x virtual_pipeline = {}; or split unevenly with "
                      "parallel.stage_layers (e.g. {}) or parallel.first_stage_layers / "
                      "last_stage_layers",
                      nearby_multiples(chunks, L), nearby_divisors(L, chunks),
                      chunks <= L ? int_list_text(balanced(L, chunks)) : std::string("[...]")));
    return {};
  }
  const char* key = first != 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers";
  if (chunks == 1)
    return config_error(c, key,
                        fmt::format("{} is set, but {}: one chunk holds every layer", key, count),
                        "the offsets move layers between the first and the last pipeline stage: "
                        "set pipeline_stage above 1, or remove the key");
  // The chunks that share what the offsets leave: those between, and an end whose offset is 0.
  const int middle = chunks - 2 + (first == 0) + (last == 0);
  const int rest = L - first - last;
  const bool ok = middle == 0 ? rest == 0 : rest >= middle && rest % middle == 0;
  if (ok) return {};
  // Nearby values of the key that was set (the first one when both are) that do split evenly.
  const int other = first != 0 ? last : first;
  std::vector<int> good;
  for (int v = 1; v < L; ++v) {
    const int r = L - v - other;
    if (middle == 0 ? r == 0 : r >= middle && r % middle == 0) good.push_back(v);
  }
  const int mine = first != 0 ? first : last;
  int lo = 0, hi = 0;
  for (int v : good) {
    if (v <= mine) lo = v;
    if (v >= mine && !hi) hi = v;
  }
  std::string values = lo && hi && lo != hi ? fmt::format("{} or {}", lo, hi)
                       : lo || hi           ? std::to_string(lo ? lo : hi)
                                            : std::string();
  const std::string what =
      middle == 0 ? fmt::format("first_stage_layers {} + last_stage_layers {} = {}, but the two "
                                "chunks must hold num_layers {}",
                                first, last, first + last, L)
                  : fmt::format("num_layers {} - first_stage_layers {} - last_stage_layers {} = "
                                "{} layers do not split evenly over the other {} chunk(s) of {}",
                                L, first, last, rest, middle, count);
  return config_error(c, key, what,
                      (values.empty() ? std::string("no value of ") + key + " fits"
                                      : fmt::format("use {} = {}", key, values)) +
                          fmt::format("; or list every chunk with parallel.stage_layers (e.g. {})",
                                      chunks <= L ? int_list_text(balanced(L, chunks))
                                                  : std::string("[...]")));
}

// recompute.layers / recompute.layer_list: which layers recompute.mode applies to.
status check_recompute_layers(const config& c) {
  const recompute_config& r = c.recompute;
  const int L = c.model.num_layers;
  const char* key = r.layers != 0 ? "recompute.layers" : "recompute.layer_list";
  if (r.layers == 0 && r.layer_list.empty()) return {};
  if (r.mode == recompute_mode::none)
    return config_error(c, key, std::string(key) + " is set while recompute.mode = \"none\", "
                                "where no layer recomputes",
                        "set recompute.mode = \"full\" or \"selective\", or remove the key");
  if (r.layers != 0 && !r.layer_list.empty())
    return config_error(c, "recompute.layer_list",
                        "recompute.layers and recompute.layer_list are both set",
                        "choose the layers either by count per chunk (layers) or by index "
                        "(layer_list), not both");
  if (r.layers != 0) {
    int most = 0;
    for (int n : chunk_layers(c)) most = std::max(most, n);
    if (r.layers > most)
      return config_error(c, "recompute.layers",
                          fmt::format("recompute.layers {} is more than the {} layers of the "
                                      "largest model chunk",
                                      r.layers, most),
                          fmt::format("use 1..{} (the first N layers of each chunk recompute); "
                                      "0 or {} recomputes every layer",
                                      most, most));
    return {};
  }
  std::vector<bool> seen(static_cast<std::size_t>(L), false);
  for (std::size_t i = 0; i < r.layer_list.size(); ++i) {
    const int l = r.layer_list[i];
    if (l >= L)
      return config_error(c, "recompute.layer_list",
                          fmt::format("item {} of recompute.layer_list, {}, is not a layer of the "
                                      "{}-layer model",
                                      i, l, L),
                          fmt::format("layer indices run from 0 to num_layers - 1 = {}", L - 1));
    if (seen[static_cast<std::size_t>(l)])
      return config_error(c, "recompute.layer_list",
                          fmt::format("layer {} is listed twice in recompute.layer_list", l),
                          "list each layer once");
    seen[static_cast<std::size_t>(l)] = true;
  }
  return {};
}

// recompute.keep_gelu: GPT-2's, at most every layer.
status check_keep_gelu(const config& c) {
  const int n = c.recompute.keep_gelu;
  if (n == 0) return {};
  if (c.model.arch != arch_kind::gpt2)
    return config_error(c, "recompute.keep_gelu",
                        "recompute.keep_gelu is set for a LLaMA model, which has no GELU",
                        "LLaMA keeps its SwiGLU output in every layer already: remove the key");
  if (n > c.model.num_layers)
    return config_error(c, "recompute.keep_gelu",
                        fmt::format("recompute.keep_gelu {} is more than the model's {} layers", n,
                                    c.model.num_layers),
                        fmt::format("use 1..{} (the last N layers keep their GELU output)",
                                    c.model.num_layers));
  return {};
}

// The [lora] table: names checked against the family's modules, defaults filled in.
status check_lora(config& c) {
  lora_config& l = c.model.lora;
  const std::string arch = c.model.arch == arch_kind::gpt2 ? "gpt2" : "llama";
  // A resolved config (to_toml) writes every key, so rank 0 comes with alpha 0 and no targets.
  if (l.rank == 0 && (l.alpha != 0 || !l.targets.empty())) {
    const char* k = l.alpha != 0 ? "lora.alpha" : "lora.targets";
    return config_error(c, k, std::string(k) + " is set but lora.rank is 0: there are no adapters",
                        "set lora.rank (e.g. 8) to add adapters, or remove the key");
  }
  if (!l.freeze.empty() && l.rank > 0)
    return config_error(c, "lora.freeze",
                        "lora.freeze is set together with lora.rank: with adapters every base "
                        "weight is frozen already",
                        "to train base modules beside the adapters list them in lora.trainable; "
                        "lora.freeze is for full fine-tuning of all but the named modules");
  if (!l.freeze.empty() && !l.trainable.empty())
    return config_error(c, "lora.freeze",
                        "lora.freeze and lora.trainable are both set",
                        "name either the modules that train (lora.trainable) or those that do "
                        "not (lora.freeze)");
  const auto check_names = [&](const char* key, const std::vector<std::string>& names,
                               const std::vector<std::string>& valid) -> status {
    for (const auto& n : names)
      if (std::find(valid.begin(), valid.end(), n) == valid.end()) {
        const std::string guess = detail::nearest(n, valid);
        return config_error(c, key,
                            fmt::format("'{}' is not a {} module{}", n, arch,
                                        guess.empty() ? "" : "; did you mean '" + guess + "'?"),
                            fmt::format("{} names one of: {}", key, join(valid, ", ")));
      }
    return {};
  };
  if (auto st = check_names("lora.targets", l.targets, lora_target_names(c.model.arch)); !st) return st;
  if (auto st = check_names("lora.trainable", l.trainable, lora_module_names(c.model.arch)); !st)
    return st;
  if (auto st = check_names("lora.freeze", l.freeze, lora_module_names(c.model.arch)); !st) return st;
  if (l.rank > 0) {
    // PEFT's defaults for the two families; alpha = rank scales the adapters by 1.
    if (l.targets.empty())
      l.targets = c.model.arch == arch_kind::gpt2 ? std::vector<std::string>{"c_attn"}
                                                   : std::vector<std::string>{"q_proj", "v_proj"};
    if (l.alpha == 0) l.alpha = l.rank;
  }
  if (!l.freeze.empty()) {
    // Freezing every module leaves nothing to train.
    std::vector<std::string> left;
    for (const auto& m : lora_module_names(c.model.arch))
      if (m.find('.') == std::string::npos && m != "c_proj" &&
          std::find(l.freeze.begin(), l.freeze.end(), m) == l.freeze.end())
        left.push_back(m);
    const bool both_proj = std::find(l.freeze.begin(), l.freeze.end(), "c_proj") != l.freeze.end() ||
                           (std::find(l.freeze.begin(), l.freeze.end(), "attn.c_proj") != l.freeze.end() &&
                            std::find(l.freeze.begin(), l.freeze.end(), "mlp.c_proj") != l.freeze.end());
    if (left.empty() && (c.model.arch != arch_kind::gpt2 || both_proj))
      return config_error(c, "lora.freeze", "lora.freeze names every module: nothing would train",
                          "leave at least one module out of lora.freeze");
  }
  return {};
}

// Whether tensor parallelism of `tp` ranks splits model `m` (docs/model.md, "Tensor and sequence
// parallel"): query heads and the feed-forward width evenly; key/value heads evenly, or, when
// there are fewer of them than ranks, replicated so that each rank holds the one its query heads
// read (tp a multiple of num_kv_heads). hidden_size = num_heads x head_dim then splits too; the
// vocabulary is padded to a multiple of tp, so it need not divide.
bool tp_splits(const model_config& m, int tp) {
  const int kv = m.kv_heads();
  return m.num_heads % tp == 0 && m.hidden_size % tp == 0 && m.ffn_size() % tp == 0 &&
         (kv % tp == 0 || (kv < tp && tp % kv == 0));
}

// The model_parallel values nearest to `tp` (below and above) that split `m`.
std::string nearby_tp(const model_config& m, int tp) {
  int lo = 0, hi = 0;
  for (int t = tp - 1; t >= 1 && !lo; --t)
    if (tp_splits(m, t)) lo = t;
  for (int t = tp + 1; t <= m.num_heads && !hi; ++t)
    if (tp_splits(m, t)) hi = t;
  if (lo && hi) return fmt::format("{} or {}", lo, hi);
  return std::to_string(lo ? lo : hi);
}

status check_tensor_parallel(const config& c) {
  const model_config& m = c.model;
  const parallel_config& p = c.parallel;
  const int tp = p.model_parallel, kv = m.kv_heads();
  const std::string valid = fmt::format("model_parallel values that split this model near {}: {}",
                                        tp, nearby_tp(m, tp));
  const std::pair<const char*, int> split_by_tp[] = {{"num_heads", m.num_heads},
                                                      {"hidden_size", m.hidden_size},
                                                      {"ffn_hidden_size", m.ffn_hidden_size}};
  for (const auto& [name, value] : split_by_tp)
    if (value % tp != 0)
      return config_error(c, "parallel.model_parallel",
                          fmt::format("model_parallel {} does not divide {} {}", tp, name, value),
                          fmt::format("tensor parallelism splits heads and the feed-forward layer "
                                      "evenly across ranks: {}",
                                      valid));
  if (kv % tp != 0 && !(kv < tp && tp % kv == 0))
    return config_error(
        c, "parallel.model_parallel",
        fmt::format("model_parallel {} neither divides num_kv_heads {} nor is a multiple of it", tp,
                    kv),
        fmt::format("key/value heads are split across ranks when num_kv_heads >= model_parallel "
                    "and replicated when model_parallel is a multiple of num_kv_heads: {}",
                    valid));
  if (tp > 1 && m.lora.rank > 0)
    return config_error(c, "lora.rank",
                        fmt::format("LoRA adapters (lora.rank {}) do not run with tensor parallel "
                                    "(parallel.model_parallel {})",
                                    m.lora.rank, tp),
                        "fine-tune with adapters at parallel.model_parallel = 1, or train in full "
                        "(remove lora.rank)");
  if (tp > 1 && c.precision.compute != precision_kind::fp32)
    return config_error(c, "precision.compute",
                        fmt::format("parallel.model_parallel = {} sums its partial results in "
                                    "fp32 only",
                                    tp),
                        "set precision.compute = \"fp32\", or set parallel.model_parallel = 1 "
                        "(remove parallel.sequence_parallel)");
  if (p.sequence_parallel && tp == 1)
    return config_error(c, "parallel.sequence_parallel",
                        "sequence_parallel = true needs model_parallel > 1: it splits the tokens "
                        "of the norms and residuals across the tensor-parallel ranks",
                        fmt::format("set parallel.model_parallel to {} (or another value that "
                                    "splits the model), or remove parallel.sequence_parallel",
                                    nearby_tp(m, 1)));
  if (p.sequence_parallel && m.seq_length % tp != 0)
    return config_error(
        c, "model.seq_length",
        fmt::format("seq_length {} is not divisible by model_parallel {} with sequence_parallel = "
                    "true",
                    m.seq_length, tp),
        fmt::format("each rank holds seq_length / model_parallel tokens of every sequence: use "
                    "seq_length = {}, or set parallel.sequence_parallel = false",
                    nearby_multiples(tp, m.seq_length)));
  return {};
}

status resolve_and_check(config& c) {
  model_config& m = c.model;
  const parallel_config& p = c.parallel;
  const bool gpt2 = m.arch == arch_kind::gpt2;
  const auto set = [&](const char* key) { return c.origins.count(key) > 0; };

  if (m.num_kv_heads == 0) m.num_kv_heads = m.num_heads;
  if (m.hidden_size % m.num_heads != 0)
    return config_error(
        c, "model.hidden_size",
        fmt::format("hidden_size {} is not divisible by num_heads {}", m.hidden_size, m.num_heads),
        fmt::format("every head gets hidden_size / num_heads dimensions: use num_heads = {} or "
                    "hidden_size = {}",
                    nearby_divisors(m.hidden_size, m.num_heads),
                    nearby_multiples(m.num_heads, m.hidden_size)));
  if (m.num_heads % m.num_kv_heads != 0)
    return config_error(
        c, "model.num_kv_heads",
        fmt::format("num_heads {} is not divisible by num_kv_heads {}", m.num_heads, m.num_kv_heads),
        fmt::format("each key/value head serves the same number of query heads: use "
                    "num_kv_heads = {} (or 0 for one per query head)",
                    nearby_divisors(m.num_heads, m.num_kv_heads)));
  if (gpt2 && m.num_kv_heads != m.num_heads)
    return config_error(c, "model.num_kv_heads",
                        fmt::format("gpt2 has one key/value head per query head: num_kv_heads {} "
                                    "must equal num_heads {} (or be 0)",
                                    m.num_kv_heads, m.num_heads),
                        "grouped-query attention is part of arch = \"llama\"; for gpt2 remove "
                        "num_kv_heads");
  if (!gpt2 && m.head_dim() % 2 != 0)
    return config_error(c, "model.hidden_size",
                        fmt::format("head_dim = hidden_size / num_heads = {} / {} = {} is odd",
                                    m.hidden_size, m.num_heads, m.head_dim()),
                        "RoPE rotates pairs of dimensions, so llama needs an even head_dim");
  if (gpt2 && m.rope_scaling != rope_scaling_kind::none)
    return config_error(c, "model.rope_scaling",
                        "gpt2 has learned position embeddings, no rotary ones to scale",
                        "remove model.rope_scaling, or set arch = \"llama\"");
  if (m.rope_scaling == rope_scaling_kind::none)
    for (const auto& k : detail::key_specs())
      if (k.applies && !k.applies(c) && set(k.dotted().c_str()))
        return config_error(c, k.dotted(),
                            "set while model.rope_scaling = \"none\", where it has no effect",
                            "set model.rope_scaling = \"llama3\" or remove the key");
  if (m.rope_scaling == rope_scaling_kind::llama3 &&
      !(m.rope_high_freq_factor > m.rope_low_freq_factor))
    return config_error(c, set("model.rope_high_freq_factor") ? "model.rope_high_freq_factor"
                                                                : "model.rope_low_freq_factor",
                        fmt::format("rope_high_freq_factor {} must be above rope_low_freq_factor {}",
                                    m.rope_high_freq_factor, m.rope_low_freq_factor),
                        "llama3 scaling interpolates between the two wavelengths they define "
                        "(Llama 3.1 uses 1 and 4)");
  m.ffn_hidden_size = m.ffn_size();
  if (!set("model.tie_embeddings")) m.tie_embeddings = gpt2;
  if (auto st = check_lora(c); !st) return st;
  if (!set("precision.dynamic_loss_scale"))
    c.precision.dynamic_loss_scale = c.precision.compute == precision_kind::fp16;

  // The schedule runs micro_batch_num x gradient_accumulation_steps micro-batches per step; the
  // product must stay within what a schedule holds (schedules/schedule.hpp: 2^20).
  constexpr std::int64_t max_microbatches = 1 << 20;
  const std::int64_t microbatches =
      std::int64_t(p.micro_batch_num) * c.train.gradient_accumulation_steps;
  if (microbatches > max_microbatches)
    return config_error(
        c, set("train.gradient_accumulation_steps") ? "train.gradient_accumulation_steps"
                                                     : "parallel.micro_batch_num",
        fmt::format("micro_batch_num {} x gradient_accumulation_steps {} = {} micro-batches per "
                    "step, above the {} a schedule holds",
                    p.micro_batch_num, c.train.gradient_accumulation_steps, microbatches,
                    max_microbatches),
        "a larger global batch needs more data_parallel replicas, not more micro-batches");
  if (auto st = check_stage_split(c); !st) return st;
  if (auto st = check_recompute_layers(c); !st) return st;
  if (auto st = check_keep_gelu(c); !st) return st;
  if (auto st = check_tensor_parallel(c); !st) return st;

  if (c.precision.compute != precision_kind::fp32 && c.runtime.device == "cpu")
    return config_error(c, "precision.compute",
                        fmt::format("{} compute needs runtime.device = \"cuda\"",
                                    std::get<std::string>(detail::find_key("precision.compute")->get(c))),
                        "the CPU backend computes in fp32: set precision.compute = \"fp32\" or "
                        "runtime.device = \"cuda\"");
  if (c.model.attention_dropout > 0 && c.runtime.device == "cuda")
    return config_error(c, "model.attention_dropout",
                        "dropout of the attention probabilities is not implemented in the CUDA "
                        "attention kernels",
                        "set model.attention_dropout = 0 (model.hidden_dropout works on CUDA), or "
                        "runtime.device = \"cpu\"");
  if (c.optimizer.min_lr > c.optimizer.lr)
    return config_error(c, "optimizer.min_lr",
                        fmt::format("min_lr {} is above lr {}", detail::toml_literal(c.optimizer.min_lr),
                                    detail::toml_literal(c.optimizer.lr)),
                        "min_lr is the floor the cosine decay ends at; keep it at most lr");
  if (c.schedule.name.empty() && c.schedule.file.empty())
    return config_error(c, "schedule.name", "no schedule: name and file are both empty",
                        "name a built-in schedule such as \"1f1b\" or set schedule.file");
  if (!c.data.tokenizer.empty() && !c.data.tokenizer_dir.empty())
    return config_error(c, "data.tokenizer_dir",
                        "data.tokenizer and data.tokenizer_dir both name a tokenizer",
                        "keep data.tokenizer (a tokenizer.json or a folder); tokenizer_dir is its "
                        "older name");
  if (c.train.eval_interval > 0 && c.data.val.empty())
    return config_error(c, "train.eval_interval",
                        fmt::format("eval_interval {} needs a validation shard, but data.val is empty",
                                    c.train.eval_interval),
                        "set data.val, or eval_interval = 0");
  // Keys that exist for configs written for other engines but have no second behaviour here are
  // refused rather than silently ignored.
  if (!c.runtime.deterministic)
    return config_error(c, "runtime.deterministic",
                        "runtime.deterministic = false is not supported: every kernel and every "
                        "reduction order is deterministic, there is no other mode to switch to",
                        "remove the key or set runtime.deterministic = true");
  if (c.runtime.run_dir.empty())
    return config_error(c, "runtime.run_dir", "run_dir is empty",
                        "name the folder for metrics and checkpoints, e.g. \"runs/latest\"");
  if (!c.runtime.gemm_tune_file.empty() && c.runtime.device == "cpu")
    return config_error(c, "runtime.gemm_tune_file",
                        "a GEMM tuning file needs runtime.device = \"cuda\" (the CPU backend has "
                        "no cuBLASLt algorithms to choose)",
                        "remove runtime.gemm_tune_file, or set runtime.device = \"cuda\"");
  if (c.runtime.split_gpu && c.runtime.device == "cpu")
    return config_error(c, "runtime.split_gpu",
                        "split_gpu divides a GPU's SMs between the workers that share it; "
                        "runtime.device is \"cpu\"",
                        "remove runtime.split_gpu, or set runtime.device = \"cuda\"");
  if (c.runtime.forensics_loss_jump != 0 && c.runtime.forensics_loss_jump <= 1)
    return config_error(c, "runtime.forensics_loss_jump",
                        "a loss jump factor of " + std::to_string(c.runtime.forensics_loss_jump) +
                            " would call every step's loss a jump",
                        "use 0 (off) or a factor above 1, e.g. 3");
  if (c.runtime.forensics_loss_jump > 0 && c.runtime.forensics == "off")
    return config_error(c, "runtime.forensics_loss_jump",
                        "a loss jump is looked into only by step forensics, and "
                        "runtime.forensics is \"off\"",
                        "set runtime.forensics = \"stop\" or \"skip\", or remove "
                        "runtime.forensics_loss_jump");
  if (!c.runtime.fault_inject.empty()) {
    const std::string& f = c.runtime.fault_inject;
    const auto a = f.find(':'), b = a == std::string::npos ? a : f.find(':', a + 1);
    const auto digits = [&](std::size_t from, std::size_t to) {
      return to > from && std::all_of(f.begin() + from, f.begin() + to, ::isdigit);
    };
    if (b == std::string::npos || !digits(0, a) || !digits(a + 1, b) || b + 1 >= f.size())
      return config_error(c, "runtime.fault_inject", "'" + f + "' is not rank:step:instruction",
                          "e.g. \"1:3:1B2\" makes rank 1 fail at step 3 on instruction 1B2");
  }
  return {};
}

}  // namespace

const std::vector<std::string>& lora_target_names(arch_kind arch) {
  static const std::vector<std::string> gpt2{"c_attn", "c_proj", "attn.c_proj", "mlp.c_proj", "c_fc"};
  static const std::vector<std::string> llama{"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                              "gate_proj", "up_proj", "down_proj"};
  return arch == arch_kind::gpt2 ? gpt2 : llama;
}

const std::vector<std::string>& lora_module_names(arch_kind arch) {
  static const std::vector<std::string> gpt2{"wte",  "wpe",  "ln_1",       "c_attn",     "c_proj",
                                             "attn.c_proj", "mlp.c_proj", "ln_2", "c_fc",
                                             "ln_f", "lm_head"};
  static const std::vector<std::string> llama{
      "embed_tokens", "input_layernorm", "q_proj",    "k_proj",  "v_proj",    "o_proj",
      "post_attention_layernorm",        "gate_proj", "up_proj", "down_proj", "norm", "lm_head"};
  return arch == arch_kind::gpt2 ? gpt2 : llama;
}

result<config> parse_config(const std::string& text, const std::string& name,
                            const std::vector<std::string>& overrides) {
  if (text.size() > detail::max_config_bytes)
    return error::at_file(name,
                          "config text of " + std::to_string(text.size()) + " bytes; a config is at most " +
                              std::to_string(detail::max_config_bytes) + " bytes",
                          "a troupe config is a few kilobytes of TOML: is this the right file?");
  if (auto st = detail::check_toml_depth(text, name, detail::max_toml_depth); !st) return st.err();
  toml::table root;
  try {
    root = toml::parse(text, std::string_view(name));
  } catch (const toml::parse_error& e) {
    return error::at_key(name, "", static_cast<int>(e.source().begin.line),
                         static_cast<int>(e.source().begin.column),
                         "TOML syntax error: " + std::string(e.description()),
                         "see https://toml.io/en/v1.0.0; strings need quotes, tables are "
                         "written [name], keys key = value");
  }

  std::deque<toml::table> override_store;
  std::vector<setting> override_settings;
  for (const auto& o : overrides) {
    auto s = parse_override(o, override_store);
    if (!s) return s.err();
    override_settings.push_back(*s);
  }

  config c;
  c.source = name;
  for (const auto& entry : walk(root, name)) {
    if (entry.problem) return *entry.problem;
    const setting& s = *entry.value;
    // A value replaced on the command line is not checked: the override may be the fix.
    const bool replaced = std::any_of(override_settings.begin(), override_settings.end(),
                                      [&](const setting& o) { return o.spec == s.spec; });
    if (replaced) continue;
    if (auto st = apply(s, c); !st) return st.err();
  }
  for (const auto& s : override_settings)
    if (auto st = apply(s, c); !st) return st.err();
  if (auto st = resolve_and_check(c); !st) return st.err();
  return c;
}

result<config> load_config(const std::string& path, const std::vector<std::string>& overrides) {
  input_spec spec;
  spec.what = "config file";
  spec.max_bytes = detail::max_config_bytes;
  spec.hint = "pass a TOML run configuration such as configs/tiny.toml";
  auto text = read_input(path, spec);
  if (!text) return text.err();
  return parse_config(text.value(), path, overrides);
}

}  // namespace troupe::core
