// The live report: during a run, <run_dir>/report.html is rewritten every runtime.report_interval
// steps (atomically: a browser refresh shows the old page or the new one), so the run can be
// watched from a browser. Each rewrite reads the run directory again, like `troupe report`.
#pragma once

#include <string>
#include <utility>

#include "core/error.hpp"

namespace troupe::report {

/// The page a run rewrites while it trains: <run_dir>/report.html.
std::string live_report_path(const std::string& run_dir);

class live_report {
 public:
  /// `interval` steps between rewrites; 0 never writes.
  live_report(std::string run_dir, int interval) : run_dir_(std::move(run_dir)), interval_(interval) {}

  /// After `steps_done` steps (1-based): rewrites the page when `interval` divides it.
  core::status step_end(int steps_done);
  /// The run is over (or failed): the final page, when the interval is not 0 and a step ran since
  /// the last rewrite.
  core::status finish();

 private:
  core::status write();
  std::string run_dir_;
  int interval_ = 0;
  bool stale_ = false;
};

}  // namespace troupe::report
