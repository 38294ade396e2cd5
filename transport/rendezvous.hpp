// The rendezvous: how the processes of a job find each other. The launcher of node 0 runs a
// server at master_addr:master_port; every worker connects, presents the job token and says who
// it is (node rank, local rank, the host and port of its data transport, an opaque blob such as
// an NCCL unique id). Once world_size workers have registered, the server assigns global ranks
// (node_rank × local_world_size + local_rank, so the same launch always gives the same ranks) and
// sends every worker the whole table. Workers then set up their transports and report ready; when
// all have, the server tells them to start, together.
//
// Wire (docs/networking.md): length-prefixed frames, a 12-byte header (u32 magic "TRRV",
// u16 version, u16 type, u32 body length) and a little-endian body. Connections without the job
// token, with garbage or with oversized frames are refused and logged; the job is not disturbed.
// Time-outs name the ranks and nodes that never arrived and the ones that did, with their hosts.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "transport/tcp_wire.hpp"

namespace troupe::transport {

/// Frame constants of the rendezvous protocol.
struct rendezvous_frame {
  static constexpr std::uint32_t magic = 0x56525254;  // "TRRV" in little-endian byte order
  static constexpr std::uint16_t version = 1;
  static constexpr std::size_t header_size = 12;
  enum type : std::uint16_t {
    register_worker = 1,  // worker -> server: token hash, node rank, local rank, host, port, blob
    table = 2,            // server -> worker: your rank, then every rank's row
    ready = 3,            // worker -> server: transports are up
    start = 4,            // server -> worker: everyone is ready
    reject = 5,           // server -> worker: why this worker cannot join (then closes)
    abort = 6,            // server -> worker: why the job cannot form (then closes)
  };
  /// Header and body of one frame.
  static std::vector<char> encode(type t, const std::vector<char>& body);
  /// Why the `header_size` bytes at `bytes` are not the header of a frame whose body has at most
  /// `max_body` bytes; "" when they are, with `frame_type` and `body_length` set. The type is not
  /// checked: what a side accepts depends on where it is in the protocol.
  static std::string decode_head(const char* bytes, std::uint32_t max_body,
                                 std::uint16_t& frame_type, std::uint32_t& body_length);
};

/// One worker of the job, as the table lists it.
struct worker_entry {
  int rank = -1;
  int node_rank = -1;
  int local_rank = -1;
  endpoint data;     // where its data transport listens
  std::string blob;  // opaque, from the worker
};

/// Every worker, indexed by global rank.
struct job_table {
  std::vector<worker_entry> workers;
  /// workers[r].data for every r: the address table a tcp_transport starts with.
  std::vector<endpoint> data_endpoints() const;
};

// The bodies of the frames, as pure functions of bytes so that the fuzz target
// (fuzz/fuzz_rendezvous.cpp) reaches the parsers without sockets. A decoder accepts exactly what
// its encoder writes: every field present, nothing after the last.

/// A register_worker body: the job-token hash and who the worker is (`worker.rank` unused).
struct registration {
  std::uint64_t token = 0;
  worker_entry worker;
};
std::vector<char> encode_registration(const registration& r);
/// The registration in `size` bytes, or nullopt when they are not one.
std::optional<registration> decode_registration(const char* data, std::size_t size);

/// A table body as worker `rank` receives it: its rank, then every worker's row.
std::vector<char> encode_table(int rank, const job_table& table);
/// The receiving worker's rank and the table (rows numbered by position), or nullopt when the
/// bytes are not a table with at least one row and the rank among them.
std::optional<std::pair<int, job_table>> decode_table(const char* data, std::size_t size);

/// A reject or abort body: why.
std::vector<char> encode_reason(std::string_view why);
/// The reason in `size` bytes; what a malformed body holds of it (possibly nothing).
std::string decode_reason(const char* data, std::size_t size);

struct rendezvous_server_options {
  /// master_addr:master_port.
  endpoint listen;
  std::string job_token;
  int world_size = 1;
  /// Workers per node; world_size / local_world_size nodes, numbered from 0.
  int local_world_size = 1;
  /// For every worker to register, then again for every worker to report ready.
  std::chrono::milliseconds timeout{300000};
  /// A connection that has not registered after this long is closed.
  std::chrono::milliseconds hello_timeout{10000};
  /// Largest frame body accepted (a registration is tiny; its blob a few hundred bytes).
  std::uint32_t max_frame_bytes = 1u << 20;
  /// Receives one line per refused connection or departed worker; empty = standard error.
  std::function<void(const std::string&)> log;
};

class rendezvous_server {
 public:
  /// Listens on options.listen and starts serving on a background thread. A port in use gives
  /// "port P on H is already in use" with a hint to pick another --master_port.
  static core::result<std::unique_ptr<rendezvous_server>> bind(rendezvous_server_options opt);
  ~rendezvous_server();
  rendezvous_server(const rendezvous_server&) = delete;
  rendezvous_server& operator=(const rendezvous_server&) = delete;

  /// The port listened on (the chosen one when options.listen.port was 0).
  std::uint16_t port() const;
  /// Blocks until every worker has been told to start (the table) or the job could not form
  /// (time-out, a worker that left): then every worker still connected was told why, too.
  core::result<job_table> wait();

 private:
  struct impl;
  explicit rendezvous_server(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

struct rendezvous_client_options {
  /// master_addr:master_port.
  endpoint master;
  std::string job_token;
  int node_rank = 0;
  int local_rank = 0;
  /// How peers reach this worker's data port; empty = the address the server sees it from.
  std::string host;
  std::uint16_t data_port = 0;
  std::string blob;
  /// For reaching the server (it may start later), then for the table, then for the start.
  std::chrono::milliseconds timeout{300000};
  /// Largest frame accepted from the server (the table grows with the job).
  std::uint32_t max_frame_bytes = 1u << 28;
  /// Register again after a refusal, until the timeout: a restarted attempt of a multi-node job
  /// may reach the previous attempt's rendezvous, still closing, which refuses this attempt's
  /// job token. Off for a first attempt, where a refusal is a configuration error.
  bool retry_refused = false;
};

class rendezvous_client {
 public:
  /// Connects (retrying until the timeout), registers and waits for the table.
  static core::result<std::unique_ptr<rendezvous_client>> join(rendezvous_client_options opt);
  ~rendezvous_client();
  rendezvous_client(const rendezvous_client&) = delete;
  rendezvous_client& operator=(const rendezvous_client&) = delete;

  /// This worker's global rank.
  int rank() const;
  const job_table& table() const;
  /// Reports this worker ready and waits until every worker has: the job's common start line.
  core::status start();

 private:
  struct impl;
  explicit rendezvous_client(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::transport
