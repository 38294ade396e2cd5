// A test-only perturbation of one tensor a worker sends, for showing what `troupe replay` finds
// (docs/replay.md, "A perturbed worker"; examples/replay_debug). The spec "rank:step:instruction"
// names the worker rank, the step and the instruction or role action as the message logs write it
// (`0SEND_F2->1`, `1SEND_B3->0`, `0REDUCE_GRAD`, `loader cut`, `shard update`): the first tensor
// that matches gets the lowest bit of its first byte flipped before it is recorded and sent, so
// the run goes on with that one bit changed and its message log holds the changed bytes' hash.
// `troupe worker` reads it from TROUPE_PERTURB_SEND (so `troupe launch` passes it on to every
// worker, and only the named rank acts on it); `troupe replay` never reads it.
// No CAF here.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "actors/wire.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "transport/transport.hpp"

namespace troupe::actors {

/// Which sent tensor to perturb; matches at most once per process.
struct send_perturbation {
  std::string spec;  // as given, for messages
  int rank = 0;
  std::int64_t step = 0;
  std::string op;
  std::atomic<bool> done{false};
};

/// Parses "rank:step:instruction"; `source` (e.g. "TROUPE_PERTURB_SEND") names it in errors.
core::result<std::shared_ptr<send_perturbation>> parse_perturbation(const std::string& spec,
                                                                    const std::string& source);

/// `t`, or, when `p` names this message and has not matched yet, a copy of it with the lowest bit
/// of its first byte flipped (a device tensor goes through `be`, the sender's backend). Says so
/// on stderr, naming the message.
core::tensor perturb_send(send_perturbation& p, const address& from, int src, const address& to,
                          int dst, const transport::tag& tg, core::tensor t, kernels::backend* be);

}  // namespace troupe::actors
