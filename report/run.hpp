// Reading a run directory for `troupe report` (docs/report.md): what the run wrote, as plain data.
//
// Contract:
//  - read_run never fails on the run's contents, only when the directory itself is missing. What
//    it cannot use — a line that is not JSON (truncated: the run may still be writing it), a line
//    whose step does not follow the previous one (another run writing the same file), a
//    config.toml that does not parse, a trace.json that does not parse — is skipped and described
//    in `notes`, with the file and line.
//  - rows are the accepted metrics.jsonl lines in file order, steps strictly increasing.
//    `time_s` joins invocations: a resumed run's elapsed_s starts again from 0, so each restart
//    adds the previous invocation's last elapsed_s (the restart is a mark).
//  - The trace is one step's events: the last step of metrics.jsonl (its events were flushed
//    before its metrics line), or the latest step trace.json holds before it. Only the end of
//    trace.json is read, so a long run's trace costs little.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "schedules/schedule.hpp"

namespace troupe::report {

/// One accepted metrics.jsonl line. Floats the line wrote as null (non-finite) are NaN.
struct step_row {
  int line = 0;          // 1-based line number in metrics.jsonl
  int step = 0;          // 0-based index of the step just taken
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, elapsed_s = 0;
  double time_s = 0;     // training time since the run's first invocation started
  std::optional<double> val_loss, loss_scale, bubble;
  std::optional<double> device_bubble;  // GPU pipeline runs: the bubble in GPU time
  bool skipped = false;  // dynamic loss scaling skipped the update
};

/// One stage's (dp, pp) per-step times over the run, from metrics.jsonl's "stages".
struct stage_samples {
  std::vector<double> busy_s, comm_s, wait_s, bubble;
  /// GPU runs: the stage's compute instructions on its stream, the rest of the step's device
  /// span, and their ratio (docs/runtime.md, "Busy and idle time on the device").
  std::vector<double> device_busy_s, device_idle_s, device_bubble;
  std::uint64_t peak_activation_bytes = 0;        // largest over the steps
  std::uint64_t peak_device_bytes = 0;            // GPU runs only
  std::uint64_t optimizer_peak_device_bytes = 0;  // GPU runs only
};

/// One event of trace.json.
struct trace_event {
  std::string name;  // "1F3", "2RECV_F3<-1", "wait 1B2", "STEP", ...
  std::string cat;   // compute | comm | wait
  double ts_us = 0, dur_us = 0;
  int dp = 0, pp = 0;
};

/// Something that happened at a point of the run, drawn as a mark on the time axis.
struct mark {
  std::string kind;   // checkpoint | restart | fault | skipped
  int step = 0;       // steps done when it happened (a checkpoint of step_000020: 20)
  std::string label;
};

/// Everything the report draws of one run directory.
struct run_data {
  std::string dir;                   // as given
  std::string name;                  // the directory's last component
  std::optional<core::config> cfg;   // config.toml, when present and valid
  std::vector<step_row> rows;
  std::map<std::pair<int, int>, stage_samples> stages;  // (pp, dp)
  int trace_step = -1;               // the step `trace` holds (-1: none)
  std::vector<trace_event> trace;
  std::vector<mark> marks;           // in no particular order
  /// GPU pipeline runs: each chunk's F, B, I and W in ms, the medians of metrics.jsonl's
  /// `device_costs` over the steps after the first two (read_chunk_costs); empty without them.
  std::vector<schedules::chunk_cost> chunk_costs;
  std::vector<std::string> notes;    // what was skipped or missing, and why
};

/// Each chunk's measured costs in a metrics.jsonl (`device_costs`, one object per step): the
/// median of each kind over the steps after the first two (all of them when there are two or
/// fewer); B from I + W, or I and W as halves of B, where a run measured only one. Errors name the
/// file and why (no such line, a line that is not JSON, a chunk without a forward or backward).
core::result<std::vector<schedules::chunk_cost>> read_chunk_costs(const std::string& metrics_path);

/// Reads `dir`. Errors only when `dir` is not a directory.
core::result<run_data> read_run(const std::string& dir);

/// The events of the last step in `path` (a Chrome trace written one event per line, as the
/// coordinator writes trace.json) whose step is <= `max_step`: (step, events), step -1 when
/// there is none. Notes describe what could not be read.
std::pair<int, std::vector<trace_event>> read_trace_tail(const std::string& path, int max_step,
                                                         std::vector<std::string>& notes);

}  // namespace troupe::report
