// The schedule IR. A schedule is data: for each pipeline rank, the ordered list of instructions it
// executes in one training step. Gaps between instructions are bubbles; they appear only when the
// list is run against costs (simulate.hpp). Generators produce compute-only lists (F, B, I, W);
// lowering (lower.hpp) inserts the transfers, gradient reduction and the optimizer step.
//
// Chunks are GLOBAL virtual stages in [0, p*v); the forward pass runs chunk 0 -> p*v-1. Where a
// chunk lives is the schedule's placement: `interleaved` puts chunk c on rank c % p (rank r holds
// r, r+p, r+2p, ...: Megatron's interleaving); `v` folds every second round of p chunks back, so
// chunk c of round k = c / p lives on rank c % p for even k and on p-1 - c % p for odd k. With
// v = 2 that is the V of ZB-V: rank 0 holds the first and the last chunk, and chunk p-1 hands its
// output to chunk p on the same rank. Either way a rank's k-th chunk is from round k (c / p).
//
// Text form, compatible with PyTorch's pipelining actions: "<chunk><KIND><micro-batch>", e.g.
// "1F3" (chunk 1, forward, micro-batch 3), "0B7", "2I0", "2W0", "0REDUCE_GRAD", and for transfers
// the peer rank after an arrow: "1SEND_F3->2" (send chunk 1's output of micro-batch 3 to rank 2),
// "2RECV_F3<-1" (chunk 2 receives its input of micro-batch 3 from rank 1). The step is "STEP".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"

namespace troupe::schedules {

/// What an instruction does; each kind's meaning in one line.
enum class op_kind {
  F,            // forward of one micro-batch through one chunk; keeps its activations
  B,            // full backward: input gradient and weight gradient together; frees activations
  I,            // backward for inputs only (zero-bubble): the gradient the previous chunk needs
  W,            // backward for weights only (zero-bubble): accumulates weight gradients; frees
  SEND_F,       // send chunk's forward output to the rank of chunk + 1
  RECV_F,       // receive chunk's forward input from the rank of chunk - 1
  SEND_B,       // send the gradient of chunk's input to the rank of chunk - 1
  RECV_B,       // receive the gradient of chunk's output from the rank of chunk + 1
  REDUCE_GRAD,  // reduce chunk's accumulated weight gradients across data-parallel replicas
  STEP,         // optimizer step: the rank's last instruction
};

/// One instruction of a rank's list. REQUIRES: chunk in [0, p*v) except for STEP (-1); mb in
/// [0, m) except for REDUCE_GRAD and STEP (-1); peer set for SEND/RECV, -1 otherwise.
struct instruction {
  int chunk = 0;
  op_kind kind = op_kind::F;
  int mb = 0;
  int peer = -1;
  bool operator==(const instruction&) const = default;
};

/// One chunk's measured compute costs (a run's metrics.jsonl `device_costs`).
struct chunk_cost {
  double f = 0, b = 0, i = 0, w = 0;
};

/// Per-instruction costs in abstract time units, used by the simulator (and to order transfers).
struct cost_model {
  double f = 1;       // forward
  double b = 2;       // full backward (= i + w when both are measured)
  double i = 1;       // backward for inputs
  double w = 1;       // backward for weights
  double comm = 0;    // one point-to-point transfer
  double reduce = 0;  // REDUCE_GRAD
  double step = 0;    // STEP
  /// Per chunk (index = chunk id), when measured: the F, B, I and W of that chunk's instructions
  /// in place of f, b, i and w above. Empty: every chunk costs the same.
  std::vector<chunk_cost> chunks;
  /// The cost of one instruction of kind `k`.
  double of(op_kind k) const;
  /// The cost of one instruction of kind `k` on chunk `chunk`.
  double of(op_kind k, int chunk) const;
};

/// Options every generator receives.
struct schedule_options {
  int virtual_stages = 1;                 // chunks per rank (interleaved schedules)
  cost_model costs;                       // generators may adapt to costs; built-ins do not
  bool allow_any_backward_order = false;  // custom schedules only: skip the micro-batch order rule
};

/// The largest schedule this build makes, reads or checks. p and v follow the config's limits on
/// parallel.pipeline_stage and parallel.virtual_pipeline; m follows parallel.micro_batch_num. The
/// (chunk, micro-batch) passes p * v * m are bounded by what this machine's memory holds: each
/// pass becomes three to five instructions, in the schedule, its lowered copy and the validator's
/// tables, about `bytes_per_pass` in all, and a quarter of the memory is the most given to that.
inline constexpr int max_stages = 1024;
inline constexpr int max_virtual_stages = 1024;
inline constexpr int max_microbatches = 1 << 20;
inline constexpr std::int64_t bytes_per_pass = 512;
/// The most (chunk, micro-batch) passes this machine holds (at least 2^20).
std::int64_t max_passes();
/// An error naming `what` when p, v or m (any of them <= 0 is not checked) or their product is
/// above the limits, before anything that large is built.
core::status check_size(const std::string& what, int p, int v, int m);

/// Where chunks live (see the top of this file).
enum class placement { interleaved, v };

/// The rank of chunk `c` among `p` ranks under placement `pl`.
constexpr int chunk_rank(placement pl, int p, int c) {
  return pl == placement::v && (c / p) % 2 == 1 ? p - 1 - c % p : c % p;
}
/// The global id of rank `r`'s `k`-th chunk (in forward order) under placement `pl`.
constexpr int chunk_at(placement pl, int p, int r, int k) {
  return k * p + (pl == placement::v && k % 2 == 1 ? p - 1 - r : r);
}
/// "interleaved" or "v".
std::string_view placement_name(placement pl);

/// Per rank, the ordered instruction list of one training step.
struct schedule {
  int stages = 1;          // p: pipeline ranks
  int microbatches = 1;    // m
  int virtual_stages = 1;  // v: chunks per rank
  std::vector<std::vector<instruction>> ranks;
  std::string name;
  placement place = placement::interleaved;  // where chunks live

  /// p * v, the number of global chunks.
  int chunks() const { return stages * virtual_stages; }
  /// The rank that holds chunk `c`.
  int rank_of(int c) const { return chunk_rank(place, stages, c); }
  /// The global id of rank `r`'s `k`-th chunk, k in [0, v).
  int chunk_of(int r, int k) const { return chunk_at(place, stages, r, k); }
};

/// True for F, B, I and W.
bool is_compute(op_kind k);
/// True for SEND_F, RECV_F, SEND_B and RECV_B.
bool is_transfer(op_kind k);
/// True for SEND_F and SEND_B.
bool is_send(op_kind k);
/// "F", "SEND_F", "REDUCE_GRAD", ...
std::string_view kind_name(op_kind k);
/// The text form ("1F3", "1SEND_F3->2", "2RECV_F3<-1", "0REDUCE_GRAD", "STEP").
std::string to_string(const instruction& op);
/// Parses the text form; the peer suffix of transfers is optional (then peer = -1).
core::result<instruction> parse_instruction(std::string_view text);

/// The rank a transfer of chunk `c` talks to, derived from the chunk layout: SEND_F goes to the
/// rank of c + 1, RECV_F comes from the rank of c - 1, SEND_B goes to c - 1, RECV_B comes from c + 1.
int transfer_peer(const schedule& s, op_kind k, int c);
/// True when any rank's list holds a SEND or RECV (the schedule has been lowered or was written
/// with its transfers).
bool has_transfers(const schedule& s);
/// Number of instructions over all ranks.
std::size_t size(const schedule& s);

}  // namespace troupe::schedules
