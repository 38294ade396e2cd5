// `troupe report RUN_DIR [RUN_DIR...] [--out FILE.html]`: one self-contained HTML page drawing
// what the runs wrote (report/page.hpp); several runs are overlaid with their config differences
// listed. What the page skipped (truncated or foreign metrics lines, a missing config) is listed
// on the page and counted here.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "report/live.hpp"
#include "report/page.hpp"
#include "report/run.hpp"

namespace troupe::cli {
namespace {

struct report_args {
  std::vector<std::string> dirs;
  std::string out;
  int max_points = 4000;
};

int run_report(const report_args& a) {
  std::vector<report::run_data> runs;
  for (const auto& d : a.dirs) {
    auto r = report::read_run(d);
    if (!r) {
      print_error(r.err().to_string());
      return 1;
    }
    runs.push_back(std::move(r.value()));
  }
  // One run: beside its data, the file runtime.report_interval rewrites; several: here.
  const std::string out = !a.out.empty()        ? a.out
                          : a.dirs.size() == 1 ? report::live_report_path(a.dirs.front())
                                               : std::string("compare.html");
  report::page_options o;
  o.max_points = a.max_points;
  if (auto st = report::write_atomically(out, report::render_page(runs, o)); !st) {
    print_error(st.err().to_string());
    return 1;
  }
  for (const auto& r : runs) {
    std::printf("%s: %zu steps", r.dir.c_str(), r.rows.size());
    if (!r.notes.empty()) std::printf(", %zu notes on the page (what was skipped and why)", r.notes.size());
    std::printf("\n");
  }
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

const command_registrar reg{command{
    "report",
    "Draw one run, or several overlaid, as one self-contained HTML page (loss, speed, bubbles, "
    "memory, one step per rank)",
    [](CLI::App& app) {
      auto a = std::make_shared<report_args>();
      app.add_option("run_dirs", a->dirs, "run directories (runtime.run_dir of troupe train/launch)")
          ->required();
      app.add_option("--out", a->out,
                     "the HTML file to write (default: RUN_DIR/report.html for one run, "
                     "compare.html for several)");
      app.add_option("--max-points", a->max_points,
                     "points per plotted series; longer series keep each bucket's min and max")
          ->check(CLI::Range(16, 1000000));
      return [a] { return run_report(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
