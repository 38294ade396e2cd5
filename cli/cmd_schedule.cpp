// `troupe schedule show|check|simulate`: print a schedule as a step x rank grid, check it, or run
// it against costs and draw it (SVG timeline, Chrome trace).
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/command.hpp"
#include "report/run.hpp"
#include "schedules/costs.hpp"
#include "schedules/grid.hpp"
#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/render.hpp"
#include "schedules/schedule_file.hpp"
#include "schedules/simulate.hpp"
#include "schedules/validate.hpp"

namespace troupe::cli {

namespace {

namespace ts = troupe::schedules;

struct schedule_args {
  std::string schedule = "1f1b";
  int stages = 0;
  int microbatches = 0;
  int virtual_stages = 0;
  std::string costs;
  std::string costs_from;
  std::vector<std::string> plugins;
  bool lowered = false;
  bool any_backward_order = false;
  std::string svg, trace, write;
  bool json = false;
};

void add_common(CLI::App& sub, schedule_args& a, bool pictures) {
  sub.add_option("--schedule,-s", a.schedule,
                 "a registered name (gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v, or one a plugin added), a schedule "
                 "file (text or PyTorch .csv), or LIB.so:NAME")
      ->capture_default_str();
  sub.add_option("--stages,-p", a.stages, "pipeline ranks p (files: taken from the file when left out)");
  sub.add_option("--microbatches,-m", a.microbatches, "micro-batches per step m (files: from the file)");
  sub.add_option("--virtual,-v", a.virtual_stages, "chunks per rank v for interleaved_1f1b, 2 for zb_v (default 1)");
  sub.add_option("--costs", a.costs,
                 "costs as F,B,W,comm (I = B - W; default 1,2,1,0) or f=..,b=..,i=..,w=..,comm=..,reduce=..,step=..");
  sub.add_option("--costs-from", a.costs_from,
                 "a run's metrics.jsonl: each chunk's F, B, I and W as that run measured them "
                 "on the device (median over its steps after the first two), in ms; --costs "
                 "still gives comm, reduce and step");
  sub.add_option("--plugin", a.plugins, "load a schedule plugin (shared library) first; may repeat");
  sub.add_flag("--lowered", a.lowered, "use the lowered schedule (transfers, REDUCE_GRAD, STEP)");
  sub.add_flag("--any-backward-order", a.any_backward_order,
               "accept a custom schedule whose backwards are not in micro-batch order");
  if (pictures) {
    sub.add_option("--svg", a.svg, "write an SVG timeline (one row per rank) to this file");
    sub.add_option("--trace", a.trace, "write a Chrome-trace JSON (open in Perfetto) to this file");
  }
}

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) {
    print_error(path + ": cannot write the file\n  hint: check that the folder exists and is writable");
    return false;
  }
  std::printf("wrote %s\n", path.c_str());
  return true;
}

struct loaded {
  ts::schedule compute;  // as generated or read (may already carry transfers when read from a file)
  ts::schedule lowered;
  ts::cost_model costs;
};

core::result<loaded> load(const schedule_args& a) {
  for (auto& lib : a.plugins)
    if (auto st = ts::load_schedule_plugin(lib); !st) return st.err();
  ts::cost_model costs;
  if (!a.costs.empty()) {
    auto c = ts::parse_costs(a.costs);
    if (!c) return c.err();
    costs = *c;
  }
  if (!a.costs_from.empty()) {
    auto c = report::read_chunk_costs(a.costs_from);
    if (!c) return c.err();
    costs.chunks = std::move(*c);
  }
  ts::schedule_options options;
  options.virtual_stages = a.virtual_stages;
  options.costs = costs;
  options.allow_any_backward_order = a.any_backward_order;
  auto s = ts::make_schedule(a.schedule, a.stages, a.microbatches, options);
  if (!s) return s.err();
  loaded out{*s, ts::lower(*s, costs), costs};
  return out;
}

std::string describe(const ts::schedule& s) {
  return s.name + "  p=" + std::to_string(s.stages) + " m=" + std::to_string(s.microbatches) +
         " v=" + std::to_string(s.virtual_stages) +
         (s.place == ts::placement::interleaved ? "" : " placement " + std::string(ts::placement_name(s.place)));
}

// Simulates and writes the pictures asked for; returns false after printing an error.
bool pictures(const schedule_args& a, const ts::schedule& s, const ts::cost_model& costs, ts::simulation* keep) {
  if (a.svg.empty() && a.trace.empty() && !keep) return true;
  auto sim = ts::simulate(s, costs);
  if (!sim) {
    print_error(sim.err().to_string());
    return false;
  }
  const std::string subtitle = std::string(a.lowered ? "lowered, " : "") + "costs " + ts::format_costs(costs);
  if (!a.svg.empty() && !write_file(a.svg, ts::render_svg(s, *sim, subtitle))) return false;
  if (!a.trace.empty() && !write_file(a.trace, ts::render_trace(s, *sim))) return false;
  if (keep) *keep = std::move(*sim);
  return true;
}

