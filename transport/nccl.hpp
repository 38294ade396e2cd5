// The nccl transport: device tensors between GPU ranks through NCCL, one process (rank) per GPU.
// Built only where CUDA and NCCL are found (TROUPE_HAVE_NCCL); docs/networking.md, "nccl
// transport", has the design, the setup order and what was tested where.
//
// NCCL pairs sends with receives by order, and the actor runtime takes tensors in no fixed order.
// So every transfer is announced on a control channel (a tcp_transport between the same ranks)
// with its tag, dtype, shape and a per-(sender, receiver) sequence number (nccl_wire.hpp); this
// rank's progress thread posts the matching ncclRecv into a fresh device buffer strictly in
// sequence order per sender, whatever order the records arrive or recv() is called in.
//
// Device tensors follow the hand-off protocol of kernels/backend.hpp
// (kernels/cuda/cuda_handoff.hpp), as between two backends of one GPU: the sender's backend calls
// record_ready(t) before send(t) and the send waits for that event on the GPU; recv() returns as
// soon as the transfer is queued, with the transfer's event as t's ready event, and the consumer's
// backend calls wait_ready(t) before using it. No host thread waits for the GPU on either side.
//
// Each ordered pair of ranks (a -> b) has its own two-rank communicator and its own streams, so
// that a's sends to b never queue behind a's receives from b or from anyone else: on one
// communicator NCCL runs operations one after another, and two ranks each sending a large tensor
// to the other before receiving would wait on each other forever. Sends to one destination go
// out in call order (one mutex per destination).
//
// Host tensors travel inside their control record, as on the tcp transport, so one transport
// carries everything a worker sends; the collectives of transport.hpp work on host tensors over
// it unchanged. Device collectives are NCCL's own, on nccl_group.
//
// Errors: NCCL and CUDA failures, a peer whose control connection is lost, and a transfer that has
// not finished on the GPU after op_timeout make the transport fail: every communicator is aborted
// (ncclCommAbort), the control channel is closed at once (so peers learn it now), on_failure is
// called, and every pending and later call throws core::failure naming this rank, the peer and the
// tag, followed by the first cause.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "transport/rendezvous.hpp"
#include "transport/tcp.hpp"
#include "transport/transport.hpp"

struct CUstream_st;

namespace troupe::transport {

struct nccl_options {
  /// The control channel. Its on_arrival and on_peer_lost are the nccl transport's own (use the
  /// ones below); its log, token, addresses and time-outs are used as given.
  tcp_options control;
  /// This rank's GPU. NCCL refuses two ranks of a job on one GPU.
  int device = 0;
  /// For start(): the control channel to connect and NCCL's communicators to form.
  std::chrono::milliseconds setup_timeout{300000};
  /// A transfer or collective not finished on the GPU this long after it was queued fails the
  /// transport (its communicators are aborted, so no stream waits forever).
  std::chrono::milliseconds op_timeout{600000};
  /// Called on the progress thread once recv(src, tg) would return without waiting. Must return
  /// quickly.
  std::function<void(int src, const tag& tg)> on_arrival;
  /// Called once, on the thread that noticed, when the transport fails; `why` names this rank
  /// and the cause (the text later calls append to their own).
  std::function<void(const std::string& why)> on_failure;
};

/// "nccl_id=<hex>": a fresh NCCL unique id as a rendezvous blob word. Only the job's first rank
/// (node 0, local rank 0) calls it, before rendezvous_client::join, and registers with it; the id
/// names a bootstrap socket of this process, which must live until every rank has started.
core::result<std::string> make_nccl_blob();

class nccl_group;

class nccl_transport final : public transport {
 public:
  /// Binds the control channel (step 1, before rendezvous_client::join: port() is the
  /// registration's data_port). Fails when the port is taken.
  static core::result<std::unique_ptr<nccl_transport>> bind(nccl_options opt);
  /// Leaves the communicators and the control channel; waits up to the control channel's linger
  /// for this rank's sends to finish on the GPU first.
  ~nccl_transport() override;
  nccl_transport(const nccl_transport&) = delete;
  nccl_transport& operator=(const nccl_transport&) = delete;

