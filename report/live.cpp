#include "report/live.hpp"

#include <filesystem>

#include "report/page.hpp"

namespace troupe::report {

std::string live_report_path(const std::string& run_dir) {
  return (std::filesystem::path(run_dir) / "report.html").string();
}

core::status live_report::write() {
  stale_ = false;
  return write_report({run_dir_}, live_report_path(run_dir_));
}

core::status live_report::step_end(int steps_done) {
  if (interval_ <= 0) return {};
  stale_ = true;
  return steps_done % interval_ == 0 ? write() : core::status{};
}

core::status live_report::finish() { return interval_ > 0 && stale_ ? write() : core::status{}; }

}  // namespace troupe::report
