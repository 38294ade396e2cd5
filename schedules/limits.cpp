// The size limits of schedule.hpp: checked where a size first appears (arguments, a config, a
// schedule file's lines), so that nothing proportional to an absurd size is ever built.
#include <unistd.h>

#include <algorithm>
#include <string>

#include "schedules/schedule.hpp"

namespace troupe::schedules {

std::int64_t max_passes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  const std::int64_t memory = pages > 0 && page > 0 ? std::int64_t(pages) * page : std::int64_t(1) << 32;
  return std::max<std::int64_t>(std::int64_t(1) << 20, memory / 4 / bytes_per_pass);
}

core::status check_size(const std::string& what, int p, int v, int m) {
  const auto over = [&](const char* name, std::int64_t got, std::int64_t most, const std::string& why) {
    return core::error::make(what + ": " + name + " = " + std::to_string(got) + " is above the " +
                                 std::to_string(most) + " this build handles",
                             why);
  };
  if (p > max_stages)
    return over("pipeline stages p", p, max_stages,
                "a pipeline rank is a worker; parallel.pipeline_stage allows at most " +
                    std::to_string(max_stages));
  if (v > max_virtual_stages)
    return over("virtual stages v", v, max_virtual_stages,
                "chunks per rank; parallel.virtual_pipeline allows at most " +
                    std::to_string(max_virtual_stages));
  if (m > max_microbatches)
    return over("micro-batches m", m, max_microbatches,
                "parallel.micro_batch_num x train.gradient_accumulation_steps is at most " +
                    std::to_string(max_microbatches));
  const std::int64_t passes = std::int64_t(std::max(p, 1)) * std::max(v, 1) * std::max(m, 1);
  if (passes > max_passes())
    return core::error::make(
        what + ": p x v x m = " + std::to_string(std::max(p, 1)) + " x " +
            std::to_string(std::max(v, 1)) + " x " + std::to_string(std::max(m, 1)) + " = " +
            std::to_string(passes) + " (chunk, micro-batch) passes, above the " +
            std::to_string(max_passes()) + " this machine holds",
        "each pass takes about " + std::to_string(bytes_per_pass) +
            " bytes as instructions and checks, and at most a quarter of this machine's memory "
            "goes to that; use fewer micro-batches (gradient accumulation repeats a smaller "
            "schedule) or fewer stages");
  return {};
}

}  // namespace troupe::schedules
