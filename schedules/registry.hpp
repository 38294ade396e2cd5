// Schedules by name. The built-ins (gpipe, 1f1b, interleaved_1f1b, zb_h1) are always there; a
// user adds generators from C++ (register_schedule) or from a shared library (plugin.hpp), or
// passes a schedule file instead of a name.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// A generator: (p, m, options) -> compute-only schedule (or one with transfers, taken as is).
using generator = std::function<core::result<schedule>(int p, int m, const schedule_options& options)>;

/// Registers `gen` under `name`. `origin` says where it was defined ("plugin /x/libfoo.so"); a name
/// that exists is an error naming both definitions.
core::status register_schedule(const std::string& name, generator gen, const std::string& origin);

/// Every registered name, sorted.
std::vector<std::string> schedule_names();

/// Loads a shared library and runs its TROUPE_SCHEDULE_PLUGIN entry point, which registers its
/// generators. Loading the same file again does nothing. The library stays loaded for the
/// process's lifetime (its generators are called later).
core::status load_schedule_plugin(const std::string& path);

/// Resolves `name_or_file`: a registered name; "LIB.so:NAME" (loads LIB.so, then NAME); or a
/// schedule file (schedule_file.hpp). The result is validated before it is returned. For files,
/// p, m and options.virtual_stages of 0 mean "as the file says", others must match the file; for
/// generators, virtual_stages 0 means 1. Unknown names list the valid ones.
core::result<schedule> make_schedule(const std::string& name_or_file, int p, int m,
                                     const schedule_options& options);

}  // namespace troupe::schedules
