// runtime.report_interval for `troupe train` and `troupe launch` (worker 0, which runs the
// coordinator): the training loop's step-end hook rewrites <run_dir>/report.html every N steps,
// and once more when the run is over, whether it succeeded or not. A page that cannot be written
// is a warning: it never stops a run.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "core/config.hpp"
#include "model/run_policy.hpp"
#include "report/live.hpp"

namespace troupe::cli {

inline void warn_report(const core::status& st) {
  if (!st) std::fprintf(stderr, "troupe: warning: %s\n", st.err().to_string().c_str());
}

/// The live report of `cfg`, fed by a step hook added to `hooks` (the loop's step-end hooks,
/// model::run_log::step_hook); null (and no hook) when runtime.report_interval is 0.
inline std::shared_ptr<report::live_report> attach_live_report(
    const core::config& cfg, std::vector<model::run_log::step_hook>& hooks) {
  if (cfg.runtime.report_interval <= 0) return nullptr;
  auto live = std::make_shared<report::live_report>(cfg.runtime.run_dir, cfg.runtime.report_interval);
  hooks.push_back([live](const model::step_metrics& m) {
    warn_report(live->step_end(m.step + 1));
    return core::status{};
  });
  return live;
}

/// The final page, after the run.
inline void finish_live_report(const std::shared_ptr<report::live_report>& live) {
  if (live) warn_report(live->finish());
}

}  // namespace troupe::cli
