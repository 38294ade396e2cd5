// The tcp transport: CPU tensors between processes over TCP (Boost.Asio).
//
// Every rank listens on one port and, once it knows the job's address table (start()), opens one
// connection to every other rank; it writes its tensors on that connection and reads the tensors
// of rank r from the connection r opened to it. A background IO thread does all socket work:
// send() queues the tensor handle (no copy; the caller must not modify its storage afterwards, as
// the transport interface requires) and the IO thread writes a fixed header plus the raw bytes;
// incoming frames land in a stash keyed by (src, tag), so recv/ready behave as in the local
// transport and two ranks sending large tensors to each other cannot deadlock (reads never wait on
// writes).
//
// Failures are prompt and named: when the connection from a peer drops, every pending and later
// recv from that peer of a tensor not already stashed throws "connection to rank 2
// (10.0.0.3:29501) lost (...)". A connection that presents the wrong job token, a bad magic, or a
// malformed or oversized frame is logged and closed; the job goes on.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "transport/tcp_wire.hpp"
#include "transport/transport.hpp"

namespace troupe::transport {

struct tcp_options {
  /// Where this rank accepts its peers' connections; port 0 picks a free port (see port()).
  endpoint listen{"0.0.0.0", 0};
  /// Every process of the job presents the same token; connections with another are refused.
  std::string job_token;
  /// Largest tensor payload accepted in one frame; a larger one closes the connection.
  std::uint64_t max_frame_bytes = std::uint64_t{4} << 30;
  /// How long start() keeps retrying to reach each peer before declaring it unreachable.
  std::chrono::milliseconds connect_timeout{30000};
  /// How long an accepted connection may take to introduce itself before it is closed.
  std::chrono::milliseconds hello_timeout{10000};
  /// How long the destructor waits for queued sends to leave before closing.
  std::chrono::milliseconds linger{10000};
  /// Receives one line per refused connection or lost peer; empty = standard error.
  std::function<void(const std::string&)> log;
  /// Called on the IO thread once a tensor from `src` under `tg` is in the stash (ready() is
  /// true), so that code which must not block (an event-based actor) can be told to take it.
  /// Must return quickly: the IO thread reads nothing else meanwhile.
  std::function<void(int src, const tag& tg)> on_arrival;
  /// Called on the IO thread, once per peer, when its connection is lost or it misbehaved (not
  /// when it closes its transport normally); `why` is the text recv would throw.
  std::function<void(int rank, const std::string& why)> on_peer_lost;
  /// Test only (TROUPE_FAULT=drop, core/fault.hpp): in this step, the connection that carries this
  /// rank's first tensor is closed halfway through that tensor's bytes, as a pulled cable or a
  /// dead switch port would cut it. -1 = never.
  std::int64_t drop_step = -1;
  /// How the dropping names itself in the log and in the error peers get (the fault's label).
  std::string drop_label;
};

class tcp_transport final : public transport {
 public:
  /// Binds the listening socket. Fails with a clear error when the port is taken.
  static core::result<std::unique_ptr<tcp_transport>> bind(tcp_options opt);
  /// Sends queued tensors (up to `linger`), says goodbye to every peer, and closes.
  ~tcp_transport() override;
  tcp_transport(const tcp_transport&) = delete;
  tcp_transport& operator=(const tcp_transport&) = delete;

  /// The port this rank listens on (the one chosen when tcp_options::listen.port was 0).
  std::uint16_t port() const;
  /// Sets this endpoint's rank and every rank's address (indexed by rank; peers[rank] is this
  /// one), starts accepting peers and connects to all of them in the background.
  /// REQUIRES: called once, before send(); 0 <= rank < peers.size().
  void start(int rank, std::vector<endpoint> peers);

  std::string name() const override { return "tcp"; }
  /// -1 until start().
  int rank() const override;
  /// Queues `t` (a host tensor) for rank `dst`; returns at once. Throws core::failure when the
  /// connection to dst is known to be lost.
  void send(int dst, tensor t, const tag& tg) override;
  tensor recv(int src, const tag& tg, std::chrono::milliseconds timeout) override;
  bool ready(int src, const tag& tg) override;

  /// Waits until this rank is connected to every peer in both directions, so that from then on
  /// the loss of any peer is noticed at once. Fails naming the peers that could not be reached
  /// or have not connected within `timeout`. REQUIRES: start() was called.
  core::status wait_connected(std::chrono::milliseconds timeout);
  /// Waits until every queued tensor has been handed to the kernel (or its peer is lost); false
  /// on timeout.
  bool flush(std::chrono::milliseconds timeout);
  /// Closes every connection at once without a goodbye, as a crash would; later calls throw.
  /// For a worker that has failed and wants its peers to learn it now rather than at a timeout.
  void abort();

 private:
  struct impl;
  explicit tcp_transport(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::transport
