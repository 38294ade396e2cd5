#include "core/error.hpp"

namespace troupe::core {

std::string error::to_string() const {
  std::string out;
  if (!where.file.empty()) {
    out += where.file;
    if (where.line > 0) {
      out += ':';
      out += std::to_string(where.line);
      if (where.column > 0) {
        out += ':';
        out += std::to_string(where.column);
      }
    }
    out += ": ";
  }
  if (where.rank >= 0) {
    out += "rank ";
    out += std::to_string(where.rank);
    out += ": ";
  }
  if (!where.key.empty()) out += where.key + ": ";
  out += message;
  if (!hint.empty()) out += "\n  hint: " + hint;
  return out;
}

}  // namespace troupe::core
