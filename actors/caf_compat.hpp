// Every CAF-version-specific spelling lives here (docs/design.md, rule 9), pinned to CAF 0.17.6:
// atoms as atom_constant<atom("...")> (at most 10 characters), inspect() returning
// Inspector::result_type with meta::type_name, and the scheduler settings.
#pragma once

#include <caf/all.hpp>

#if !defined(CAF_VERSION) || CAF_VERSION < 1706 || CAF_VERSION >= 1800
#error "troupe is written against CAF 0.17.6 (Debian libcaf-dev, installed by scripts/setup.sh)"
#endif

namespace troupe::actors {

/// Makes a scheduler that does not spin: CAF's default work stealing polls aggressively, which on
/// a 2-core machine steals time from the stage actors doing the arithmetic.
inline void configure_scheduler(caf::actor_system_config& cfg, int threads) {
  cfg.set("scheduler.policy", caf::atom("sharing"));
  if (threads > 0) cfg.set("scheduler.max-threads", static_cast<size_t>(threads));
  cfg.set("logger.console", caf::atom("none"));
  cfg.set("logger.file-verbosity", caf::atom("quiet"));
}

}  // namespace troupe::actors

#define TROUPE_INSPECT_NAME(name) caf::meta::type_name(name)