int run_show(const schedule_args& a) {
  auto l = load(a);
  if (!l) {
    print_error(l.err().to_string());
    return 1;
  }
  const ts::schedule& s = a.lowered ? l->lowered : l->compute;
  if (!a.write.empty()) return write_file(a.write, ts::format_schedule_text(s)) ? 0 : 1;
  std::printf("%s  (%s, %zu instructions)\n%s", describe(s).c_str(),
              ts::has_transfers(s) ? "with transfers" : "compute-only", ts::size(s), ts::format_grid(s).c_str());
  return pictures(a, s, l->costs, nullptr) ? 0 : 1;
}

int run_check(const schedule_args& a) {
  auto l = load(a);  // make_schedule validates what it returns
  if (!l) {
    print_error(l.err().to_string());
    return 1;
  }
  ts::validate_options vo;
  vo.require_microbatch_order = !a.any_backward_order;
  if (auto st = ts::validate(l->lowered, vo); !st) {
    print_error("the lowered schedule is invalid (a bug in lowering, please report it):\n" + st.err().to_string());
    return 1;
  }
  std::size_t transfers = 0;
  for (auto& list : l->lowered.ranks)
    for (auto& op : list) transfers += ts::is_transfer(op.kind);
  std::printf("ok: %s\n", describe(l->compute).c_str());
  std::printf("  %s: %zu instructions; every micro-batch forwarded and backwarded once per chunk, F before B "
              "(I before W), %s, runs to the end\n",
              ts::has_transfers(l->compute) ? "as written" : "compute-only", ts::size(l->compute),
              a.any_backward_order ? "any backward order" : "backwards in micro-batch order");
  std::printf("  lowered: %zu instructions with %zu transfers; every send meets its receive in order; no deadlock "
              "under blocking in-order send/recv\n",
              ts::size(l->lowered), transfers);
  return 0;
}

int run_simulate(const schedule_args& a) {
  auto l = load(a);
  if (!l) {
    print_error(l.err().to_string());
    return 1;
  }
  const ts::schedule& s = a.lowered ? l->lowered : l->compute;
  ts::simulation sim;
  if (!pictures(a, s, l->costs, &sim)) return 1;
  if (a.json) {
    nlohmann::json j;
    j["schedule"] = s.name;
    j["stages"] = s.stages;
    j["microbatches"] = s.microbatches;
    j["virtual_stages"] = s.virtual_stages;
    j["placement"] = std::string(ts::placement_name(s.place));
    j["lowered"] = a.lowered;
    j["costs"] = {{"f", l->costs.f}, {"b", l->costs.b}, {"i", l->costs.i}, {"w", l->costs.w},
                  {"comm", l->costs.comm}, {"reduce", l->costs.reduce}, {"step", l->costs.step}};
    for (const auto& c : l->costs.chunks)
      j["costs"]["chunks"].push_back({{"f", c.f}, {"b", c.b}, {"i", c.i}, {"w", c.w}});
    j["makespan"] = sim.makespan;
    j["bubble"] = sim.bubble;
    for (std::size_t r = 0; r < sim.ranks.size(); ++r) {
      const auto& rr = sim.ranks[r];
      j["ranks"].push_back({{"rank", r}, {"compute", rr.compute}, {"transfer", rr.transfer}, {"other", rr.other},
                            {"idle", rr.idle}, {"bubble", rr.bubble}, {"peak_activations", rr.peak_activations}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s%s   costs %s\n", describe(s).c_str(), a.lowered ? " (lowered)" : "",
              ts::format_costs(l->costs).c_str());
  std::printf("makespan %g   bubble %.2f%%\n\n", sim.makespan, 100 * sim.bubble);
  std::printf("rank   compute  transfer     other      idle   bubble   peak activations\n");
  for (std::size_t r = 0; r < sim.ranks.size(); ++r) {
    const auto& rr = sim.ranks[r];
    std::printf("%4zu  %8g  %8g  %8g  %8g  %6.2f%%   %d\n", r, rr.compute, rr.transfer, rr.other, rr.idle,
                100 * rr.bubble, rr.peak_activations);
  }
  return 0;
}

command_registrar registrar{{
    "schedule",
    "show, check or simulate a pipeline schedule (built-in, file or plugin)",
    [](CLI::App& app) -> std::function<int()> {
      auto args = std::make_shared<schedule_args>();
      app.require_subcommand(1);
      CLI::App* show = app.add_subcommand("show", "print the schedule as a step x rank grid; --svg/--trace draw it");
      add_common(*show, *args, true);
      show->add_option("--write", args->write, "write the schedule in the text file form instead of printing it");
      CLI::App* check = app.add_subcommand(
          "check", "validate the schedule and its lowered form; exits 1 with the marked grid when invalid");
      add_common(*check, *args, false);
      CLI::App* simulate = app.add_subcommand(
          "simulate", "run the schedule against costs: makespan, bubble and peak activations per rank");
      add_common(*simulate, *args, true);
      simulate->add_flag("--json", args->json, "print the report as JSON");
      return [args, show, check]() {
        if (show->parsed()) return run_show(*args);
        if (check->parsed()) return run_check(*args);
        return run_simulate(*args);
      };
    },
}};

}  // namespace

}  // namespace troupe::cli
