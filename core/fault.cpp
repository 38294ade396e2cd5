#include "core/fault.hpp"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace troupe::core {
namespace {

std::vector<std::string> split(const std::string& s, char sep = ':') {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) out.emplace_back();
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
                       "slow:RANK:FACTOR, stall:RANK:STEP, poison:STEP:SEQ[:LOSS], "
                       "kill:RANK:STEP[:ATTEMPT], or several "
                       "separated by ',' (one per attempt) (docs/faults.md)");
  };
  const auto f = split(text);
  fault_spec s;
  s.text = text;
  std::int64_t rank = 0, step = 0;
  if (f[0] == "drop" || f[0] == "nan" || f[0] == "stall") {
    if (f.size() != 3 || !whole(f[1], rank) || !whole(f[2], step))
      return bad("is not " + f[0] + ":RANK:STEP");
    s.kind = f[0] == "drop" ? fault_kind::drop : f[0] == "nan" ? fault_kind::nan : fault_kind::stall;
    s.rank = static_cast<int>(rank);
    s.step = step;
    return s;
  }
  if (f[0] == "kill") {
    std::int64_t attempt = 0;
    if ((f.size() != 3 && f.size() != 4) || !whole(f[1], rank) || !whole(f[2], step) ||
        (f.size() == 4 && !whole(f[3], attempt)))
      return bad("is not kill:RANK:STEP[:ATTEMPT] (ATTEMPT 0 for the first attempt, N for the one "
                 "after the N-th restart)");
    s.kind = fault_kind::kill;
    s.rank = static_cast<int>(rank);
    s.step = step;
    s.attempt = static_cast<int>(attempt);
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

result<std::vector<fault_spec>> parse_faults(const std::string& text, const std::string& source) {
  std::vector<fault_spec> out;
  if (text.empty()) return out;
  for (const auto& item : split(text, ',')) {
    auto f = parse_fault(item, source);
    if (!f) return f.err();
    for (const auto& earlier : out)
      if (earlier.attempt == f.value().attempt)
        return error::make(source + "='" + text + "' names two faults for attempt " +
                               std::to_string(f.value().attempt) + " (" + earlier.text + " and " +
                               item + ")",
                           "test only; at most one fault per attempt: kill:RANK:STEP:ATTEMPT fires "
                           "in attempt ATTEMPT, every other fault in attempt 0 (docs/faults.md)");
    out.push_back(f.value());
  }
  return out;
}

std::optional<fault_spec> fault_for_attempt(const std::vector<fault_spec>& faults, int attempt) {
  for (const auto& f : faults)
    if (f.attempt == attempt) return f;
  return std::nullopt;
}

result<std::vector<fault_spec>> fault_from_env() {
  const char* v = std::getenv("TROUPE_FAULT");
  return parse_faults(v ? v : "", "TROUPE_FAULT");
}

}  // namespace troupe::core
