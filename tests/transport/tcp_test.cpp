// The tcp transport on loopback: ranks are transports in one test process (one thread each) or,
// for the crash test, a forked child that is killed with SIGKILL.
#include <doctest/doctest.h>

#include "tests/transport/log_sink.hpp"

#include <utility>  // before Asio (Boost 1.74, C++20, g++ 12)

#include <algorithm>
#include <boost/asio.hpp>
#include <csignal>
#include <cstring>
#include <mutex>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "core/error.hpp"
#include "transport/local.hpp"
#include "transport/tcp.hpp"

using namespace troupe;
using transport::tag;
using transport::tcp_transport;
using namespace std::chrono_literals;
namespace asio = boost::asio;

using troupe::transport::testing::log_sink;

namespace {

const char* const token = "tcp-test-token";


transport::tcp_options options(log_sink& sink) {
  transport::tcp_options o;
  o.listen = {"127.0.0.1", 0};
  o.job_token = token;
  o.log = sink.fn();
  o.connect_timeout = 3s;
  return o;
}

std::unique_ptr<tcp_transport> bound(transport::tcp_options o) {
  auto t = tcp_transport::bind(std::move(o));
  REQUIRE_MESSAGE(t.ok(), t.err().to_string());
  return std::move(t.value());
}

// n started transports on loopback; `extra` adds table entries for ranks the test plays itself,
// `tweak` adjusts rank r's options.
std::vector<std::unique_ptr<tcp_transport>> mesh(
    int n, log_sink& sink, std::vector<transport::endpoint> extra = {},
    std::function<void(int, transport::tcp_options&)> tweak = {}) {
  std::vector<std::unique_ptr<tcp_transport>> ts;
  std::vector<transport::endpoint> table;
  for (int r = 0; r < n; ++r) {
    auto o = options(sink);
    if (tweak) tweak(r, o);
    ts.push_back(bound(o));
    table.push_back({"127.0.0.1", ts.back()->port()});
  }
  table.insert(table.end(), extra.begin(), extra.end());
  for (int r = 0; r < n; ++r) ts[r]->start(r, table);
  if (extra.empty())
    for (int r = 0; r < n; ++r) {
      auto st = ts[r]->wait_connected(5s);
      REQUIRE_MESSAGE(st.ok(), st.err().to_string());
    }
  return ts;
}

core::tensor pattern(core::shape_t shape, core::dtype dt, unsigned seed) {
  auto t = core::tensor::zeros(std::move(shape), dt);
  auto* b = static_cast<unsigned char*>(t.raw());
  for (std::size_t i = 0; i < t.bytes(); ++i)
    b[i] = static_cast<unsigned char>((i * 131 + seed * 7) >> 1);
  return t;
}

bool same(const core::tensor& a, const core::tensor& b) {
  return a.type() == b.type() && a.shape() == b.shape() &&
         std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

core::tensor filled(std::int64_t n, float base) {
  auto t = core::tensor::zeros({n});
  for (std::int64_t i = 0; i < n; ++i) t.data<float>()[i] = base + 0.37f * static_cast<float>(i);
  return t;
}

std::string failure_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const core::failure& e) {
    return e.what();
  }
  return "(no failure)";
}

// A raw connection to a transport, for playing a stranger or a misbehaving peer.
struct raw_peer {
  asio::io_context io;
  asio::ip::tcp::socket sock{io};
  explicit raw_peer(std::uint16_t port) {
    sock.connect({asio::ip::make_address("127.0.0.1"), port});
  }
  void write(const std::vector<char>& bytes) { asio::write(sock, asio::buffer(bytes)); }
  // True once the far end has closed the connection (bounded wait).
  bool closed_by_peer() {
    sock.non_blocking(true);
    char c;
    for (int i = 0; i < 400; ++i) {
      boost::system::error_code ec;
      sock.read_some(asio::buffer(&c, 1), ec);
      if (ec && ec != asio::error::would_block) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }
};

transport::frame_header header(transport::frame_type type, std::uint64_t tok, int src, int dst) {
  transport::frame_header h;
  h.type = type;
  h.token = tok;
  h.src = src;
  h.dst = dst;
  return h;
}

}  // namespace

