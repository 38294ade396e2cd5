// `troupe plan CONFIG [--set k=v]... [--device-memory SIZE] [--launch] [--json]
//  [--calibration FILE] [--calibrate FILE] [--search --gpus N]`: what every rank of the job will
// hold on its device (from a dry run of the job's own code, plan/dry_run.hpp), how long a step
// will take (cost model + schedule simulator), whether it fits, and what to change when it does
// not. --search enumerates layouts of the config's model and global batch on N devices.
// Exit 0 when it fits (or the device memory is unknown), 3 when it does not, 1 on errors.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "cli/plan_check.hpp"
#include "core/config.hpp"
#include "plan/calibrate.hpp"
#include "plan/plan.hpp"

namespace troupe::cli {

namespace {

struct plan_args {
  std::string path;
  std::vector<std::string> sets;
  std::string device_memory;
  std::string calibration;
  std::string calibrate_out;
  bool launch = false;
  bool json = false;
  bool search = false;
  int gpus = 0;
};

int run_plan(const plan_args& a) {
  auto c = core::load_config(a.path, a.sets);
  if (!c) {
    print_error(c.err().to_string());
    return 1;
  }
  if (!a.calibrate_out.empty()) {
    auto cal = plan::calibrate(*c);
    if (!cal) {
      print_error(cal.err().to_string());
      return 1;
    }
    if (auto st = plan::save_calibration(cal.value(), a.calibrate_out); !st) {
      print_error(st.err().to_string());
      return 1;
    }
    std::printf("calibration (%s, %s): %.4g FLOP/s, %.4g B/s memory, %.4g B/s link -> %s\n",
                cal->device.c_str(), cal->precision.c_str(), cal->flops_per_s,
                cal->memory_bytes_per_s, cal->link_bytes_per_s, a.calibrate_out.c_str());
    for (const auto& [layers, s] : cal->chunk_seconds)
      std::printf("  a micro-batch through %d layer%s with embedding and head: %.3f ms\n", layers,
                  layers == 1 ? "" : "s", s * 1e3);
    if (cal->device != "cpu")
      std::printf("  two workers at once on the one device: %.3f times as fast as one after the "
                  "other\n", cal->concurrent_speedup);
    std::printf("  optimizer offload: %.4g B/s between device and host memory, host AdamW "
                "%.4g B/s\n", cal->offload_link_bytes_per_s, cal->host_adamw_bytes_per_s);
    return 0;
  }
  plan::calibration cal = plan::default_calibration(a.search ? "cuda" : c->runtime.device,
                                                    c->precision.compute);
  if (!a.calibration.empty()) {
    auto l = plan::load_calibration(a.calibration);
    if (!l) {
      print_error(l.err().to_string());
      return 1;
    }
    cal = l.value();
  }
  std::uint64_t memory = 0;
  if (!a.device_memory.empty()) {
    auto m = plan::parse_bytes(a.device_memory);
    if (!m) {
      print_error("--device-memory: " + m.err().to_string());
      return 2;
    }
    memory = m.value();
  }
  if (a.search) {
    if (a.gpus < 1 || memory == 0) {
      print_error(core::error::make("--search needs --gpus N and --device-memory SIZE",
                                    "e.g. troupe plan CONFIG --search --gpus 8 --device-memory 141GB")
                      .to_string());
      return 2;
    }
    plan::search_options so;
    so.gpus = a.gpus;
    so.device_memory = memory;
    so.cal = cal;
    auto r = plan::search(*c, so);
    if (!r) {
      print_error(r.err().to_string());
      return 1;
    }
    std::printf("%s", plan::render_search(r.value(), so).c_str());
    return r->best.empty() ? 3 : 0;
  }
  if (memory == 0) memory = device_memory_of(c->runtime.device);
  plan::plan_options po;
  po.device_memory = memory;
  po.one_device = !a.launch;
  po.cal = cal;
  auto p = plan::make_plan(*c, po);
  if (!p) {
    print_error(p.err().to_string());
    return 1;
  }
  std::printf("%s\n", a.json ? plan::render_json(p.value()).c_str() : plan::render_text(p.value()).c_str());
  return p->fits ? 0 : 3;
}

const command_registrar registrar{command{
    "plan", "Memory per rank, step time and fit of a layout before launching it; --search for the fastest layout",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<plan_args>();
      app.add_option("CONFIG", a->path, "TOML config file (see configs/README.md)")->required();
      app.add_option("--set", a->sets, "override a key, e.g. --set recompute.mode=full (repeatable)")
          ->allow_extra_args(false);
      app.add_option("--device-memory", a->device_memory,
                     "bytes of one device, e.g. 80GiB or 141GB (default: the GPU's own size on "
                     "CUDA; unknown on the CPU)");
      app.add_flag("--launch", a->launch,
                   "plan for `troupe launch` (one device per worker) instead of `troupe train` "
                   "(every worker in one process on one device)");
      app.add_flag("--json", a->json, "print the plan as JSON");
      app.add_option("--calibration", a->calibration,
                     "rates measured by --calibrate (default: built-in rates per device)");
      app.add_option("--calibrate", a->calibrate_out,
                     "measure the config's device (runtime.device) and write the rates to this file");
      app.add_flag("--search", a->search,
                   "enumerate layouts for --gpus devices of --device-memory and print the fastest "
                   "that fit");
      app.add_option("--gpus", a->gpus, "devices for --search")->check(CLI::PositiveNumber);
      return [a] { return run_plan(*a); };
    }}};

}  // namespace

}  // namespace troupe::cli
