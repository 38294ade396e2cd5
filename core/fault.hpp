// Test-only fault injection for a launched job (docs/faults.md): TROUPE_FAULT names a fault that
// one worker of the job causes on purpose, so that the tests of the fault matrix can show how the
// job detects it, what it says and how it recovers. Nothing here is active unless that variable is
// set; fault_from_env is the only place it is read (`troupe worker` arms the fault of its attempt,
// `troupe launch` checks the text before starting anything).
//
//   drop:RANK:STEP     worker RANK's tcp transport closes its connection to the peer of the first
//                      tensor it sends in step STEP, halfway through that tensor's bytes
//   enospc:STEP        the checkpoint writer's write of the checkpoint of step STEP (the directory
//                      step_<STEP>) fails with ENOSPC halfway through its second file
//   nan:RANK:STEP      worker RANK's stage puts a NaN into one element of its first chunk's gradient
//                      (the middle one of the middle parameter) in step STEP, before the gradient
//                      leaves for the optimizer shards
//   slow:RANK:FACTOR   worker RANK's stage makes every compute instruction take FACTOR times as
//                      long (it sleeps FACTOR - 1 times the instruction's own time after it)
//   stall:RANK:STEP    worker RANK's stage stops at the start of step STEP, before its first
//                      instruction, and does nothing (answers no message) until the job has ended
//                      — a hung rank whose process is still there, for the watchdog's tests
//   poison:STEP:SEQ[:LOSS]  global sequence SEQ of step STEP (the loader's numbering) has a bad
//                      loss every time that step is computed, re-executions included: the stage
//                      that computes that sequence's loss writes LOSS (default NaN; a large
//                      finite value makes a loss jump) as the loss of its first target — a bad
//                      sequence that step forensics (runtime.forensics) finds deterministic
//   kill:RANK:STEP[:ATTEMPT]  worker RANK sends itself SIGKILL just before its stage's first compute
//                      instruction of step STEP, in attempt ATTEMPT of the job (default 0: the
//                      first; attempt N is the one after the N-th restart, TROUPE_RESTARTS = N)
//
// TROUPE_FAULT may name several faults separated by ',', at most one per attempt (e.g.
// "kill:2:3,kill:1:7:1": two kills, the second after the first restart). A fault stands for a
// one-off failure: every fault but kill fires in attempt 0 only, and a restarted attempt
// (`--max-restarts`, TROUPE_RESTARTS > 0) runs without it; a kill fires in its ATTEMPT only. nan
// fires once per process, so a step re-executed by step forensics runs clean (a transient fault);
// poison fires on every execution of its step. No CAF here.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace troupe::core {

enum class fault_kind { drop, enospc, nan, slow, poison, kill, stall };

/// One injected fault (see the top of this file).
struct fault_spec {
  std::string text;        // as given, for messages
  fault_kind kind = fault_kind::drop;
  int rank = -1;           // the worker that acts (drop, nan, slow, kill, stall); -1 for enospc,
                           // poison
  std::int64_t step = -1;  // drop, nan, poison, kill, stall: the step (0-based); enospc: the
                           // checkpoint's step
  int attempt = 0;         // the attempt it fires in (TROUPE_RESTARTS); only kill's can be > 0
  std::int64_t sequence = -1;  // poison: the global sequence index within the step
  double loss = std::numeric_limits<double>::quiet_NaN();  // poison: the loss written
  double factor = 1;       // slow

  /// "TROUPE_FAULT=<text>", for messages.
  std::string label() const { return "TROUPE_FAULT=" + text; }
};

/// Parses one fault; errors name `source` (e.g. "TROUPE_FAULT") and give the forms.
result<fault_spec> parse_fault(const std::string& text, const std::string& source);

/// Parses a ','-separated list of faults, at most one per attempt; "" gives none.
result<std::vector<fault_spec>> parse_faults(const std::string& text, const std::string& source);

/// The fault of `faults` that fires in attempt `attempt` (TROUPE_RESTARTS), if any.
std::optional<fault_spec> fault_for_attempt(const std::vector<fault_spec>& faults, int attempt);

/// TROUPE_FAULT parsed (parse_faults), or none when it is unset or empty.
result<std::vector<fault_spec>> fault_from_env();

}  // namespace troupe::core