TEST_CASE("frame headers round-trip and malformed ones are named") {
  transport::frame_header h = header(transport::frame_type::tensor, 42, 3, 1);
  h.tg = {7, 5, 2, 9, 1};
  h.dt = core::dtype::bf16;
  h.shape = {2, 3, 4};
  h.payload_bytes = 2 * 3 * 4 * 2;
  auto bytes = h.encode();
  REQUIRE(bytes.size() == transport::frame_header::size);
  transport::frame_header back;
  CHECK(back.decode(bytes.data()) == "");
  CHECK(back.tg == h.tg);
  CHECK(back.shape == h.shape);
  CHECK(back.dt == core::dtype::bf16);
  CHECK(back.src == 3);

  auto bad = bytes;
  bad[0] = 'X';
  CHECK(back.decode(bad.data()).find("bad magic") != std::string::npos);
  h.payload_bytes += 1;
  auto wrong = h.encode();
  CHECK(back.decode(wrong.data()).find("payload of 49 bytes") != std::string::npos);
  h.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
  auto huge = h.encode();
  CHECK(back.decode(huge.data()).find("overflows") != std::string::npos);
}

TEST_CASE(
    "tcp transport carries tensors of several dtypes, shapes and tags both ways, byte for byte") {
  log_sink sink;
  auto ts = mesh(2, sink);
  std::vector<core::tensor> sent = {
      pattern({3, 4}, core::dtype::f32, 1), pattern({5}, core::dtype::bf16, 2),
      pattern({2, 2, 2}, core::dtype::i32, 3), pattern({}, core::dtype::f64, 4),
      pattern({0, 7}, core::dtype::f32, 5)};
  std::thread peer([&] {
    for (std::size_t i = 0; i < sent.size(); ++i) {
      auto got = ts[1]->recv(0, tag{1, 2, 0, static_cast<std::int32_t>(i), 0}, 5s);
      ts[1]->send(0, got, tag{1, 3, 0, static_cast<std::int32_t>(i), 0});
    }
  });
  for (std::size_t i = 0; i < sent.size(); ++i)
    ts[0]->send(1, sent[i], tag{1, 2, 0, static_cast<std::int32_t>(i), 0});
  for (std::size_t i = 0; i < sent.size(); ++i) {
    auto back = ts[0]->recv(1, tag{1, 3, 0, static_cast<std::int32_t>(i), 0}, 5s);
    CHECK_MESSAGE(same(back, sent[i]), "tensor " << i);
  }
  peer.join();
  CHECK(sink.all() == "");
}

TEST_CASE("tensors that arrive before their recv wait in the stash; ready turns true on arrival") {
  log_sink sink;
  auto ts = mesh(2, sink);
  tag t1{3, 1, 0, 5, 0}, t2{3, 1, 0, 6, 0};
  CHECK_FALSE(ts[1]->ready(0, t1));
  ts[0]->send(1, filled(8, 2.0f), t2);
  ts[0]->send(1, filled(8, 1.0f), t1);
  REQUIRE(ts[0]->flush(5s));
  for (int i = 0; i < 400 && !ts[1]->ready(0, t1); ++i) std::this_thread::sleep_for(5ms);
  CHECK(ts[1]->ready(0, t1));
  CHECK(same(ts[1]->recv(0, t1, 10ms), filled(8, 1.0f)));
  CHECK(same(ts[1]->recv(0, t2, 1s), filled(8, 2.0f)));
  CHECK_FALSE(ts[1]->ready(0, t1));
}

