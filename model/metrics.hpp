// Per-step training metrics: the metrics.jsonl writer of a run directory and the human progress
// line. metrics.jsonl holds one JSON object per line; its floating-point values are fp32 numbers
// printed with 9 significant digits (%.9g), which is exactly enough for every float to read back
// to the same bits, so a run can be compared with another from its metrics file alone.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "core/error.hpp"
#include "core/files.hpp"

namespace troupe::model {

/// One step's record (the fields of a metrics.jsonl line).
struct step_metrics {
  int step = 0;                   // 0-based index of the optimizer step just taken
  float loss = 0;                 // mean token loss of the step's global batch
  float lr = 0;
  float grad_norm = 0;            // before clipping
  float tokens_per_s = 0;
  float elapsed_s = 0;            // since training (this invocation) started
  std::optional<float> val_loss;  // when validation ran after this step
  std::optional<float> loss_scale;  // dynamic loss scaling: the scale this step's loss used
  bool skipped = false;             // the update was skipped (non-finite gradients)
  float next_loss_scale = 0;        // the scale of the next step (progress line only)
};

/// {"step":..,"loss":..,"lr":..,"grad_norm":..,"tokens_per_s":..,"elapsed_s":..[,"val_loss":..]
///  [,"loss_scale":..,"skipped":true|false]}
std::string to_json_line(const step_metrics& m);
/// Parses a line written by to_json_line (extra keys are ignored).
core::result<step_metrics> parse_json_line(const std::string& line);

/// "step   12/300 | loss 7.1234 | lr 3.00e-04 | norm 1.234 | 1350 tok/s | 0:12 | ETA 4:48"
/// (plus "| val 6.98" when present, and "| skipped (overflow), loss scale → 32768" or
/// "| loss scale → 131072" when dynamic loss scaling skipped the step or changed the scale). `total_steps` is the step count of the whole schedule;
/// `remaining_s` < 0 hides the ETA.
std::string progress_line(const step_metrics& m, int total_steps, double remaining_s);

/// "1:02:03" or "4:05".
std::string format_duration(double seconds);

/// Appends lines to <run_dir>/metrics.jsonl, one flushed line per step.
class metrics_writer {
 public:
  /// Opens <run_dir>/metrics.jsonl. Lines of an earlier run with step >= first_step are dropped
  /// (a resumed run rewrites the steps it repeats); earlier ones are kept.
  static core::result<metrics_writer> open(const std::string& run_dir, int first_step);


  core::status write(const step_metrics& m);
  /// Writes one line that already holds a JSON object (a step_metrics line with extra fields).
  core::status write_line(const std::string& json);
  const std::string& path() const { return path_; }

 private:
  metrics_writer() = default;
  std::string path_;
  core::sealed_file f_;
};

}  // namespace troupe::model
