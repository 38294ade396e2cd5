// The tcp transport. All socket work runs on one IO thread (impl::io); callers touch only the
// stash and the per-peer states under `mu`. Per peer there are two connections: the one this rank
// opened (it only writes tensors there, and keeps a one-byte read pending to learn at once when
// the far end goes away) and the one the peer opened (it only reads there). Frames are a fixed
// header (tcp_wire.hpp) and the tensor's raw bytes, read straight into a fresh tensor.
#include "transport/tcp.hpp"

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "transport/tcp_asio.hpp"

namespace troupe::transport {

namespace asio = boost::asio;
using boost::asio::ip::tcp;
using clock_type = std::chrono::steady_clock;

namespace {

// Asio's stock completion conditions (transfer_all, transfer_exactly) ask the kernel for at most
// 64 KiB per system call; large tensors move markedly faster when each call may take the rest.
std::size_t until_done(const boost::system::error_code& ec, std::size_t) {
  return ec ? 0 : SIZE_MAX;
}

struct out_frame {
  std::vector<char> header;
  tensor payload;  // undefined for hello / bye
  bool counted;    // counts in peer_state::queued (what flush waits for)
  tag tg{};        // a tensor's tag (unused for hello / bye)
};

struct incoming {
  explicit incoming(asio::io_context& io) : sock(io), hello_timer(io) {}
  tcp::socket sock;
  asio::steady_timer hello_timer;
  std::string name;  // the far end's address, for logs about strangers
  int src = -1;      // set by a valid hello
  std::array<char, frame_header::size> hdr{};
  frame_header h;
  tensor pending;
};

struct outgoing {
  std::shared_ptr<tcp::socket> sock;
  std::shared_ptr<tcp::resolver> resolver;
  std::unique_ptr<asio::steady_timer> retry;
  clock_type::time_point deadline;
  std::deque<out_frame> queue;
  std::optional<out_frame> inflight;
  bool connected = false;
  char probe = 0;
};

}  // namespace

struct tcp_transport::impl {
  explicit impl(tcp_options o)
      : opt(std::move(o)),
        log(detail::logger_or_stderr(opt.log, "tcp")),
        token(token_hash(opt.job_token)) {}

  tcp_options opt;
  std::function<void(const std::string&)> log;
  std::uint64_t token;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::optional<tcp::acceptor> acceptor;
  std::uint16_t port = 0;
  std::thread thread;

  // Written once by start() before anything reads them from another thread.
  std::atomic<int> rank{-1};
  std::vector<endpoint> peers;

  struct peer_state {
    bool introduced = false;  // its connection to us said hello
    std::string in_down;      // why its connection to us ended ("" while fine or not yet made)
    std::string out_down;     // why our connection to it ended
    std::size_t queued = 0;   // frames for it not yet handed to the kernel
    bool reported = false;    // on_peer_lost was called for it
    bool out_up = false;      // our connection to it is established
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<int, tag>, tensor> stash;
  std::vector<peer_state> state;
  std::string aborted;

  // IO thread only.
  bool dropped = false;  // tcp_options::drop_step has struck
  std::vector<outgoing> out;
  std::set<std::shared_ptr<incoming>> in;
  bool closing = false;

  int n() const { return static_cast<int>(peers.size()); }
  std::string who(int r) const {
    return "rank " + std::to_string(r) + " (" + peers[r].to_string() + ")";
  }

  // --- outgoing -------------------------------------------------------------------------------

  void connect(int p) {
    auto& o = out[p];
    o.sock = std::make_shared<tcp::socket>(io);
    o.resolver = std::make_shared<tcp::resolver>(io);
    auto sock = o.sock;
    o.resolver->async_resolve(
        peers[p].host, std::to_string(peers[p].port), tcp::resolver::numeric_service,
        [this, p, sock](boost::system::error_code ec, tcp::resolver::results_type found) {
          if (closing) return;
          if (ec)
            return retry_or_fail(p, "cannot resolve '" + peers[p].host + "': " + ec.message());
          asio::async_connect(*sock, found,
                              [this, p, sock](boost::system::error_code ec, const tcp::endpoint&) {
                                if (closing) return;
                                if (ec) return retry_or_fail(p, ec.message());
                                connected(p);
                              });
        });
  }