TEST_CASE("two ranks sending 16 MiB to each other at the same time both get the other's bytes") {
  log_sink sink;
  auto ts = mesh(2, sink);
  const std::int64_t n = 4 << 20;  // 4 Mi floats = 16 MiB
  std::vector<core::tensor> mine = {pattern({n}, core::dtype::f32, 11),
                                    pattern({n}, core::dtype::f32, 12)};
  std::vector<core::tensor> got(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      ts[r]->send(1 - r, mine[r], tag{0, 7, 0, 0, 0});
      ts[r]->send(1 - r, mine[r], tag{0, 7, 0, 1, 0});
      got[r] = ts[r]->recv(1 - r, tag{0, 7, 0, 1, 0}, 20s);
      CHECK(same(ts[r]->recv(1 - r, tag{0, 7, 0, 0, 0}, 20s), mine[1 - r]));
    });
  for (auto& t : th) t.join();
  CHECK(same(got[0], mine[1]));
  CHECK(same(got[1], mine[0]));
}

TEST_CASE(
    "recv of a tensor that never comes times out naming both ranks, the tag and the peer's "
    "address") {
  log_sink sink;
  auto ts = mesh(2, sink);
  auto m = failure_of([&] { ts[1]->recv(0, tag{7, 2, 1, 3, 0}, 50ms); });
  CHECK(m.find("rank 1 waited 50 ms") != std::string::npos);
  CHECK(m.find("from rank 0 (127.0.0.1:" + std::to_string(ts[0]->port()) + ")") !=
        std::string::npos);
  CHECK(m.find("step 7 kind 2 chunk 1 mb 3") != std::string::npos);
}

TEST_CASE("collectives over tcp with 4 ranks give the same bits as over the local transport") {
  const int n = 4;
  const std::vector<int> group = {0, 1, 2, 3};
  auto input = [](int r) { return filled(64, 1e7f * (r % 2 ? -1.0f : 1.0f) + 0.1f * r); };
  auto run = [&](transport::transport& t, int r) {
    std::vector<core::tensor> out;
    out.push_back(transport::all_reduce(t, group, input(r), tag{0, 1, 0, 0, 0}, 10s));
    out.push_back(transport::reduce_scatter(t, group, input(r), tag{0, 2, 0, 0, 0}, 10s));
    out.push_back(transport::all_gather(t, group, filled(16, 3.0f * r), tag{0, 3, 0, 0, 0}, 10s));
    out.push_back(transport::broadcast(t, group, 2, input(r), tag{0, 4, 0, 0, 0}, 10s));
    return out;
  };
  std::vector<std::vector<core::tensor>> over_local(n), over_tcp(n);
  {
    auto hub = std::make_shared<transport::local_hub>();
    std::vector<std::thread> th;
    for (int r = 0; r < n; ++r)
      th.emplace_back([&, r] {
        transport::local_transport t(hub, r);
        over_local[r] = run(t, r);
      });
    for (auto& t : th) t.join();
  }
  log_sink sink;
  auto ts = mesh(n, sink);
  std::vector<std::thread> th;
  for (int r = 0; r < n; ++r) th.emplace_back([&, r] { over_tcp[r] = run(*ts[r], r); });
  for (auto& t : th) t.join();
  for (int r = 0; r < n; ++r)
    for (std::size_t k = 0; k < over_local[r].size(); ++k)
      CHECK_MESSAGE(same(over_tcp[r][k], over_local[r][k]), "rank " << r << ", collective " << k);
  CHECK(same(over_tcp[0][0], over_tcp[3][0]));
}

