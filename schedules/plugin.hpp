// Writing a schedule plugin: a shared library that registers generators under new names.
//
//     #include "schedules/plugin.hpp"
//     TROUPE_SCHEDULE_PLUGIN(host) {
//       return host.add("my_schedule", [](int p, int m, const troupe::schedules::schedule_options& o)
//                                          -> troupe::core::result<troupe::schedules::schedule> { ... });
//     }
//
// Build it with -shared -fPIC against these headers only: the plugin must not call functions
// defined in troupe's libraries (the executable does not export them); everything it needs from
// the host comes through `host`. Load it with `troupe schedule ... --plugin LIB.so`, or name
// "LIB.so:my_schedule" wherever a schedule name is accepted.
#pragma once

#include <functional>
#include <string>

#include "schedules/registry.hpp"

namespace troupe::schedules {

/// What a plugin's entry point is given: where it was loaded from and how to register.
struct plugin_host {
  std::string path;
  /// Registers `gen` under `name`; an error when the name exists.
  std::function<core::status(const std::string& name, generator gen)> add;
  /// Set by the entry point to what its body returned.
  core::status result;
};

/// The entry point's symbol name; bump the suffix when plugin_host changes.
inline constexpr const char* plugin_entry_symbol = "troupe_schedule_plugin_v1";

}  // namespace troupe::schedules

/// Defines the plugin's entry point; the body registers generators through `host` and returns a
/// troupe::core::status, which the loader reports.
#define TROUPE_SCHEDULE_PLUGIN(host)                                                              \
  static ::troupe::core::status troupe_schedule_plugin_body(::troupe::schedules::plugin_host&);   \
  extern "C" __attribute__((visibility("default"))) void troupe_schedule_plugin_v1(               \
      ::troupe::schedules::plugin_host& host) {                                                   \
    host.result = troupe_schedule_plugin_body(host);                                              \
  }                                                                                               \
  static ::troupe::core::status troupe_schedule_plugin_body(::troupe::schedules::plugin_host& host)
