// The data plane: moving tensors between ranks. Control messages (CAF) say *that* a tensor is
// ready and under which tag; the transport moves the bytes. Both ends of every send/recv pair
// derive their order from the same schedule, so in-order transports (NCCL) match up.
//
// Implementations: `local` (one process: the handle moves, zero-copy), `tcp` (CPU tensors between
// processes), `nccl` (GPU). Collectives are over an explicit group of ranks and sum in the group's
// rank order, so their results do not depend on arrival order (docs/design.md, Determinism
// contract).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace troupe::transport {

using core::tensor;

/// A tag names one tensor transfer within a job; both sides compute it from the schedule.
struct tag {
  std::int64_t step = 0;
  std::uint32_t kind = 0;    // what is moving (see actors/protocol.hpp: tensor_kind)
  std::int32_t chunk = 0;
  std::int32_t mb = 0;
  std::int32_t part = 0;     // shard / slice index where a tensor is split
  bool operator==(const tag&) const = default;
  auto operator<=>(const tag&) const = default;
  std::string to_string() const;
};

class transport {
 public:
  virtual ~transport() = default;
  virtual std::string name() const = 0;
  /// This endpoint's rank.
  virtual int rank() const = 0;
  /// Hands `t` to rank `dst` under `tg`. The sender must not modify t's storage afterwards.
  virtual void send(int dst, tensor t, const tag& tg) = 0;
  /// The tensor rank `src` sent under `tg`; waits at most `timeout`, then throws core::failure
  /// naming both ranks and the tag.
  virtual tensor recv(int src, const tag& tg, std::chrono::milliseconds timeout) = 0;
  /// True when the tensor from `src` under `tg` has arrived (recv would not wait).
  virtual bool ready(int src, const tag& tg) = 0;
};

/// Collectives over `group` (global ranks, in the order that fixes the summation order), built on
/// send/recv so every transport has them. They wait (up to `timeout` per receive) for the other
/// members, so call them from a thread that may block: a worker thread or a test, not an
/// event-based actor that shares the scheduler with its peers. `tg.part` is overwritten.
/// Flat fp32 tensors; slice k of n is elements [k*n_elems/n, (k+1)*n_elems/n) with n_elems % n == 0.
tensor all_reduce(transport& t, const std::vector<int>& group, const tensor& x, tag tg,
                  std::chrono::milliseconds timeout);
/// This rank's slice of the sum.
tensor reduce_scatter(transport& t, const std::vector<int>& group, const tensor& x, tag tg,
                      std::chrono::milliseconds timeout);
/// Concatenation of every member's slice, in group order.
tensor all_gather(transport& t, const std::vector<int>& group, const tensor& slice, tag tg,
                  std::chrono::milliseconds timeout);
/// root's tensor on every member.
tensor broadcast(transport& t, const std::vector<int>& group, int root, const tensor& x, tag tg,
                 std::chrono::milliseconds timeout);

/// Sum of `parts` elementwise in the order given (parts[0] + parts[1] + ...), fp32, into a new
/// host tensor. The fixed order is what makes data-parallel reductions reproducible.
tensor ordered_sum(const std::vector<tensor>& parts);

}  // namespace troupe::transport