TEST_CASE(
    "a peer that dies makes pending and later recvs from it fail at once, naming its rank and "
    "address") {
  log_sink sink;
  auto ts = mesh(3, sink);
  std::string addr = "127.0.0.1:" + std::to_string(ts[2]->port());
  tag early{1, 1, 0, 0, 0}, never{1, 1, 0, 1, 0};
  ts[2]->send(0, filled(4, 9.0f), early);
  for (int i = 0; i < 400 && !ts[0]->ready(2, early); ++i) std::this_thread::sleep_for(5ms);
  REQUIRE(ts[0]->ready(2, early));

  std::string pending;
  std::thread waiter([&] { pending = failure_of([&] { ts[0]->recv(2, never, 60s); }); });
  std::this_thread::sleep_for(50ms);
  ts[2]->abort();
  waiter.join();
  CHECK(pending.find("connection to rank 2 (" + addr + ") lost") != std::string::npos);
  CHECK(pending.find("rank 0 cannot receive step 1 kind 1 chunk 0 mb 1") != std::string::npos);
  auto later = failure_of([&] { ts[0]->recv(2, tag{2, 1, 0, 0, 0}, 60s); });
  CHECK(later.find("connection to rank 2 (" + addr + ") lost") != std::string::npos);
  CHECK(same(ts[0]->recv(2, early, 10ms), filled(4, 9.0f)));
  auto send = failure_of([&] { ts[0]->send(2, filled(4, 1.0f), early); });
  CHECK(send.find("cannot send") != std::string::npos);
  CHECK(send.find("rank 2 (" + addr + ")") != std::string::npos);
  CHECK(sink.eventually_has("connection to rank 2 (" + addr + ") lost"));
  // The survivors still talk.
  ts[1]->send(0, filled(4, 5.0f), never);
  CHECK(same(ts[0]->recv(1, never, 5s), filled(4, 5.0f)));
}

TEST_CASE("the arrival and peer-loss callbacks name the source and tag, and the lost peer once") {
  log_sink sink;
  std::mutex mu;
  std::vector<std::pair<int, tag>> arrived;
  std::vector<std::pair<int, std::string>> lost;
  auto ts = mesh(3, sink, {}, [&](int r, transport::tcp_options& o) {
    if (r != 0) return;
    o.on_arrival = [&](int src, const tag& tg) {
      std::lock_guard<std::mutex> lk(mu);
      arrived.emplace_back(src, tg);
    };
    o.on_peer_lost = [&](int rank, const std::string& why) {
      std::lock_guard<std::mutex> lk(mu);
      lost.emplace_back(rank, why);
    };
  });
  ts[1]->send(0, filled(2, 1.0f), tag{4, 3, 2, 1, 0});
  ts[2]->send(0, filled(2, 2.0f), tag{4, 3, 2, 2, 0});
  REQUIRE(same(ts[0]->recv(1, tag{4, 3, 2, 1, 0}, 5s), filled(2, 1.0f)));
  REQUIRE(same(ts[0]->recv(2, tag{4, 3, 2, 2, 0}, 5s), filled(2, 2.0f)));
  ts[2]->abort();
  ts[1].reset();
  CHECK(failure_of([&] { ts[0]->recv(2, tag{}, 5s); }).find("lost") != std::string::npos);
  CHECK(failure_of([&] { ts[0]->recv(1, tag{}, 5s); }).find("closed its transport") !=
        std::string::npos);
  // The callback runs on the IO thread just after recv is woken; let it finish (bounded).
  for (int i = 0; i < 400; ++i) {
    std::lock_guard<std::mutex> lk(mu);
    if (!lost.empty()) break;
    std::this_thread::sleep_for(5ms);
  }
  std::this_thread::sleep_for(20ms);
  std::lock_guard<std::mutex> lk(mu);
  REQUIRE(arrived.size() == 2);
  std::sort(arrived.begin(), arrived.end());
  CHECK(arrived[0].first == 1);
  CHECK(arrived[0].second == tag{4, 3, 2, 1, 0});
  CHECK(arrived[1].first == 2);
  CHECK(arrived[1].second == tag{4, 3, 2, 2, 0});
  REQUIRE(lost.size() == 1);
  CHECK(lost[0].first == 2);
  CHECK(lost[0].second.find("connection to rank 2 (127.0.0.1:") != std::string::npos);
}

