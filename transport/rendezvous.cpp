// The rendezvous server runs on its own IO thread and keeps every decision there (who holds which
// rank, which phase the job is in); wait() only reads the outcome once it is published. The
// client is synchronous: it runs its own io_context in the caller's thread until each step is done
// or its deadline passes.
#include "transport/rendezvous.hpp"

#include <array>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "transport/tcp_asio.hpp"

namespace troupe::transport {

namespace asio = boost::asio;
using boost::asio::ip::tcp;
using clock_type = std::chrono::steady_clock;

std::vector<char> rendezvous_frame::encode(type t, const std::vector<char>& body) {
  wire_writer w;
  w.put(magic);
  w.put(version);
  w.put(static_cast<std::uint16_t>(t));
  w.put(static_cast<std::uint32_t>(body.size()));
  auto out = std::move(w.bytes());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

std::vector<endpoint> job_table::data_endpoints() const {
  std::vector<endpoint> out;
  for (const auto& w : workers) out.push_back(w.data);
  return out;
}

std::string rendezvous_frame::decode_head(const char* bytes, std::uint32_t max_body,
                                          std::uint16_t& frame_type, std::uint32_t& body_length) {
  wire_reader r(bytes, header_size);
  if (r.get<std::uint32_t>() != magic) return "bad magic (not a troupe rendezvous frame)";
  auto v = r.get<std::uint16_t>();
  if (v != version)
    return "protocol version " + std::to_string(v) + ", expected " + std::to_string(version);
  frame_type = r.get<std::uint16_t>();
  body_length = r.get<std::uint32_t>();
  if (body_length > max_body)
    return "a frame of " + std::to_string(body_length) + " bytes, over the limit of " +
           std::to_string(max_body);
  return {};
}

namespace {

void put_row(wire_writer& w, const worker_entry& e) {
  w.put(static_cast<std::int32_t>(e.node_rank));
  w.put(static_cast<std::int32_t>(e.local_rank));
  w.put_bytes(e.data.host);
  w.put(e.data.port);
  w.put_bytes(e.blob);
}

void get_row(wire_reader& r, worker_entry& e) {
  e.node_rank = r.get<std::int32_t>();
  e.local_rank = r.get<std::int32_t>();
  e.data.host = r.get_bytes();
  e.data.port = r.get<std::uint16_t>();
  e.blob = r.get_bytes();
}

// The fewest bytes a row takes: two ranks, two empty strings' lengths and a port.
constexpr std::size_t min_row_bytes = 4 + 4 + 4 + 2 + 4;

}  // namespace

std::vector<char> encode_registration(const registration& reg) {
  wire_writer w;
  w.put(reg.token);
  put_row(w, reg.worker);
  return std::move(w.bytes());
}

std::optional<registration> decode_registration(const char* data, std::size_t size) {
  wire_reader r(data, size);
  registration reg;
  reg.token = r.get<std::uint64_t>();
  get_row(r, reg.worker);
  if (r.failed() || !r.at_end()) return std::nullopt;
  return reg;
}

std::vector<char> encode_table(int rank, const job_table& table) {
  wire_writer w;
  w.put(static_cast<std::int32_t>(rank));
  w.put(static_cast<std::int32_t>(table.workers.size()));
  for (const auto& e : table.workers) put_row(w, e);
  return std::move(w.bytes());
}

std::optional<std::pair<int, job_table>> decode_table(const char* data, std::size_t size) {
  wire_reader r(data, size);
  const int rank = r.get<std::int32_t>();
  const int world = r.get<std::int32_t>();
  // The row count is checked against the bytes there are before anything is allocated for it.
  if (r.failed() || world < 1 || rank < 0 || rank >= world ||
      static_cast<std::size_t>(world) > (size - 8) / min_row_bytes)
    return std::nullopt;
  job_table table;
  table.workers.resize(world);
  for (int w = 0; w < world; ++w) {
    table.workers[w].rank = w;
    get_row(r, table.workers[w]);
  }
  if (r.failed() || !r.at_end()) return std::nullopt;
  return std::pair{rank, std::move(table)};
}

std::vector<char> encode_reason(std::string_view why) {
  wire_writer w;
  w.put_bytes(why);
  return std::move(w.bytes());
}

std::string decode_reason(const char* data, std::size_t size) {
  wire_reader r(data, size);
  return r.get_bytes();
}

namespace {

std::string describe(const worker_entry& w) {
  return "rank " + std::to_string(w.rank) + " (node " + std::to_string(w.node_rank) +
         ", local rank " + std::to_string(w.local_rank) + ", host " + w.data.host + ")";
}

struct session {
  explicit session(asio::io_context& io) : sock(io), hello_timer(io) {}
  tcp::socket sock;
  asio::steady_timer hello_timer;
  std::string name;  // ip:port as seen here
  std::string ip;
  std::array<char, rendezvous_frame::header_size> hdr{};
  std::uint16_t type = 0;
  std::vector<char> body;
  int rank = -1;
  bool ready = false;
  std::deque<std::vector<char>> outq;
  bool writing = false;
  bool close_when_sent = false;
  bool awaited = false;  // its last frame must leave before wait() returns
};

}  // namespace

// --- server ------------------------------------------------------------------------------------

struct rendezvous_server::impl {
  explicit impl(rendezvous_server_options o)
      : opt(std::move(o)),
        log(detail::logger_or_stderr(opt.log, "rendezvous")),
        token(token_hash(opt.job_token)),
        nodes(opt.world_size / opt.local_world_size),
        slots(opt.world_size),
        entries(opt.world_size) {}

  rendezvous_server_options opt;
  std::function<void(const std::string&)> log;
  std::uint64_t token;
  int nodes;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::optional<tcp::acceptor> acceptor;
  asio::steady_timer deadline{io};
  std::uint16_t port = 0;
  std::thread thread;

  // IO thread only.
  enum class phase { registering, forming, done } ph = phase::registering;
  std::vector<std::shared_ptr<session>> slots;
  std::vector<worker_entry> entries;
  int registered = 0;
  std::set<std::shared_ptr<session>> sessions;
  int awaiting = 0;
  std::optional<core::result<job_table>> decided;
  bool closing = false;

  std::mutex mu;
  std::condition_variable cv;
  std::optional<core::result<job_table>> outcome;

  std::string where() const { return opt.listen.host + ":" + std::to_string(port); }

  void begin() {
    deadline.expires_after(opt.timeout);
    deadline.async_wait([this](boost::system::error_code ec) {
      if (!ec && !closing) timed_out();
    });
    start_accepting();
  }

  void start_accepting() {
    detail::accept_connections(
        *acceptor, closing, log,
        [this](tcp::socket sock) {
          auto s = std::make_shared<session>(io);
          s->sock = std::move(sock);
          s->name = detail::remote_name(s->sock);
          boost::system::error_code ignored;
          s->ip = s->sock.remote_endpoint(ignored).address().to_string();
          sessions.insert(s);
          s->hello_timer.expires_after(opt.hello_timeout);
          s->hello_timer.async_wait([this, s](boost::system::error_code e) {
            if (!e && !closing && s->rank < 0 && sessions.count(s))
              refuse(s, "it did not register within " + std::to_string(opt.hello_timeout.count()) +
                            " ms");
          });
          read_frame(s);
        });
  }

  void read_frame(const std::shared_ptr<session>& s) {
    asio::async_read(s->sock, asio::buffer(s->hdr),
                     [this, s](boost::system::error_code ec, std::size_t) {
                       if (closing || !sessions.count(s)) return;
                       if (ec) return ended(s, ec);
                       std::uint32_t length = 0;
                       std::string why = rendezvous_frame::decode_head(
                           s->hdr.data(), opt.max_frame_bytes, s->type, length);
                       if (!why.empty()) return refuse(s, why);
                       s->body.resize(length);
                       asio::async_read(s->sock, asio::buffer(s->body),
                                        [this, s](boost::system::error_code ec, std::size_t) {
                                          if (closing || !sessions.count(s)) return;
                                          if (ec) return ended(s, ec);
                                          on_frame(s);
                                        });
                     });
  }

  void on_frame(const std::shared_ptr<session>& s) {
    switch (s->type) {
      case rendezvous_frame::register_worker:
        return on_register(s);
      case rendezvous_frame::ready:
        if (s->rank < 0) return refuse(s, "it reported ready without registering");
        if (ph != phase::forming)
          return refuse(s, "rank " + std::to_string(s->rank) + " reported ready before the table");
        s->ready = true;
        read_frame(s);
        for (auto& slot : slots)
          if (!slot || !slot->ready) return;
        return launch();
      default:
        return refuse(s, "unexpected frame type " + std::to_string(s->type));
    }
  }

  void on_register(const std::shared_ptr<session>& s) {
    if (s->rank >= 0) return refuse(s, "rank " + std::to_string(s->rank) + " registered twice");
    auto reg = decode_registration(s->body.data(), s->body.size());
    if (!reg) return refuse(s, "a malformed registration");
    if (reg->token != token) return reject(s, "wrong job token");
    worker_entry& w = reg->worker;
    if (w.node_rank < 0 || w.node_rank >= nodes)
      return reject(s, "node rank " + std::to_string(w.node_rank) + " is outside 0.." +
                           std::to_string(nodes - 1) + " (" + std::to_string(opt.world_size) +
                           " workers, " + std::to_string(opt.local_world_size) + " per node)");
    if (w.local_rank < 0 || w.local_rank >= opt.local_world_size)
      return reject(s, "local rank " + std::to_string(w.local_rank) + " is outside 0.." +
                           std::to_string(opt.local_world_size - 1));
    if (ph != phase::registering) return reject(s, "the job has already formed");
    w.rank = w.node_rank * opt.local_world_size + w.local_rank;
    if (slots[w.rank])
      return reject(s, "rank " + std::to_string(w.rank) + " (node " + std::to_string(w.node_rank) +
                           ", local rank " + std::to_string(w.local_rank) +
                           ") is already registered from " + entries[w.rank].data.host);
    if (w.data.host.empty()) w.data.host = s->ip;
    s->rank = w.rank;
    s->hello_timer.cancel();
    slots[w.rank] = s;
    entries[w.rank] = std::move(w);
    ++registered;
    log(describe(entries[s->rank]) + " registered from " + s->name + " (" +
        std::to_string(registered) + " of " + std::to_string(opt.world_size) + ")");
    read_frame(s);
    if (registered == opt.world_size) form();
  }

  void form() {
    ph = phase::forming;
    const job_table table{entries};
    for (int r = 0; r < opt.world_size; ++r)
      send(slots[r], rendezvous_frame::encode(rendezvous_frame::table, encode_table(r, table)),
           false, false);
    deadline.expires_after(opt.timeout);
    deadline.async_wait([this](boost::system::error_code ec) {
      if (!ec && !closing) timed_out();
    });
  }

  void launch() {
    ph = phase::done;
    deadline.cancel();
    for (auto& s : slots)
      send(s, rendezvous_frame::encode(rendezvous_frame::start, {}), true, true);
    decided = job_table{entries};
    publish_when_sent();
  }

  void fail(const std::string& why, const std::string& hint) {
    ph = phase::done;
    deadline.cancel();
    for (auto& s : slots)
      if (s) send(s, rendezvous_frame::encode(rendezvous_frame::abort, encode_reason(why)), true, true);
    log(why);
    decided = core::error::make(why, hint);
    publish_when_sent();
  }

  void timed_out() {
    std::string took = " after " + std::to_string(opt.timeout.count()) + " ms";
    if (ph == phase::registering) {
      std::string missing, arrived;
      auto add = [](std::string& list, const std::string& item) {
        list += (list.empty() ? "" : ", ") + item;
      };
      for (int node = 0; node < nodes; ++node) {
        int base = node * opt.local_world_size;
        std::string host;
        for (int l = 0; l < opt.local_world_size; ++l)
          if (slots[base + l]) host = entries[base + l].data.host;
        if (host.empty()) {
          add(missing, "node " + std::to_string(node) + " (ranks " + std::to_string(base) + "-" +
                           std::to_string(base + opt.local_world_size - 1) +
                           "; none of its workers arrived)");
          continue;
        }
        for (int l = 0; l < opt.local_world_size; ++l) {
          if (slots[base + l])
            add(arrived, describe(entries[base + l]));
          else
            add(missing, "rank " + std::to_string(base + l) + " (node " + std::to_string(node) +
                             ", local rank " + std::to_string(l) + ", on host " + host + ")");
        }
      }
      return fail("rendezvous at " + where() + " timed out" + took + " with " +
                      std::to_string(registered) + " of " + std::to_string(opt.world_size) +
                      " workers registered; missing: " + missing +
                      "; arrived: " + (arrived.empty() ? "none" : arrived),
                  "start every node's launcher with the same --master_addr, --master_port, "
                  "--worker_num and job token and its own --node_rank; a worker that crashed "
                  "while starting says why in its log");
    }
    std::string late;
    for (auto& s : slots)
      if (!s->ready) late += (late.empty() ? "" : ", ") + describe(entries[s->rank]);
    fail("rendezvous at " + where() + " timed out" + took +
             " waiting for workers to report ready: " + late,
         "these workers received the table but did not set up their transports; see their logs");
  }

  void send(const std::shared_ptr<session>& s, std::vector<char> frame, bool last, bool awaited) {
    s->outq.push_back(std::move(frame));
    if (last) s->close_when_sent = true;
    if (awaited && !s->awaited) {
      s->awaited = true;
      ++awaiting;
    }
    write_next(s);
  }

  void write_next(const std::shared_ptr<session>& s) {
    if (s->writing || s->outq.empty()) return;
    s->writing = true;
    asio::async_write(s->sock, asio::buffer(s->outq.front()),
                      [this, s](boost::system::error_code ec, std::size_t) {
                        if (closing || !sessions.count(s)) return;
                        s->writing = false;
                        s->outq.pop_front();
                        if (ec) return ended(s, ec);
                        if (s->outq.empty() && s->close_when_sent) return drop(s);
                        write_next(s);
                      });
  }

  // Tells a worker why it cannot join, then closes; the others are not affected.
  void reject(const std::shared_ptr<session>& s, const std::string& why) {
    log("refused a worker from " + s->name + ": " + why);
    send(s, rendezvous_frame::encode(rendezvous_frame::reject, encode_reason(why)), true, false);
  }

  // Garbage or a protocol violation: close without an answer.
  void refuse(const std::shared_ptr<session>& s, const std::string& why) {
    log("refused a connection from " + s->name + ": " + why);
    depart(s, why);
  }

  void ended(const std::shared_ptr<session>& s, boost::system::error_code ec) {
    if (s->rank < 0 && !s->close_when_sent)
      log("connection from " + s->name + " ended before it registered (" + ec.message() + ")");
    depart(s, ec.message());
  }

  // A session goes away; a worker that held a rank is missing again (while registering) or
  // breaks the job (once the table is out).
  void depart(const std::shared_ptr<session>& s, const std::string& why) {
    int r = s->rank;
    drop(s);
    if (r < 0 || slots[r] != s || ph == phase::done) return;
    if (ph == phase::registering) {
      log(describe(entries[r]) + " left before the job formed (" + why + "); waiting for it again");
      slots[r].reset();
      --registered;
      return;
    }
    slots[r].reset();
    fail(describe(entries[r]) + " left the rendezvous at " + where() + " before the job started (" +
             why + ")",
         "see that worker's log");
  }

  void drop(const std::shared_ptr<session>& s) {
    boost::system::error_code ignored;
    s->sock.close(ignored);
    s->hello_timer.cancel();
    sessions.erase(s);
    if (s->awaited) {
      s->awaited = false;
      --awaiting;
      publish_when_sent();
    }
  }

  void publish_when_sent() {
    if (!decided || awaiting > 0) return;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!outcome) outcome = std::move(*decided);
    }
    cv.notify_all();
  }

