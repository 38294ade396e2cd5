// Plain types shared by the actor runtime's engines (testable without CAF) and the CAF protocol
// (actors/protocol.hpp): what a tagged tensor is, who a tensor is for, and trace events.
#pragma once

#include <cstdint>
#include <string>

namespace troupe::actors {

/// What a tagged tensor is (transport::tag::kind).
enum class tensor_kind : std::uint32_t {
  tokens = 1,        // input token ids of a micro-batch (loader -> first stage)
  targets = 2,       // target ids of a micro-batch (loader -> last stage)
  activation = 3,    // input of chunk `chunk` for micro-batch `mb` (stage -> stage)
  gradient = 4,      // gradient of chunk `chunk`'s output for `mb` (stage -> stage)
  tied_grad = 5,     // a tied embedding's gradient, sent by chunk `chunk` to its partner
  grad_slice = 6,    // slice `part` of chunk `chunk`'s accumulated gradients (stage -> shard)
  reduced_grad = 7,  // slice `part` of the replica-summed gradients (shard -> stages, ZeRO-0/1)
  param_slice = 8,   // slice `part` of chunk `chunk`'s updated parameters (shard -> stages)
  snap_params = 9,   // a copy of chunk `chunk`'s flat parameters (stage -> writer / coordinator)
  snap_exp_avg = 10,     // a copy of slice `part` of chunk `chunk`'s first moment (shard -> writer)
  snap_exp_avg_sq = 11,  // the same for the second moment
};

/// Who a message is for.
enum class role : std::uint8_t { stage, shard, loader, coordinator, writer };

struct address {
  role who = role::stage;
  std::int32_t a = 0;  // stage: dp; shard: pp; loader: dp
  std::int32_t b = 0;  // stage: pp; shard: part; loader: pp
  bool operator==(const address&) const = default;
};

/// One timed instruction of a stage, for the Chrome trace.
struct trace_event {
  std::string name;       // "1F3", "wait 2RECV_F3<-1", ...
  std::uint8_t cat = 0;   // 0 compute, 1 communication, 2 waiting
  double start_us = 0;    // since the job started
  double dur_us = 0;
};

}  // namespace troupe::actors