  // A peer that has not bound its port yet refuses the connection; keep trying until the
  // deadline, since ranks start at slightly different times.
  void retry_or_fail(int p, const std::string& why) {
    auto& o = out[p];
    if (clock_type::now() >= o.deadline)
      return out_lost(p, "could not connect to " + who(p) + " within " +
                             std::to_string(opt.connect_timeout.count()) + " ms: " + why);
    o.retry = std::make_unique<asio::steady_timer>(io, std::chrono::milliseconds(50));
    o.retry->async_wait([this, p](boost::system::error_code ec) {
      if (!ec && !closing) connect(p);
    });
  }

  void connected(int p) {
    auto& o = out[p];
    boost::system::error_code ignored;
    o.sock->set_option(tcp::no_delay(true), ignored);
    o.connected = true;
    {
      std::lock_guard<std::mutex> lk(mu);
      state[p].out_up = true;
    }
    cv.notify_all();
    frame_header hello;
    hello.type = frame_type::hello;
    hello.token = token;
    hello.src = rank;
    hello.dst = p;
    o.queue.push_front(out_frame{hello.encode(), {}, false});
    auto sock = o.sock;
    sock->async_read_some(
        asio::buffer(&o.probe, 1), [this, p, sock](boost::system::error_code ec, std::size_t) {
          if (closing || sock != out[p].sock) return;
          out_lost(p, ec ? "connection to " + who(p) + " lost (" + ec.message() + ")"
                         : who(p) + " wrote on a connection it should only read");
        });
    write_next(p);
  }

  void enqueue(int p, out_frame f) {
    auto& o = out[p];
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!state[p].out_down.empty()) {
        state[p].queued -= f.counted ? 1 : 0;
        cv.notify_all();
        return;
      }
    }
    o.queue.push_back(std::move(f));
    write_next(p);
  }

  void write_next(int p) {
    auto& o = out[p];
    if (!o.connected || o.inflight || o.queue.empty()) return;
    o.inflight = std::move(o.queue.front());
    o.queue.pop_front();
    const tensor& t = o.inflight->payload;
    const std::size_t bytes = t.defined() ? t.bytes() : 0;
    // TROUPE_FAULT=drop (test only): half of this tensor leaves, then the connection is cut.
    const bool drop = opt.drop_step >= 0 && !dropped && o.inflight->tg.step == opt.drop_step &&
                      t.defined() && bytes >= 2;
    if (drop) dropped = true;
    const std::size_t sent = drop ? bytes / 2 : bytes;
    std::array<asio::const_buffer, 2> bufs{asio::buffer(o.inflight->header),
                                           asio::buffer(t.defined() ? t.raw() : nullptr, sent)};
    auto sock = o.sock;
    asio::async_write(
        *sock, bufs, until_done,
        [this, p, sock, drop, sent, bytes](boost::system::error_code ec, std::size_t) {
          if (closing || sock != out[p].sock) return;
          auto& o = out[p];
          bool counted = o.inflight->counted;
          const tag tg = o.inflight->tg;
          o.inflight.reset();
          if (counted) {
            std::lock_guard<std::mutex> lk(mu);
            --state[p].queued;
          }
          cv.notify_all();
          if (ec)
            return out_lost(
                p, "connection to " + who(p) + " lost while sending (" + ec.message() + ")");
          if (drop) {
            const std::string why = "the connection to " + who(p) + " was cut by " + opt.drop_label +
                                    " halfway through " + tg.to_string() + " (" +
                                    std::to_string(sent) + " of " + std::to_string(bytes) +
                                    " bytes sent; test only)";
            log(why);
            return out_lost(p, why);
          }
          write_next(p);
        });
  }