  /// The control channel's port.
  std::uint16_t port() const;
  /// Step 2, after join and before rendezvous_client::start, on every rank at once (collective):
  /// starts the control channel on the table's data endpoints and waits until it connects every
  /// pair, creates the job's communicator from the nccl_id in rank 0's blob and one two-rank
  /// communicator per ordered pair, and connects them all. Fails
  /// naming this rank and the cause (a duplicate GPU, a peer that never came, ...).
  core::status start(int rank, const job_table& table);

  std::string name() const override { return "nccl"; }
  /// -1 until start().
  int rank() const override;
  /// Ranks in the job (0 until start()).
  int size() const;

  /// Sends `t` to `dst` (itself included). A host tensor goes inside its control record; a device
  /// tensor (on this rank's GPU) by ncclSend, queued after t's ready event when it has one; to
  /// itself, either is delivered as it is (no copy).
  /// REQUIRES for a device tensor: record_ready(t) by the backend that wrote it, or the work that
  /// wrote it has finished. The caller does not modify t afterwards (the transport holds it until
  /// the GPU has read it).
  void send(int dst, tensor t, const tag& tg) override;
  /// The tensor `src` sent under `tg`, waiting at most `timeout` for its control record. A device
  /// tensor comes back as soon as its transfer is queued on the GPU: call wait_ready(t) on the
  /// consuming backend before using it (its memory returns to the pool after every stream that
  /// waited for it has passed that point).
  tensor recv(int src, const tag& tg, std::chrono::milliseconds timeout) override;
  /// True when recv(src, tg) would not wait.
  bool ready(int src, const tag& tg) override;

  /// The whole job as a collective group (members 0..size()-1).
  nccl_group& world();
  /// A communicator for the group `members` (global ranks; position = rank within the group).
  /// Collective over the job: every rank calls split the same number of times, each passing the
  /// group it belongs to (or an empty one to stay out); the groups of one call must not overlap.
  /// The group lives as long as the transport.
  core::result<nccl_group*> split(const std::vector<int>& members);

  /// Waits until every tensor sent so far has left: device tensors read by the GPU, control
  /// records and host tensors handed to the kernel. False on timeout or failure.
  bool flush(std::chrono::milliseconds timeout);
  /// Fails the transport now with `why` (as an error would): aborts the communicators, closes the
  /// control channel at once, and makes later calls throw.
  void abort(const std::string& why);
  /// Why the transport failed; empty while it works.
  std::string failure() const;

  struct impl;

 private:
  explicit nccl_transport(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

/// Collectives over one NCCL communicator, on device tensors of this rank's GPU. Each op is queued
/// after the work already on `stream` and work queued on `stream` afterwards sees its result
/// (events, no host wait); the op itself runs on the group's own stream. Every member calls the
/// same ops in the same order. Sums are NCCL's: reproducible run to run on the same machines and
/// NCCL version, but not in the fixed rank order of transport::ordered_sum. `tg` only names the op
/// in errors. Flat tensors; slices as in transport.hpp (numel divisible by the group size).
class nccl_group {
 public:
  const std::vector<int>& members() const { return members_; }
  /// This rank's position in members().
  int position() const { return position_; }

  /// x = sum over the group of x (fp32, bf16, fp16, fp64, int32).
  void all_reduce(tensor& x, const tag& tg, CUstream_st* stream);
  /// slice = this member's slice of the sum of x. REQUIRES: slice.numel() * size == x.numel().
  void reduce_scatter(const tensor& x, tensor& slice, const tag& tg, CUstream_st* stream);
  /// out = every member's slice, in member order (any dtype).
  void all_gather(const tensor& slice, tensor& out, const tag& tg, CUstream_st* stream);
  /// x = root's x on every member (root: a global rank in the group; any dtype).
  void broadcast(tensor& x, int root, const tag& tg, CUstream_st* stream);

  struct state;
  /// Made by nccl_transport (world(), split()).
  nccl_group(nccl_transport::impl& owner, std::unique_ptr<state> st, std::vector<int> members,
             int position);
  ~nccl_group();
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;

 private:
  friend struct nccl_transport::impl;

  nccl_transport::impl& owner_;
  std::unique_ptr<state> st_;
  std::vector<int> members_;
  int position_;
};

}  // namespace troupe::transport
