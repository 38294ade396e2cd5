// What a tensor-parallel stage is waiting for inside one of its group's collectives, readable from
// another thread. A tensor-parallel stage runs on a thread of its own and blocks inside the
// collectives (actors/tp_group.hpp), so while it waits it cannot answer the watchdog's question
// (docs/runtime.md, "A watchdog"); its group publishes each blocking receive here (set before it,
// cleared after), and whoever asks in its place — the coordinator in one process, the worker's node
// actor in a launched job — reads it. No CAF.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "model/layer.hpp"

namespace troupe::actors {

/// One blocking receive inside a collective of the group.
struct tp_wait_info {
  std::int64_t step = 0;
  int layer = 0;          // global layer index; -1 the embedding, -2 the head and the loss
  int micro_batch = 0;
  model::comm_op op = model::comm_op::forward;
  const char* collective = "";  // all_gather, reduce_scatter, all_reduce
  const char* half = "";        // of an all_reduce: "reduce-scatter" or "all-gather", else ""
  int index = 0;                // the collective's number within the op (0 = the op's first)
  int peer = 0;                 // the global rank it waits to receive from
  std::chrono::steady_clock::time_point since;
};

/// The op's name as docs/model.md spells it ("forward", "backward_input", ...).
const char* comm_op_name(model::comm_op op);

/// "all_reduce (its all-gather half, collective 2 of backward_input) of layer 3, micro-batch 1,
/// step 5: waiting to receive from rank 5" — the wait without its duration, which changes from
/// one reading to the next. `peer`: how to name the peer (e.g. "rank 5 (stage(dp=0, pp=0, tp=1))").
std::string describe_wait(const tp_wait_info& w, const std::string& peer);

/// The slot: written by the stage's thread, read by any other.
class tp_wait {
 public:
  /// Before a blocking receive from global rank `peer`.
  void enter(const tp_wait_info& w) {
    std::lock_guard<std::mutex> lock(mu_);
    now_ = w;
  }
  /// After it (returned or threw).
  void leave() {
    std::lock_guard<std::mutex> lock(mu_);
    now_.reset();
  }
  /// The receive the stage is blocked in, if any.
  std::optional<tp_wait_info> current() const {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }

 private:
  mutable std::mutex mu_;
  std::optional<tp_wait_info> now_;
};

}  // namespace troupe::actors