  // Our connection to p is gone: drop what was queued for it and fail later sends. The loss is
  // logged here only when p never connected to us; otherwise its own connection's end tells the
  // story (a crash as "lost", a clean exit as a goodbye), and this side stays quiet.
  void out_lost(int p, const std::string& why) {
    auto& o = out[p];
    boost::system::error_code ignored;
    if (o.sock) o.sock->close(ignored);
    o.connected = false;
    std::size_t dropped = 0;
    for (auto& f : o.queue) dropped += f.counted ? 1 : 0;
    o.queue.clear();
    bool quiet;
    {
      std::lock_guard<std::mutex> lk(mu);
      auto& s = state[p];
      quiet = !s.out_down.empty() || s.introduced;
      if (s.out_down.empty()) s.out_down = why;
      s.queued -= dropped;
    }
    cv.notify_all();
    if (quiet) return;
    log(why);
    report_lost(p, why);
  }

  void report_lost(int p, const std::string& why) {
    if (!opt.on_peer_lost) return;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (state[p].reported) return;
      state[p].reported = true;
    }
    opt.on_peer_lost(p, why);
  }

  // --- incoming -------------------------------------------------------------------------------

  void start_accepting() {
    detail::accept_connections(
        *acceptor, closing, log,
        [this](tcp::socket sock) {
          auto c = std::make_shared<incoming>(io);
          c->sock = std::move(sock);
          boost::system::error_code ignored;
          c->sock.set_option(tcp::no_delay(true), ignored);
          c->name = detail::remote_name(c->sock);
          in.insert(c);
          c->hello_timer.expires_after(opt.hello_timeout);
          c->hello_timer.async_wait([this, c](boost::system::error_code e) {
            if (!e && !closing && c->src < 0 && in.count(c))
              refuse(c, "it did not introduce itself within " +
                            std::to_string(opt.hello_timeout.count()) + " ms");
          });
          read_header(c);
        });
  }

  void read_header(const std::shared_ptr<incoming>& c) {
    asio::async_read(c->sock, asio::buffer(c->hdr),
                     [this, c](boost::system::error_code ec, std::size_t) {
                       if (closing || !in.count(c)) return;
                       if (ec) return ended(c, ec);
                       on_header(c);
                     });
  }

  void on_header(const std::shared_ptr<incoming>& c) {
    frame_header& h = c->h;
    std::string why = h.decode(c->hdr.data());
    if (why.empty() && h.token != token) why = "wrong job token";
    if (why.empty() && h.dst != rank)
      why = "frame for rank " + std::to_string(h.dst) + " arrived at rank " + std::to_string(rank);
    if (c->src < 0) {
      if (why.empty() && h.type != frame_type::hello) why = "its first frame is not a hello";
      if (why.empty() && (h.src < 0 || h.src >= n() || h.src == rank))
        why = "it claims to be rank " + std::to_string(h.src) + " in a job of " +
              std::to_string(n()) + " ranks";
      if (why.empty()) {
        std::lock_guard<std::mutex> lk(mu);
        if (state[h.src].introduced)
          why = "rank " + std::to_string(h.src) + " is already connected";
        else
          state[h.src].introduced = true;
      }
      if (!why.empty()) return refuse(c, why);
      cv.notify_all();
      c->src = h.src;
      c->hello_timer.cancel();
      return read_header(c);
    }
    if (why.empty() && h.src != c->src)
      why = "a frame claiming to come from rank " + std::to_string(h.src);
    if (why.empty() && h.type == frame_type::hello) why = "a second hello";
    if (why.empty() && h.payload_bytes > opt.max_frame_bytes)
      why = "a frame of " + std::to_string(h.payload_bytes) + " bytes, over the limit of " +
            std::to_string(opt.max_frame_bytes) + " (tcp_options::max_frame_bytes)";
    if (!why.empty()) return broken(c, who(c->src) + " sent " + why + "; its connection is closed");
    if (h.type == frame_type::bye) {
      {
        std::lock_guard<std::mutex> lk(mu);
        auto& s = state[c->src];
        if (s.in_down.empty()) s.in_down = who(c->src) + " closed its transport";
      }
      cv.notify_all();
      return drop(c);
    }
    c->pending = tensor::zeros(h.shape, h.dt);
    if (h.payload_bytes == 0) return deliver(c);
    asio::async_read(c->sock, asio::buffer(c->pending.raw(), h.payload_bytes), until_done,
                     [this, c](boost::system::error_code ec, std::size_t) {
                       if (closing || !in.count(c)) return;
                       if (ec) return ended(c, ec);
                       deliver(c);
                     });
  }

  void deliver(const std::shared_ptr<incoming>& c) {
    bool fresh;
    {
      std::lock_guard<std::mutex> lk(mu);
      fresh = stash.emplace(std::pair{c->src, c->h.tg}, std::move(c->pending)).second;
    }
    c->pending = tensor();
    if (!fresh)
      return broken(c, who(c->src) + " sent twice under " + c->h.tg.to_string() +
                           "; its connection is closed");
    cv.notify_all();
    if (opt.on_arrival) opt.on_arrival(c->src, c->h.tg);
    read_header(c);
  }

  void ended(const std::shared_ptr<incoming>& c, boost::system::error_code ec) {
    if (c->src < 0) {
      log("connection from " + c->name + " ended before it introduced itself (" + ec.message() +
          ")");
      return drop(c);
    }
    bool first;
    std::string why = "connection to " + who(c->src) + " lost (" + ec.message() + ")";
    {
      std::lock_guard<std::mutex> lk(mu);
      auto& s = state[c->src];
      first = s.in_down.empty();
      if (first) s.in_down = why;
    }
    cv.notify_all();
    if (first) {
      log(why);
      report_lost(c->src, why);
    }
    drop(c);
  }

  void refuse(const std::shared_ptr<incoming>& c, const std::string& why) {
    log("refused a connection from " + c->name + ": " + why);
    drop(c);
  }

  void broken(const std::shared_ptr<incoming>& c, const std::string& why) {
    bool first;
    {
      std::lock_guard<std::mutex> lk(mu);
      auto& s = state[c->src];
      first = s.in_down.empty();
      if (first) s.in_down = why;
    }
    cv.notify_all();
    log(why);
    if (first) report_lost(c->src, why);
    drop(c);
  }

  void drop(const std::shared_ptr<incoming>& c) {
    boost::system::error_code ignored;
    c->sock.close(ignored);
    c->hello_timer.cancel();
    in.erase(c);
  }

  void close_all() {
    closing = true;
    boost::system::error_code ignored;
    if (acceptor) acceptor->close(ignored);
    for (auto& o : out) {
      if (o.sock) o.sock->close(ignored);
      if (o.resolver) o.resolver->cancel();
      if (o.retry) o.retry->cancel();
    }
    for (auto& c : in) {
      c->sock.close(ignored);
      c->hello_timer.cancel();
    }
    in.clear();
  }

  // Why a recv from `src` cannot succeed any more ("" while it still may). Before p's own
  // connection arrived, a failure of ours to p is the only news of it. REQUIRES: mu held.
  std::string recv_blocker(int src) const {
    const auto& s = state[src];
    if (!s.in_down.empty()) return s.in_down;
    if (!s.introduced) return s.out_down;
    return {};
  }
};