TEST_CASE("a peer process killed with SIGKILL is reported as a lost connection, not a time-out") {
  int to_parent[2], to_child[2];
  REQUIRE(pipe(to_parent) == 0);
  REQUIRE(pipe(to_child) == 0);
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The child is rank 1: it sends one tensor and then waits to be killed.
    int code = 1;
    try {
      transport::tcp_options o;
      o.listen = {"127.0.0.1", 0};
      o.job_token = token;
      o.log = [](const std::string&) {};
      auto t = tcp_transport::bind(o);
      if (t.ok()) {
        std::uint16_t mine = t.value()->port(), theirs = 0;
        if (write(to_parent[1], &mine, sizeof mine) == sizeof mine &&
            read(to_child[0], &theirs, sizeof theirs) == sizeof theirs) {
          t.value()->start(1, {{"127.0.0.1", theirs}, {"127.0.0.1", mine}});
          t.value()->send(0, filled(4, 1.5f), tag{0, 1, 0, 0, 0});
          t.value()->flush(5s);
          pause();
        }
      }
    } catch (...) {
    }
    _exit(code);
  }
  log_sink sink;
  auto t = bound(options(sink));
  std::uint16_t child_port = 0, mine = t->port();
  REQUIRE(read(to_parent[0], &child_port, sizeof child_port) == sizeof child_port);
  REQUIRE(write(to_child[1], &mine, sizeof mine) == sizeof mine);
  t->start(0, {{"127.0.0.1", mine}, {"127.0.0.1", child_port}});
  CHECK(same(t->recv(1, tag{0, 1, 0, 0, 0}, 10s), filled(4, 1.5f)));
  kill(child, SIGKILL);
  auto m = failure_of([&] { t->recv(1, tag{0, 1, 0, 1, 0}, 60s); });
  CHECK(m.find("connection to rank 1 (127.0.0.1:" + std::to_string(child_port) + ") lost") !=
        std::string::npos);
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) close(fd);
}

TEST_CASE(
    "a rank that closes its transport says goodbye: recvs from it fail at once, nothing is logged "
    "as lost") {
  log_sink sink;
  auto ts = mesh(2, sink);
  ts[1]->send(0, filled(4, 3.0f), tag{0, 1, 0, 0, 0});
  ts[1].reset();
  CHECK(same(ts[0]->recv(1, tag{0, 1, 0, 0, 0}, 5s), filled(4, 3.0f)));
  auto m = failure_of([&] { ts[0]->recv(1, tag{0, 1, 0, 1, 0}, 60s); });
  CHECK(m.find("closed its transport") != std::string::npos);
  CHECK_FALSE(sink.has("lost"));
}

