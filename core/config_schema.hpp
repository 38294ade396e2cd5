// The table of every config key: its type, allowed range or values, and how to read and write it
// in the structs of core/config.hpp. Parsing, printing (to_toml, config_entries) and the unknown-key
// hints all walk this one table, so a key added here is parsed, validated, printed and suggested
// everywhere at once. Private to core/ (the config_*.cpp files).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.hpp"

namespace troupe::core::detail {

// A list is a TOML array of strings (or, on the command line, one string of comma-separated
// items); its config_value is the items joined by commas. An int_list is the same with integers
// (each checked against [min_int, max_int]), e.g. parallel.stage_layers = [3, 5, 5, 3].
enum class value_kind { integer, floating, boolean, string, choice, list, int_list };

/// One key of the schema. Integers are checked against [min_int, max_int], floats against
/// [min_float, max_float] with either end open when its flag says so; choices must be one of
/// `choices`.
struct key_spec {
  std::string table;  // "model"
  std::string name;   // "num_layers"
  value_kind kind = value_kind::integer;
  std::int64_t min_int = 0;
  std::int64_t max_int = 0;
  double min_float = 0;
  double max_float = 0;
  bool min_open = false;
  bool max_open = false;
  std::vector<std::string> choices;
  std::string range_hint;  // said after an out-of-range value: what the range means
  std::function<void(config&, const config_value&)> set;
  std::function<config_value(const config&)> get;
  /// When set: the key means something only where this holds (e.g. the llama3 rope factors need
  /// model.rope_scaling = "llama3"); elsewhere setting it is an error and to_toml leaves it out.
  std::function<bool(const config&)> applies;

  std::string dotted() const { return table + "." + name; }
};

/// All keys, in documentation order (tables in the order of `table_names()`).
const std::vector<key_spec>& key_specs();
/// The tables, in documentation order.
const std::vector<std::string>& table_names();
/// The spec of a dotted key, or nullptr.
const key_spec* find_key(std::string_view dotted);

/// Optimal string alignment distance (edits, with a swap of neighbours counted as one).
int edit_distance(std::string_view a, std::string_view b);
/// The candidate closest to `name`, or "" when none is close enough to be a plausible typo.
std::string nearest(std::string_view name, const std::vector<std::string>& candidates);
/// The known dotted key a user most likely meant by the unknown `dotted` (a typo in the name, or
/// the right name in the wrong table), or "".
std::string nearest_key(std::string_view dotted);

/// toml++ 3.3 recurses once per level of nesting (each part of a dotted key or table header, each
/// array or inline table), so text nested deeply enough overflows the stack inside the parser. This
/// scan, run before the parser sees any text, counts an upper bound of that depth without
/// recursing and refuses text nested more than `max_depth` levels, naming `name`, line and column.
status check_toml_depth(std::string_view text, const std::string& name, int max_depth);
/// The nesting check_toml_depth allows for config text: a troupe config nests two levels
/// ([table] and key), so this leaves room for anything legitimate.
inline constexpr int max_toml_depth = 32;
/// Longest config text parse_config reads (a config file, a --set value, a manifest's config).
inline constexpr std::size_t max_config_bytes = std::size_t(1) << 22;

/// A list value's items (split at commas, blanks trimmed, empty items dropped) and back.
std::vector<std::string> split_list(std::string_view joined);
std::string join_list(const std::vector<std::string>& items);
/// A list value as a TOML array of strings (an int_list's: of integers).
std::string toml_list_literal(const config_value& v, bool integers = false);
/// An int_list value's items ("3,5,5,3" -> {3, 5, 5, 3}); items that are not integers are skipped
/// (apply() lets none through).
std::vector<int> split_int_list(std::string_view joined);
std::string join_int_list(const std::vector<int>& items);

/// The value as TOML writes it (strings quoted and escaped, floats in their shortest round-trip form).
std::string toml_literal(const config_value& v);

}  // namespace troupe::core::detail
