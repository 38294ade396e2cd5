#include "cli/plan_check.hpp"

#include <cstdio>

#include "cli/command.hpp"
#include "kernels/select.hpp"
#include "plan/plan.hpp"

namespace troupe::cli {

std::uint64_t device_memory_of(const std::string& device) {
  return kernels::device_memory_bytes(device);
}

int check_plan(const core::config& cfg, const std::string& device_memory, bool launch) {
  std::uint64_t memory = 0;
  if (!device_memory.empty()) {
    auto m = plan::parse_bytes(device_memory);
    if (!m) {
      print_error("--device-memory: " + m.err().to_string());
      return 1;
    }
    memory = m.value();
  } else if (cfg.runtime.device.rfind("cuda", 0) == 0) {
    memory = device_memory_of(cfg.runtime.device);
  }
  if (memory == 0) return 0;  // the CPU without --device-memory: nothing to judge against
  plan::plan_options po;
  po.device_memory = memory;
  po.one_device = !launch;
  po.cal = plan::default_calibration(cfg.runtime.device, cfg.precision.compute);
  auto p = plan::make_plan(cfg, po);
  if (!p) {
    print_error(p.err().to_string());
    return 1;
  }
  if (p->fits) return 0;
  std::string hint = p->suggestions.empty()
                         ? "more devices (pipeline_stage), or a smaller micro-batch or model"
                         : p->suggestions.front().change;
  print_error(core::error::make("the layout needs " + plan::format_bytes(p->need) +
                                    " on one device but it has " + plan::format_bytes(memory) +
                                    " (largest term: " + p->largest_term + "); nothing was allocated",
                                hint + "; or --no-plan-check to run anyway")
                  .to_string());
  std::fprintf(stderr, "%s", plan::render_text(p.value()).c_str());
  return 3;
}

void explain_out_of_memory(const core::config& cfg, const std::string& error,
                           const std::string& device_memory, bool launch) {
  if (error.find("out of device memory") == std::string::npos) return;
  plan::plan_options po;
  po.device_memory = device_memory_of(cfg.runtime.device);
  if (auto m = plan::parse_bytes(device_memory); !device_memory.empty() && m) po.device_memory = m.value();
  po.one_device = !launch;
  po.cal = plan::default_calibration(cfg.runtime.device, cfg.precision.compute);
  auto p = plan::make_plan(cfg, po);
  if (!p) return;
  std::fprintf(stderr, "troupe: the plan of this layout (bytes by kind at each rank's peak):\n%s",
               plan::render_text(p.value()).c_str());
}

}  // namespace troupe::cli