  void close_all() {
    closing = true;
    boost::system::error_code ignored;
    if (acceptor) acceptor->close(ignored);
    deadline.cancel();
    for (auto& s : sessions) {
      s->sock.close(ignored);
      s->hello_timer.cancel();
    }
    sessions.clear();
    slots.clear();
  }
};

rendezvous_server::rendezvous_server(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

core::result<std::unique_ptr<rendezvous_server>> rendezvous_server::bind(
    rendezvous_server_options opt) {
  if (opt.world_size < 1 || opt.local_world_size < 1 || opt.world_size % opt.local_world_size != 0)
    return core::error::make("a job of " + std::to_string(opt.world_size) + " workers with " +
                                 std::to_string(opt.local_world_size) +
                                 " per node does not split into whole nodes",
                             "--worker_num must be a multiple of --local_worker_num");
  auto p = std::make_unique<impl>(std::move(opt));
  auto acc = detail::open_acceptor(p->io, p->opt.listen, "pick another --master_port");
  if (!acc) return acc.err();
  p->acceptor.emplace(std::move(acc.value()));
  p->port = p->acceptor->local_endpoint().port();
  impl* raw = p.get();
  asio::post(raw->io, [raw] { raw->begin(); });
  p->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<rendezvous_server>(new rendezvous_server(std::move(p)));
}

rendezvous_server::~rendezvous_server() {
  auto& m = *impl_;
  asio::post(m.io, [&m] {
    m.close_all();
    m.work.reset();
  });
  m.thread.join();
}

std::uint16_t rendezvous_server::port() const { return impl_->port; }

core::result<job_table> rendezvous_server::wait() {
  std::unique_lock<std::mutex> lk(impl_->mu);
  impl_->cv.wait(lk, [&] { return impl_->outcome.has_value(); });
  return *impl_->outcome;
}

// --- client ------------------------------------------------------------------------------------

struct rendezvous_client::impl {
  explicit impl(rendezvous_client_options o) : opt(std::move(o)) {}
  rendezvous_client_options opt;
  asio::io_context io;
  tcp::socket sock{io};
  int rank = -1;
  job_table table;
  bool rejected = false;  // the last read was the server's refusal

  std::string master() const { return opt.master.to_string(); }
  std::string me() const {
    return "node " + std::to_string(opt.node_rank) + ", local rank " +
           std::to_string(opt.local_rank);
  }

  // Runs one asynchronous operation (started by `op`, which calls its argument when done) on
  // this thread until it completes or `until` passes; then it is cancelled and reports timed_out.
  template <class Op>
  boost::system::error_code run(clock_type::time_point until, Op op) {
    boost::system::error_code result = asio::error::would_block;
    bool late = false;
    asio::steady_timer timer(io, until);
    timer.async_wait([&](boost::system::error_code ec) {
      if (ec) return;
      late = true;
      boost::system::error_code ignored;
      sock.cancel(ignored);
    });
    op([&](boost::system::error_code ec) {
      result = ec;
      timer.cancel();
    });
    io.restart();
    io.run();
    return late && result == asio::error::operation_aborted ? asio::error::timed_out : result;
  }

  core::status connect(clock_type::time_point until) {
    std::string last;
    while (true) {
      boost::system::error_code ec;
      tcp::resolver resolver(io);
      auto found = resolver.resolve(opt.master.host, std::to_string(opt.master.port),
                                    tcp::resolver::numeric_service, ec);
      if (!ec)
        ec = run(until, [&](auto done) {
          asio::async_connect(
              sock, found, [done](boost::system::error_code e, const tcp::endpoint&) { done(e); });
        });
      if (!ec) {
        boost::system::error_code ignored;
        sock.set_option(tcp::no_delay(true), ignored);
        return {};
      }
      last = ec.message();
      boost::system::error_code ignored;
      sock.close(ignored);
      // The launcher that serves the rendezvous may start after this worker: try again.
      if (clock_type::now() + std::chrono::milliseconds(100) >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return core::error::make("cannot reach the rendezvous at " + master() + " within " +
                                 std::to_string(opt.timeout.count()) + " ms: " + last,
                             "start the launcher of node 0 first, and check --master_addr and "
                             "--master_port");
  }

  core::status write(clock_type::time_point until, const std::vector<char>& frame) {
    auto ec = run(until, [&](auto done) {
      asio::async_write(sock, asio::buffer(frame),
                        [done](boost::system::error_code e, std::size_t) { done(e); });
    });
    if (ec)
      return core::error::make("lost the rendezvous at " + master() + " while writing (" +
                               ec.message() + ")");
    return {};
  }

  // The next frame from the server: its type and body, or an error saying what came instead.
  core::result<std::pair<std::uint16_t, std::vector<char>>> read(clock_type::time_point until,
                                                                 const std::string& awaited) {
    std::array<char, rendezvous_frame::header_size> hdr{};
    auto ec = run(until, [&](auto done) {
      asio::async_read(sock, asio::buffer(hdr),
                       [done](boost::system::error_code e, std::size_t) { done(e); });
    });
    std::uint16_t type = 0;
    std::uint32_t length = 0;
    std::string why;
    if (!ec) why = rendezvous_frame::decode_head(hdr.data(), opt.max_frame_bytes, type, length);
    std::vector<char> body;
    if (!ec && why.empty()) {
      body.resize(length);
      ec = run(until, [&](auto done) {
        asio::async_read(sock, asio::buffer(body),
                         [done](boost::system::error_code e, std::size_t) { done(e); });
      });
    }
    if (ec == asio::error::timed_out)
      return core::error::make("no " + awaited + " from the rendezvous at " + master() +
                                   " within " + std::to_string(opt.timeout.count()) +
                                   " ms (this is " + me() + ")",
                               "the launcher serving the rendezvous names the workers that did "
                               "not arrive");
    if (ec)
      return core::error::make("lost the rendezvous at " + master() + " while waiting for " +
                               awaited + " (" + ec.message() + "; this is " + me() + ")");
    if (!why.empty()) return core::error::make("the rendezvous at " + master() + " sent " + why);
    if (type == rendezvous_frame::reject || type == rendezvous_frame::abort) {
      std::string reason = decode_reason(body.data(), body.size());
      rejected = type == rendezvous_frame::reject;
      if (rejected)
        return core::error::make(
            "the rendezvous at " + master() + " refused this worker (" + me() + "): " + reason,
            "every process of a job needs the same job token and launch "
            "arguments");
      return core::error::make("the job could not form: " + reason);
    }
    return std::pair{type, std::move(body)};
  }

  core::status parse_table(const std::vector<char>& body) {
    auto got = decode_table(body.data(), body.size());
    if (!got) return core::error::make("the rendezvous at " + master() + " sent a malformed table");
    rank = got->first;
    table = std::move(got->second);
    return {};
  }
};

rendezvous_client::rendezvous_client(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
rendezvous_client::~rendezvous_client() = default;

core::result<std::unique_ptr<rendezvous_client>> rendezvous_client::join(
    rendezvous_client_options opt) {
  auto p = std::make_unique<impl>(std::move(opt));
  auto until = clock_type::now() + p->opt.timeout;
  registration reg;
  reg.token = token_hash(p->opt.job_token);
  reg.worker.node_rank = p->opt.node_rank;
  reg.worker.local_rank = p->opt.local_rank;
  reg.worker.data = {p->opt.host, p->opt.data_port};
  reg.worker.blob = p->opt.blob;
  const std::vector<char> hello = encode_registration(reg);
  core::result<std::pair<std::uint16_t, std::vector<char>>> got = core::error::make("");
  while (true) {
    if (auto st = p->connect(until); !st) return st.err();
    if (auto st = p->write(until, rendezvous_frame::encode(rendezvous_frame::register_worker, hello));
        !st)
      return st.err();
    p->rejected = false;
    got = p->read(until, "job table");
    if (got || !p->rejected || !p->opt.retry_refused ||
        clock_type::now() + std::chrono::milliseconds(200) >= until)
      break;
    boost::system::error_code ignored;
    p->sock.close(ignored);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!got) return got.err();
  if (got->first != rendezvous_frame::table)
    return core::error::make("the rendezvous at " + p->master() + " sent frame type " +
                             std::to_string(got->first) + " instead of the job table");
  if (auto st = p->parse_table(got->second); !st) return st.err();
  return std::unique_ptr<rendezvous_client>(new rendezvous_client(std::move(p)));
}

int rendezvous_client::rank() const { return impl_->rank; }

const job_table& rendezvous_client::table() const { return impl_->table; }

core::status rendezvous_client::start() {
  auto& m = *impl_;
  auto until = clock_type::now() + m.opt.timeout;
  if (auto st = m.write(until, rendezvous_frame::encode(rendezvous_frame::ready, {})); !st)
    return st.err();
  auto got = m.read(until, "start signal");
  if (!got) return got.err();
  if (got->first != rendezvous_frame::start)
    return core::error::make("the rendezvous at " + m.master() + " sent frame type " +
                             std::to_string(got->first) + " instead of the start signal");
  boost::system::error_code ignored;
  m.sock.close(ignored);
  return {};
}

}  // namespace troupe::transport
