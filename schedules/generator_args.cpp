// Argument checks shared by the built-in generators, so their errors read alike.
#include "schedules/generators.hpp"

namespace troupe::schedules {

core::status check_generator_args(std::string_view name, int p, int m, const schedule_options& options,
                                  bool v_allowed) {
  const std::string n(name);
  if (p < 1)
    return core::error::make(n + ": pipeline_stage p = " + std::to_string(p) + " must be at least 1",
                             "pass --stages P with P >= 1");
  if (m < 1)
    return core::error::make(n + ": micro_batch_num m = " + std::to_string(m) +
                                 " must be at least 1",
                             "pass --microbatches M with M >= 1");
  if (options.virtual_stages < 1)
    return core::error::make(n + ": virtual stages v = " + std::to_string(options.virtual_stages) +
                                 " must be at least 1",
                             "pass --virtual V with V >= 1");
  if (!v_allowed && options.virtual_stages != 1)
    return core::error::make(n + " runs one chunk per rank, but v = " +
                                 std::to_string(options.virtual_stages) + " chunks were asked for",
                             "use interleaved_1f1b for v > 1, or set v = 1");
  return core::status::success();
}

}  // namespace troupe::schedules
