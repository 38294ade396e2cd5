// The resolved config as TOML: every key, in documentation order, so that a run directory records
// exactly what ran and parse_config reads it back to an equal config.
#include <string>

#include "core/config.hpp"
#include "core/config_schema.hpp"

namespace troupe::core {

std::string to_toml(const config& c) {
  std::string out = "# troupe run configuration, resolved: every key with the value the run used.\n";
  if (!c.source.empty()) out += "# Read from " + c.source + ".\n";
  std::string table;
  for (const auto& k : detail::key_specs()) {
    if (k.table != table) {
      table = k.table;
      out += "\n[" + table + "]\n";
    }
    if (k.applies && !k.applies(c)) continue;
    out += k.name + " = " +
           (k.kind == detail::value_kind::list       ? detail::toml_list_literal(k.get(c))
            : k.kind == detail::value_kind::int_list ? detail::toml_list_literal(k.get(c), true)
                                                     : detail::toml_literal(k.get(c))) +
           "\n";
  }
  return out;
}

}  // namespace troupe::core