TEST_CASE(
    "strangers with garbage, a wrong token, a bad hello or silence are refused; an oversized frame "
    "closes its peer; the job goes on") {
  log_sink sink;
  // Rank 2 of this job is played by the test through raw sockets.
  asio::io_context io;
  asio::ip::tcp::acceptor rank2_listen(io, {asio::ip::make_address("127.0.0.1"), 0});
  auto ts = mesh(2, sink, {{"127.0.0.1", rank2_listen.local_endpoint().port()}},
                 [](int, transport::tcp_options& o) {
                   o.max_frame_bytes = 1 << 20;
                   o.hello_timeout = 300ms;
                 });
  std::uint64_t good = transport::token_hash(token);
  // Rank 1's own connection is in before the impostor below claims its rank.
  ts[1]->send(0, filled(4, 1.0f), tag{});
  REQUIRE(same(ts[0]->recv(1, tag{}, 5s), filled(4, 1.0f)));
  auto waiting = ts[0]->wait_connected(100ms);
  REQUIRE_FALSE(waiting.ok());
  CHECK(waiting.err().message == "rank 0 is not connected after 100 ms with rank 2 (127.0.0.1:" +
                                     std::to_string(rank2_listen.local_endpoint().port()) +
                                     ") (its to us)");

  raw_peer garbage(ts[0]->port());
  std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  std::vector<char> junk(http.begin(), http.end());
  junk.resize(transport::frame_header::size, ' ');
  garbage.write(junk);
  CHECK(garbage.closed_by_peer());
  CHECK(sink.eventually_has("bad magic"));

  raw_peer stranger(ts[0]->port());
  stranger.write(
      header(transport::frame_type::hello, transport::token_hash("other job"), 2, 0).encode());
  CHECK(stranger.closed_by_peer());
  CHECK(sink.eventually_has("wrong job token"));

  raw_peer impostor(ts[0]->port());
  impostor.write(header(transport::frame_type::hello, good, 1, 0).encode());
  CHECK(impostor.closed_by_peer());
  CHECK(sink.eventually_has("rank 1 is already connected"));

  raw_peer silent(ts[0]->port());
  CHECK(silent.closed_by_peer());
  CHECK(sink.eventually_has("did not introduce itself within 300 ms"));

  raw_peer rank2(ts[0]->port());
  rank2.write(header(transport::frame_type::hello, good, 2, 0).encode());
  auto big = header(transport::frame_type::tensor, good, 2, 0);
  big.shape = {1 << 20};
  big.payload_bytes = 4 << 20;
  rank2.write(big.encode());
  CHECK(rank2.closed_by_peer());
  CHECK(sink.eventually_has("over the limit of 1048576"));
  auto m = failure_of([&] { ts[0]->recv(2, tag{}, 5s); });
  CHECK(m.find("rank 2 (127.0.0.1:") != std::string::npos);
  CHECK(m.find("over the limit") != std::string::npos);

  ts[1]->send(0, filled(4, 4.0f), tag{9, 9, 9, 9, 9});
  ts[0]->send(1, filled(4, 5.0f), tag{9, 9, 9, 9, 9});
  CHECK(same(ts[0]->recv(1, tag{9, 9, 9, 9, 9}, 5s), filled(4, 4.0f)));
  CHECK(same(ts[1]->recv(0, tag{9, 9, 9, 9, 9}, 5s), filled(4, 5.0f)));
}

TEST_CASE("binding a data port that is taken names the port and hints at a free one") {
  log_sink sink;
  auto first = bound(options(sink));
  auto o = options(sink);
  o.listen.port = first->port();
  auto second = tcp_transport::bind(o);
  REQUIRE_FALSE(second.ok());
  CHECK(second.err().to_string() == "port " + std::to_string(first->port()) +
                                        " on 127.0.0.1 is already in use\n  hint: pick another "
                                        "data port, or 0 to let the system choose one");
}

TEST_CASE("an unreachable peer is named after the connect time-out") {
  log_sink sink;
  // A port nobody listens on: bind one, note it, close it.
  std::uint16_t dead;
  {
    asio::io_context io;
    asio::ip::tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
    dead = a.local_endpoint().port();
  }
  auto o = options(sink);
  o.connect_timeout = 200ms;
  auto t = bound(o);
  t->start(0, {{"127.0.0.1", t->port()}, {"127.0.0.1", dead}});
  auto st = t->wait_connected(10s);
  REQUIRE_FALSE(st.ok());
  CHECK(st.err().message.find(
            "rank 0 cannot connect to every peer: could not connect to rank 1 (127.0.0.1:" +
            std::to_string(dead) + ") within 200 ms") != std::string::npos);
  auto m = failure_of([&] { t->recv(1, tag{}, 10s); });
  CHECK(m.find("could not connect to rank 1 (127.0.0.1:" + std::to_string(dead) +
               ") within 200 ms") != std::string::npos);
  CHECK(sink.eventually_has("could not connect to rank 1"));
}