tcp_transport::tcp_transport(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

core::result<std::unique_ptr<tcp_transport>> tcp_transport::bind(tcp_options opt) {
  auto p = std::make_unique<impl>(std::move(opt));
  auto acc = detail::open_acceptor(p->io, p->opt.listen,
                                   "pick another data port, or 0 to let the system choose one");
  if (!acc) return acc.err();
  p->acceptor.emplace(std::move(acc.value()));
  p->port = p->acceptor->local_endpoint().port();
  impl* raw = p.get();
  p->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<tcp_transport>(new tcp_transport(std::move(p)));
}

tcp_transport::~tcp_transport() {
  auto& m = *impl_;
  bool aborted;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    aborted = !m.aborted.empty();
  }
  if (m.rank >= 0 && !aborted) {
    flush(m.opt.linger);
    asio::post(m.io, [&m] {
      frame_header bye;
      bye.type = frame_type::bye;
      bye.token = m.token;
      bye.src = m.rank;
      for (int p = 0; p < m.n(); ++p) {
        if (p == m.rank || !m.out[p].connected) continue;
        bye.dst = p;
        {
          std::lock_guard<std::mutex> lk(m.mu);
          ++m.state[p].queued;
        }
        m.enqueue(p, out_frame{bye.encode(), {}, true});
      }
    });
    flush(m.opt.linger);
  }
  asio::post(m.io, [&m] {
    m.close_all();
    m.work.reset();
  });
  m.thread.join();
}

