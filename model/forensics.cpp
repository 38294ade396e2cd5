#include "model/forensics.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kernels/message_hash.hpp"

namespace troupe::model {

namespace {

std::string number(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

/// A JSON value for x: a number, or the string "NaN" / "inf" (JSON has no such numbers).
nlohmann::json json_number(double x) {
  if (std::isfinite(x)) return x;
  return number(x);
}

}  // namespace

forensics_mode forensics_of(const core::runtime_config& r) {
  if (r.forensics == "stop") return forensics_mode::stop;
  if (r.forensics == "skip") return forensics_mode::skip;
  return forensics_mode::off;
}

void loss_history::accept(double loss) {
  if (!std::isfinite(loss)) return;
  recent_.push_back(loss);
  while (static_cast<int>(recent_.size()) > window) recent_.pop_front();
}

std::optional<double> loss_history::reference() const {
  if (static_cast<int>(recent_.size()) < min_steps) return std::nullopt;
  std::vector<double> v(recent_.begin(), recent_.end());
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

bool step_fingerprint::same_bits(const step_fingerprint& o) const {
  return losses.size() == o.losses.size() && grads == o.grads &&
         (losses.empty() ||
          std::memcmp(losses.data(), o.losses.data(), losses.size() * sizeof(double)) == 0);
}

std::string step_fingerprint::text() const {
  const std::uint64_t l = kernels::message_hash(losses.data(), losses.size() * sizeof(double));
  const std::uint64_t g = kernels::message_hash(grads.data(), grads.size() * sizeof(std::uint64_t));
  char buf[96];
  std::snprintf(buf, sizeof buf, "loss sums %016llx, gradient %016llx",
                static_cast<unsigned long long>(l), static_cast<unsigned long long>(g));
  return buf;
}

std::string suspicion(const core::runtime_config& r, std::int64_t step,
                      const std::vector<double>& mb_losses, int micro_batches, double loss,
                      const std::string& grad_note, const loss_history& history) {
  const std::string at = " at step " + std::to_string(step);
  for (std::size_t g = 0; g < mb_losses.size(); ++g)
    if (!std::isfinite(mb_losses[g]))
      return "the loss is " + number(mb_losses[g]) + at + ", micro-batch " +
             std::to_string(g % static_cast<std::size_t>(micro_batches)) + " (replica " +
             std::to_string(g / static_cast<std::size_t>(micro_batches)) + ")";
  if (!grad_note.empty()) return "the gradient is not finite" + at + grad_note;
  const auto ref = history.reference();
  if (r.forensics_loss_jump > 0 && ref && loss > r.forensics_loss_jump * *ref)
    return "the loss " + number(loss) + at + " is " + number(loss / *ref) + "x the median " +
           number(*ref) + " of the last " + std::to_string(loss_history::window) +
           " steps (runtime.forensics_loss_jump = " + number(r.forensics_loss_jump) + ")";
  return "";
}

std::vector<double> sequence_loss_sums(kernels::backend& be, const core::tensor& rows, int B) {
  const core::tensor host = be.to_host(rows);
  const std::int64_t T = host.numel() / B;
  std::vector<double> out(static_cast<std::size_t>(B), 0.0);
  const float* p = host.data<float>();
  for (int i = 0; i < B; ++i)
    for (std::int64_t t = 0; t < T; ++t) out[static_cast<std::size_t>(i)] += p[i * T + t];
  return out;
}

std::string name_sequences(const loader* data, std::int64_t step,
                           const std::vector<double>& seq_losses, int micro_batch_size,
                           int micro_batches, double loss_jump, std::optional<double> reference,
                           std::string& json) {
  const std::int64_t B = micro_batch_size;
  // Each sequence's mean loss over its trained targets.
  std::vector<double> mean(seq_losses.size());
  for (std::size_t k = 0; k < seq_losses.size(); ++k) {
    std::int64_t trained = data ? data->options().seq_length : 1;
    if (data && data->masked()) {
      const std::int64_t M = data->options().micro_batches;
      const std::int64_t g = static_cast<std::int64_t>(k) / B;
      const batch b = data->cut(static_cast<std::uint64_t>(step), static_cast<int>(g / M),
                                static_cast<int>(g % M));
      const std::int64_t T = b.seq_length, i = static_cast<std::int64_t>(k) % B;
      trained = 0;
      for (std::int64_t t = 0; t < T; ++t) trained += b.targets.data<std::int32_t>()[i * T + t] >= 0;
      trained = std::max<std::int64_t>(trained, 1);
    }
    mean[k] = seq_losses[k] / static_cast<double>(trained);
  }
  std::vector<std::size_t> bad;
  for (std::size_t k = 0; k < mean.size(); ++k)
    if (!std::isfinite(mean[k])) bad.push_back(k);
  if (bad.empty() && reference && loss_jump > 0)
    for (std::size_t k = 0; k < mean.size(); ++k)
      if (mean[k] > loss_jump * *reference) bad.push_back(k);
  if (bad.empty() && !mean.empty())
    bad.push_back(static_cast<std::size_t>(std::max_element(mean.begin(), mean.end()) - mean.begin()));
  nlohmann::json list = nlohmann::json::array();
  std::string text;
  constexpr std::size_t shown = 8;
  for (std::size_t n = 0; n < bad.size(); ++n) {
    const std::size_t k = bad[n];
    const std::int64_t g = static_cast<std::int64_t>(k) / B;
    const int replica = static_cast<int>(g / micro_batches), mb = static_cast<int>(g % micro_batches);
    nlohmann::json e = {{"sequence", k}, {"replica", replica}, {"micro_batch", mb},
                        {"loss", json_number(mean[k])}};
    std::string line = "micro-batch " + std::to_string(mb) + " of replica " +
                       std::to_string(replica) + ", global sequence " + std::to_string(k) +
                       " (row " + std::to_string(static_cast<std::int64_t>(k) % B) +
                       " of the micro-batch): mean loss " + number(mean[k]);
    if (data) {
      const loader::position p = data->position_of(static_cast<std::uint64_t>(step), k);
      e["shard"] = p.path;
      e[p.row ? "row" : "offset"] = p.offset;
      line += ", from " + p.path + (p.row ? " row " : " token offset ") + std::to_string(p.offset);
    }
    list.push_back(std::move(e));
    if (n < shown) text += "\n    " + line;
  }
  if (bad.size() > shown) text += "\n    and " + std::to_string(bad.size() - shown) + " more";
  json = list.dump();
  return text;
}

std::string deterministic_text(std::int64_t step, const std::string& why,
                               const step_fingerprint& print, const std::string& names) {
  return "step forensics: step " + std::to_string(step) + " is deterministic: " + why +
         ", and executed again from the state before it the step gave the same bits (" +
         print.text() + "); the sequences:" + names;
}

std::string transient_text(std::int64_t step, const std::string& why,
                           const step_fingerprint& before, const step_fingerprint& again,
                           const std::string& still) {
  return "step forensics: step " + std::to_string(step) + " is transient: " + why +
         ", but executed again from the state before it the step gave other bits (" +
         before.text() + ", then " + again.text() + ")" +
         (still.empty() ? "; the re-execution's result stands" : "; and it is still suspicious: " + still);
}

core::error recurring_error(std::int64_t step, int executions, const std::string& why) {
  return core::error::make(
      "step forensics: step " + std::to_string(step) + " gave other bits in each of its " +
          std::to_string(executions) + " executions and is still suspicious: " + why +
          "; the parameters were not updated",
      "a fault that keeps recurring (a failing device or host memory, a nondeterministic "
      "kernel): check the hardware; resume from the last checkpoint with --resume");
}

std::string forensics_field(std::int64_t step, const std::string& why, const std::string& verdict,
                            const std::string& action, int executions,
                            const step_fingerprint& first, const step_fingerprint& again,
                            const std::string& sequences_json) {
  nlohmann::json f = {{"step", step},           {"why", why},
                      {"verdict", verdict},     {"action", action},
                      {"executions", executions}, {"first", first.text()},
                      {"again", again.text()}};
  if (!sequences_json.empty()) f["sequences"] = nlohmann::json::parse(sequences_json);
  return "\"forensics\":" + f.dump();
}

}  // namespace troupe::model
