// The built-in generators: pure functions (p, m, options) -> compute-only schedule (docs/design.md,
// rule 2). Each keeps every chunk's backwards in micro-batch order 0, 1, 2, ..., because the runtime
// accumulates gradients in that order for bit-exact results. Register and look them up by name
// through registry.hpp; call them directly only in tests.
#pragma once

#include "schedules/schedule.hpp"

namespace troupe::schedules {

/// GPipe: every rank runs all forwards, then all backwards. Peak activations: m on every rank.
core::result<schedule> make_gpipe(int p, int m, const schedule_options& options);

/// 1F1B (PipeDream-flush): warm-up forwards, one-forward-one-backward, cool-down backwards.
/// Peak activations on rank r: min(p - r, m).
core::result<schedule> make_1f1b(int p, int m, const schedule_options& options);

/// Megatron's interleaved 1F1B with options.virtual_stages chunks per rank. REQUIRES (checked):
/// m a multiple of p when v > 1. With v = 1 it is 1F1B.
core::result<schedule> make_interleaved_1f1b(int p, int m, const schedule_options& options);

/// Zero-bubble ZB-H1: backward split into I (input gradient, on the critical path) and W (weight
/// gradient, deferred into what would be the cool-down bubble). At most min(p, m) micro-batches in
/// flight on any rank, the peak of 1F1B.
core::result<schedule> make_zb_h1(int p, int m, const schedule_options& options);

/// Zero-bubble ZB-V: v = 2 chunks per rank in a V (placement::v), backward split into I and W,
/// ordered by a greedy unit-time list scheduler. REQUIRES (checked): v = 2. At most 2p
/// (chunk, micro-batch) activations of half a stage each on any rank, 1F1B's peak.
core::result<schedule> make_zb_v(int p, int m, const schedule_options& options);

/// Checks the arguments every generator shares; `v_allowed` false rejects v > 1.
core::status check_generator_args(std::string_view name, int p, int m, const schedule_options& options,
                                  bool v_allowed);

}  // namespace troupe::schedules