std::uint16_t tcp_transport::port() const { return impl_->port; }

int tcp_transport::rank() const { return impl_->rank; }

void tcp_transport::start(int rank, std::vector<endpoint> peers) {
  auto& m = *impl_;
  TROUPE_CHECK(m.rank < 0, "tcp transport started twice");
  TROUPE_CHECK(rank >= 0 && rank < static_cast<int>(peers.size()),
               "rank " + std::to_string(rank) + " outside a table of " +
                   std::to_string(peers.size()) + " addresses");
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.peers = std::move(peers);
    m.state.assign(m.peers.size(), {});
    m.rank = rank;
  }
  asio::post(m.io, [&m] {
    m.out.resize(m.peers.size());
    auto deadline = clock_type::now() + m.opt.connect_timeout;
    for (int p = 0; p < m.n(); ++p) {
      if (p == m.rank) continue;
      m.out[p].deadline = deadline;
      m.connect(p);
    }
    m.start_accepting();
  });
}

void tcp_transport::send(int dst, tensor t, const tag& tg) {
  auto& m = *impl_;
  int me = m.rank;
  TROUPE_CHECK(me >= 0, "tcp transport: send before start()");
  TROUPE_CHECK(dst >= 0 && dst < m.n(), "rank " + std::to_string(me) + " sends to rank " +
                                            std::to_string(dst) + " in a job of " +
                                            std::to_string(m.n()) + " ranks");
  TROUPE_CHECK(t.defined(),
               "rank " + std::to_string(me) + " sends an empty tensor under " + tg.to_string());
  if (!t.dev().is_cpu())
    throw core::failure("the tcp transport carries host tensors; rank " + std::to_string(me) +
                        " sent a " + t.dev().to_string() + " tensor to rank " +
                        std::to_string(dst) + " (" + tg.to_string() + ")");
  TROUPE_CHECK(
      t.rank() <= frame_header::max_dims,
      "tcp transport: tensors of at most 8 dimensions, got " + core::shape_string(t.shape()));
  if (t.bytes() > m.opt.max_frame_bytes)
    throw core::failure(
        "rank " + std::to_string(me) + " sends " + std::to_string(t.bytes()) + " bytes to rank " +
        std::to_string(dst) + " (" + tg.to_string() +
        "), over tcp_options::max_frame_bytes = " + std::to_string(m.opt.max_frame_bytes));
  if (dst == me) {
    std::lock_guard<std::mutex> lk(m.mu);
    TROUPE_CHECK(m.stash.emplace(std::pair{me, tg}, std::move(t)).second,
                 "rank " + std::to_string(me) + " sent twice to itself under " + tg.to_string());
    m.cv.notify_all();
    return;
  }
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (!m.aborted.empty()) throw core::failure(m.aborted);
    auto& s = m.state[dst];
    const std::string& down = !s.out_down.empty() ? s.out_down : s.in_down;
    if (!down.empty())
      throw core::failure("rank " + std::to_string(me) + " cannot send " + tg.to_string() +
                          " to rank " + std::to_string(dst) + ": " + down);
    ++s.queued;
  }
  frame_header h;
  h.type = frame_type::tensor;
  h.token = m.token;
  h.src = me;
  h.dst = dst;
  h.tg = tg;
  h.dt = t.type();
  h.shape = t.shape();
  h.payload_bytes = t.bytes();
  asio::post(m.io, [&m, dst, f = out_frame{h.encode(), std::move(t), true, tg}]() mutable {
    m.enqueue(dst, std::move(f));
  });
}

