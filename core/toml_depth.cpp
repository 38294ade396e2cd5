// A pre-scan of TOML text that bounds how deeply it nests, without recursing (see
// config_schema.hpp for why). It is deliberately simple: it overestimates (a dot in a float value
// counts as a level, every '=' opens one), which is harmless at a limit far above what a troupe
// config uses, and it skips strings and comments exactly, so a long string of dots is not counted.
#include <string>
#include <vector>

#include "core/config_schema.hpp"

namespace troupe::core::detail {

status check_toml_depth(std::string_view text, const std::string& name, int max_depth) {
  int line = 1;
  std::size_t line_start = 0;
  int level = 0, header_level = 0;
  std::vector<int> open;  // the level before each unclosed '[' or '{' of a value
  bool line_begins = true;
  const std::size_t n = text.size();
  auto too_deep = [&](std::size_t at) -> status {
    return error::at_key(
        name, "", line, static_cast<int>(at - line_start) + 1,
        "keys, tables and values nest more than " + std::to_string(max_depth) +
            " levels deep here (a dotted key or [table.header] of many parts, or nested arrays "
            "and inline tables)",
        "a troupe config has [table] headers and plain keys (table.key = value); nothing in it "
        "nests deeper than two levels");
  };
  // Skips the string that starts at text[i] (a quote); returns the index after it, or n.
  auto skip_string = [&](std::size_t i) {
    const char q = text[i];
    const bool multi = i + 2 < n && text[i + 1] == q && text[i + 2] == q;
    std::size_t j = i + (multi ? 3 : 1);
    while (j < n) {
      const char c = text[j];
      if (c == '\\' && q == '"') {
        j += 2;
        continue;
      }
      if (c == '\n') {
        if (!multi) return j;  // an unterminated string: the parser reports it
        ++line;
        line_start = j + 1;
      }
      if (c == q) {
        if (!multi) return j + 1;
        if (j + 2 < n && text[j + 1] == q && text[j + 2] == q) {
          j += 3;
          while (j < n && text[j] == q) ++j;  // up to two quotes may end the content
          return j;
        }
      }
      ++j;
    }
    return n;
  };
  for (std::size_t i = 0; i < n;) {
    const char c = text[i];
    if (c == '#') {
      while (i < n && text[i] != '\n') ++i;
      continue;
    }
    if (c == '\n') {
      ++line;
      line_start = i + 1;
      if (open.empty()) {
        level = header_level;
        line_begins = true;
      }
      ++i;
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\r') {
      ++i;
      continue;
    }
    if (c == '"' || c == '\'') {
      line_begins = false;
      i = skip_string(i);
      continue;
    }
    if (line_begins && open.empty() && c == '[') {
      // A [table] or [[array.of.tables]] header: one level per part, one more for an array.
      int depth = 1;
      std::size_t j = i + 1;
      if (j < n && text[j] == '[') {
        ++depth;
        ++j;
      }
      while (j < n && text[j] != ']' && text[j] != '\n') {
        if (text[j] == '"' || text[j] == '\'') {
          j = skip_string(j);
          continue;
        }
        if (text[j] == '.' && ++depth > max_depth) return too_deep(j);
        ++j;
      }
      if (depth > max_depth) return too_deep(i);
      header_level = level = depth;
      line_begins = false;
      i = j;
      continue;
    }
    line_begins = false;
    switch (c) {
      case '.':
      case '=':
        if (++level > max_depth) return too_deep(i);
        break;
      case '[':
      case '{':
        open.push_back(level);
        if (++level > max_depth) return too_deep(i);
        break;
      case ']':
      case '}':
        if (!open.empty()) {
          level = open.back();
          open.pop_back();
        }
        break;
      case ',':
        if (!open.empty()) level = open.back() + 1;
        break;
      default:
        break;
    }
    ++i;
  }
  return {};
}

}  // namespace troupe::core::detail
