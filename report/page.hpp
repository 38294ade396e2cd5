// The report page: one self-contained HTML file (inline SVG drawn by an inline script, nothing
// fetched) showing one run or several overlaid (docs/report.md).
//
// The page is report/assets/report.html with report.css, report.js and the page's data — a JSON
// object — filled in; the assets are embedded into the binary at build time. The data per run:
//   name, dir, rows (metrics lines read), tokens_per_step (0 without config), downsampled
//   (bucket count, or 0), x: {step: [steps done per row], time: [seconds, restarts joined]},
//   series: {loss, lr, grad_norm, tokens_per_s, tflops, loss_scale, bubble}: {i: [row], v: [value]}
//   (finite values only), val: {i, v}, stages: [{pp, dp, busy_s, comm_s, wait_s, bubble (medians
//   per step), peak_*_bytes}], prediction (the simulator's, or null) with prediction_note,
//   timeline ({step, events, rows: [{dp, pp, events: [[name, cat, start_s, dur_s]]}]} or null),
//   marks: [{kind, step, label}], notes: [text], config: {key: value}, summary: {...};
// and for the page: generated (UTC time), config_diff: [{key, values: [per run, null = no config]}].
//
// Series longer than page_options::max_points are cut into max_points / 2 buckets of rows, each
// keeping its minimum and its maximum (in row order), so spikes survive and a 100,000-step run
// stays a few MB.
#pragma once

#include <string>
#include <vector>

#include "core/error.hpp"
#include "report/run.hpp"

namespace troupe::report {

struct page_options {
  int max_points = 4000;  // per series; more are bucketed (min and max kept)
  std::string generated;  // the page's "written" time; "" = now (UTC)
};

/// The page's data as JSON text (what report.js reads).
std::string page_json(const std::vector<run_data>& runs, const page_options& options = {});

/// The complete HTML page.
std::string render_page(const std::vector<run_data>& runs, const page_options& options = {});

/// Writes `text` to `path` through a temporary file in the same directory and a rename, so a
/// reader (a browser refreshing the page) sees the old page or the new one, never half of one.
core::status write_atomically(const std::string& path, const std::string& text);

/// Reads every directory of `dirs` and writes the page to `out`. Errors: a directory that is not
/// one, or `out` cannot be written.
core::status write_report(const std::vector<std::string>& dirs, const std::string& out,
                          const page_options& options = {});

}  // namespace troupe::report