tensor tcp_transport::recv(int src, const tag& tg, std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  int me = m.rank;
  TROUPE_CHECK(me >= 0, "tcp transport: recv before start()");
  TROUPE_CHECK(src >= 0 && src < m.n(), "rank " + std::to_string(me) + " receives from rank " +
                                            std::to_string(src) + " in a job of " +
                                            std::to_string(m.n()) + " ranks");
  std::unique_lock<std::mutex> lk(m.mu);
  auto key = std::pair{src, tg};
  std::string blocker;
  auto settled = [&] {
    if (m.stash.count(key)) return true;
    blocker = !m.aborted.empty() ? m.aborted : src == me ? std::string() : m.recv_blocker(src);
    return !blocker.empty();
  };
  bool done = m.cv.wait_for(lk, timeout, settled);
  if (auto it = m.stash.find(key); it != m.stash.end()) {
    tensor t = std::move(it->second);
    m.stash.erase(it);
    return t;
  }
  if (done)
    throw core::failure("rank " + std::to_string(me) + " cannot receive " + tg.to_string() +
                        " from rank " + std::to_string(src) + ": " + blocker);
  throw core::failure("rank " + std::to_string(me) + " waited " + std::to_string(timeout.count()) +
                      " ms for a tensor from " + m.who(src) + " (" + tg.to_string() +
                      ") that never came");
}

bool tcp_transport::ready(int src, const tag& tg) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->stash.count(std::pair{src, tg}) > 0;
}

core::status tcp_transport::wait_connected(std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  int me = m.rank;
  TROUPE_CHECK(me >= 0, "tcp transport: wait_connected before start()");
  std::unique_lock<std::mutex> lk(m.mu);
  auto settled = [&] {
    if (!m.aborted.empty()) return true;
    bool all = true;
    for (int p = 0; p < m.n(); ++p) {
      if (p == me) continue;
      const auto& s = m.state[p];
      if (!s.in_down.empty() || !s.out_down.empty()) return true;
      all = all && s.introduced && s.out_up;
    }
    return all;
  };
  m.cv.wait_for(lk, timeout, settled);
  if (!m.aborted.empty()) return core::error::make(m.aborted);
  std::string failed, waiting;
  for (int p = 0; p < m.n(); ++p) {
    if (p == me) continue;
    const auto& s = m.state[p];
    const std::string& down = !s.in_down.empty() ? s.in_down : s.out_down;
    if (!down.empty())
      failed += (failed.empty() ? "" : "; ") + down;
    else if (!s.introduced || !s.out_up)
      waiting += (waiting.empty() ? "" : ", ") + m.who(p) +
                 (!s.out_up ? (s.introduced ? " (ours to it)" : " (both ways)") : " (its to us)");
  }
  if (!failed.empty())
    return core::error::make("rank " + std::to_string(me) +
                             " cannot connect to every peer: " + failed);
  if (!waiting.empty())
    return core::error::make("rank " + std::to_string(me) + " is not connected after " +
                                 std::to_string(timeout.count()) + " ms with " + waiting,
                             "those ranks have not started their transports, or cannot reach "
                             "this host's data port");
  return {};
}

bool tcp_transport::flush(std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  std::unique_lock<std::mutex> lk(m.mu);
  return m.cv.wait_for(lk, timeout, [&] {
    if (!m.aborted.empty()) return true;
    for (auto& s : m.state)
      if (s.queued > 0) return false;
    return true;
  });
}

void tcp_transport::abort() {
  auto& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.aborted.empty())
      m.aborted = "the tcp transport of rank " + std::to_string(m.rank) + " was aborted";
  }
  m.cv.notify_all();
  asio::post(m.io, [&m] { m.close_all(); });
}

}  // namespace troupe::transport
