#include "core/fault.hpp"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace troupe::core {
namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == ':') out.emplace_back();
    else out.back() += c;
  }
  return out;
}

/// A whole number of at most 9 digits.
bool whole(const std::string& s, std::int64_t& v) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  v = std::stoll(s);
  return true;
}

}  // namespace

result<fault_spec> parse_fault(const std::string& text, const std::string& source) {
  auto bad = [&](const std::string& why) {
    return error::make(source + "='" + text + "' " + why,
                       "test only; one of drop:RANK:STEP, enospc:STEP, nan:RANK:STEP, "
                       "slow:RANK:FACTOR, poison:STEP:SEQ[:LOSS] (docs/faults.md)");
  };
  const auto f = split(text);
  fault_spec s;
  s.text = text;
  std::int64_t rank = 0, step = 0;
  if (f[0] == "drop" || f[0] == "nan") {
    if (f.size() != 3 || !whole(f[1], rank) || !whole(f[2], step))
      return bad("is not " + f[0] + ":RANK:STEP");
    s.kind = f[0] == "drop" ? fault_kind::drop : fault_kind::nan;
    s.rank = static_cast<int>(rank);
    s.step = step;
    return s;
  }
  if (f[0] == "enospc") {
    if (f.size() != 2 || !whole(f[1], step) || step < 1)
      return bad("is not enospc:STEP (the step of a checkpoint, 1 or more)");
    s.kind = fault_kind::enospc;
    s.step = step;
    return s;
  }
  if (f[0] == "poison") {
    std::int64_t seq = 0;
    char* end = nullptr;
    if (f.size() == 4) s.loss = std::strtod(f[3].c_str(), &end);
    if ((f.size() != 3 && f.size() != 4) || !whole(f[1], step) || !whole(f[2], seq) ||
        (f.size() == 4 && (f[3].empty() || *end != '\0')))
      return bad("is not poison:STEP:SEQ[:LOSS] (SEQ a global sequence index within the step, "
                 "LOSS a number)");
    s.kind = fault_kind::poison;
    s.step = step;
    s.sequence = seq;
    return s;
  }
  if (f[0] == "slow") {
    char* end = nullptr;
    const double factor = f.size() == 3 ? std::strtod(f[2].c_str(), &end) : 0;
    if (f.size() != 3 || !whole(f[1], rank) || f[2].empty() || *end != '\0' ||
        !std::isfinite(factor) || factor < 1 || factor > 1000)
      return bad("is not slow:RANK:FACTOR (FACTOR a number in 1 .. 1000)");
    s.kind = fault_kind::slow;
    s.rank = static_cast<int>(rank);
    s.factor = factor;
    return s;
  }
  return bad("names no known fault '" + f[0] + "'");
}

result<std::optional<fault_spec>> fault_from_env() {
  const char* v = std::getenv("TROUPE_FAULT");
  if (!v || !*v) return std::optional<fault_spec>{};
  auto f = parse_fault(v, "TROUPE_FAULT");
  if (!f) return f.err();
  return std::optional<fault_spec>{f.value()};
}

}  // namespace troupe::core
