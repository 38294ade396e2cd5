// Step forensics (runtime.forensics; docs/faults.md, "Step forensics"): the policy both training
// loops share (docs/design.md, "one policy, one place"). A step is suspicious when a micro-batch's
// loss or the gradient is not finite, or when its loss is above runtime.forensics_loss_jump × the
// median of the last loss_history::window applied steps. A suspicious step is executed again from
// the state before it (the parameters and optimizer state it started from, its data cut again by
// the loader's pure function of seed, step and sequence) and the two executions' fingerprints are
// compared bit for bit:
//
//  - the same bits: the step is deterministic — its data makes it so. The micro-batches and
//    sequences whose loss is not finite (or, for a loss jump, above the factor × the reference)
//    are named with their positions in the token shards, and the step is stopped or skipped as
//    runtime.forensics says;
//  - other bits: a transient fault (hardware, a nondeterministic kernel). The re-execution's
//    result stands in for the first one's; when it is itself suspicious the step runs once more,
//    up to max_executions in all.
//
// The fingerprint is every micro-batch's loss sum (double bits) and a hash of the gradient: the
// message hash (kernels/message_hash.hpp) of each optimizer shard's summed gradient slice in the
// actor runtime, of each chunk's gradient buffer in the single-rank loop. Nothing here knows CAF.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "model/loader.hpp"

namespace troupe::model {

/// What runtime.forensics says.
enum class forensics_mode { off, stop, skip };
forensics_mode forensics_of(const core::runtime_config& r);

/// Executions of one step at most (the first and its re-executions) before a step whose
/// executions keep differing stops the job.
inline constexpr int max_executions = 3;

/// Recent losses of applied steps: the reference a loss jump is measured against.
class loss_history {
 public:
  static constexpr int window = 10;    // the median of this many last steps
  static constexpr int min_steps = 3;  // fewer: no reference yet
  void accept(double loss);
  /// The median of the last `window` accepted losses; none before min_steps were accepted.
  std::optional<double> reference() const;

 private:
  std::deque<double> recent_;
};

/// What one execution of a step computed, as forensics compares it.
struct step_fingerprint {
  std::vector<double> losses;        // loss sums per global micro-batch (replica-major)
  std::vector<std::uint64_t> grads;  // gradient hashes, in a fixed order
  /// Bit-for-bit equality (NaN equals the same NaN).
  bool same_bits(const step_fingerprint& o) const;
  /// "loss sums 0x…, gradient 0x…": a digest of each part, for messages and metrics.
  std::string text() const;
};

/// Why step `step` is suspicious, or "" when it is not. `mb_losses`: loss sums per global
/// micro-batch; `micro_batches`: per replica (to name replica and micro-batch); `loss`: the step's
/// mean loss; `grad_note`: "" when the gradient is finite, else what is known of it.
std::string suspicion(const core::runtime_config& r, std::int64_t step,
                      const std::vector<double>& mb_losses, int micro_batches, double loss,
                      const std::string& grad_note, const loss_history& history);

/// Loss sums of each of the B sequences in per-row losses `rows` (fp32 [B*T] on `be`).
std::vector<double> sequence_loss_sums(kernels::backend& be, const core::tensor& rows, int B);

/// The sequences of a deterministic bad step: those whose loss is not finite, or, when none is
/// and a reference is known, whose mean loss is above loss_jump × the reference (the worst one
/// when none is). `seq_losses`: loss sums per global sequence of the step, in the loader's
/// numbering. Returns one line per sequence (at most 8, then a count), each naming the replica,
/// micro-batch, global sequence index, its loss and its position in the shards, and fills `json`
/// with the same as a JSON array. `data` null: positions are not known.
std::string name_sequences(const loader* data, std::int64_t step,
                           const std::vector<double>& seq_losses, int micro_batch_size,
                           int micro_batches, double loss_jump, std::optional<double> reference,
                           std::string& json);

/// What the log and the error say (both loops say the same). `names`: name_sequences' lines.
std::string deterministic_text(std::int64_t step, const std::string& why,
                               const step_fingerprint& print, const std::string& names);
std::string transient_text(std::int64_t step, const std::string& why,
                           const step_fingerprint& before, const step_fingerprint& again,
                           const std::string& still);
/// The error that stops a step whose executions keep giving other bits (max_executions).
core::error recurring_error(std::int64_t step, int executions, const std::string& why);

/// The `"forensics":{…}` metrics field of one event (docs/faults.md).
std::string forensics_field(std::int64_t step, const std::string& why, const std::string& verdict,
                            const std::string& action, int executions,
                            const step_fingerprint& first, const step_fingerprint& again,
                            const std::string& sequences_json);

}  // namespace troupe::model
