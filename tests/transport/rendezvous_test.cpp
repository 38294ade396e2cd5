// The rendezvous on loopback: the server and every worker in one process, workers on threads.
#include <doctest/doctest.h>

#include "tests/transport/log_sink.hpp"

#include <utility>  // before Asio (Boost 1.74, C++20, g++ 12)

#include <boost/asio.hpp>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "transport/rendezvous.hpp"
#include "transport/tcp.hpp"

using namespace troupe;
using namespace std::chrono_literals;
using transport::rendezvous_client;
using transport::rendezvous_server;
namespace asio = boost::asio;

using troupe::transport::testing::log_sink;

namespace {

const char* const token = "rendezvous-test-token";


std::unique_ptr<rendezvous_server> serve(int world, int local, log_sink& sink,
                                         std::chrono::milliseconds timeout = 10s) {
  transport::rendezvous_server_options o;
  o.listen = {"127.0.0.1", 0};
  o.job_token = token;
  o.world_size = world;
  o.local_world_size = local;
  o.timeout = timeout;
  o.hello_timeout = 300ms;
  o.log = sink.fn();
  auto s = rendezvous_server::bind(o);
  REQUIRE_MESSAGE(s.ok(), s.err().to_string());
  return std::move(s.value());
}

transport::rendezvous_client_options worker(std::uint16_t port, int node, int local) {
  transport::rendezvous_client_options o;
  o.master = {"127.0.0.1", port};
  o.job_token = token;
  o.node_rank = node;
  o.local_rank = local;
  o.data_port = static_cast<std::uint16_t>(20000 + 10 * node + local);
  o.blob = "blob of " + std::to_string(node) + "." + std::to_string(local);
  o.timeout = 10s;
  return o;
}

// What one worker thread saw: its rank and table, or the error it got.
struct outcome {
  int rank = -1;
  transport::job_table table;
  std::string error;
};

outcome join_and_start(transport::rendezvous_client_options o) {
  outcome out;
  auto c = rendezvous_client::join(std::move(o));
  if (!c) {
    out.error = c.err().to_string();
    return out;
  }
  out.rank = c.value()->rank();
  out.table = c.value()->table();
  if (auto st = c.value()->start(); !st) out.error = st.err().to_string();
  return out;
}

std::vector<char> raw_bytes(const std::string& s) { return {s.begin(), s.end()}; }

// Connects, writes `bytes`, and reports whether the server then closed the connection.
bool refused(std::uint16_t port, const std::vector<char>& bytes) {
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  if (!bytes.empty()) asio::write(s, asio::buffer(bytes));
  s.non_blocking(true);
  char c[64];
  for (int i = 0; i < 400; ++i) {
    boost::system::error_code ec;
    s.read_some(asio::buffer(c), ec);
    if (ec && ec != asio::error::would_block) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

}  // namespace

TEST_CASE(
    "workers get ranks by node then local rank, the whole table with blobs, and start together") {
  log_sink sink;
  auto server = serve(4, 2, sink);
  // Arrival order differs from rank order; ranks must not depend on it.
  std::vector<std::pair<int, int>> who = {{1, 1}, {0, 1}, {1, 0}, {0, 0}};
  std::vector<outcome> got(who.size());
  std::vector<std::thread> th;
  for (std::size_t i = 0; i < who.size(); ++i)
    th.emplace_back([&, i] {
      auto o = worker(server->port(), who[i].first, who[i].second);
      if (who[i].first == 1) o.host = "node1.example";
      got[i] = join_and_start(o);
    });
  auto table = server->wait();
  for (auto& t : th) t.join();
  REQUIRE_MESSAGE(table.ok(), table.err().to_string());
  REQUIRE(table->workers.size() == 4);
  for (std::size_t i = 0; i < who.size(); ++i) {
    auto [node, local] = who[i];
    REQUIRE_MESSAGE(got[i].error == "", got[i].error);
    CHECK(got[i].rank == node * 2 + local);
    REQUIRE(got[i].table.workers.size() == 4);
    for (int r = 0; r < 4; ++r) {
      const auto& w = got[i].table.workers[r];
      CHECK(w.rank == r);
      CHECK(w.node_rank == r / 2);
      CHECK(w.local_rank == r % 2);
      CHECK(w.data.port == 20000 + 10 * (r / 2) + r % 2);
      CHECK(w.data.host == (r / 2 == 1 ? "node1.example" : "127.0.0.1"));
      CHECK(w.blob == "blob of " + std::to_string(r / 2) + "." + std::to_string(r % 2));
      CHECK(w.data == table->workers[r].data);
    }
  }
}

TEST_CASE(
    "rendezvous then tcp transports: four workers all-reduce over the table they were given") {
  log_sink sink;
  auto server = serve(4, 4, sink);
  std::vector<std::vector<float>> sums(4);
  std::vector<std::string> errors(4);
  std::vector<std::thread> th;
  for (int l = 0; l < 4; ++l)
    th.emplace_back([&, l] {
      transport::tcp_options to;
      to.listen = {"127.0.0.1", 0};
      to.job_token = token;
      to.log = sink.fn();
      auto data = transport::tcp_transport::bind(to);
      if (!data) return void(errors[l] = data.err().to_string());
      auto o = worker(server->port(), 0, l);
      o.data_port = data.value()->port();
      auto c = rendezvous_client::join(o);
      if (!c) return void(errors[l] = c.err().to_string());
      int rank = c.value()->rank();
      data.value()->start(rank, c.value()->table().data_endpoints());
      if (auto st = data.value()->wait_connected(10s); !st)
        return void(errors[l] = st.err().to_string());
      if (auto st = c.value()->start(); !st) return void(errors[l] = st.err().to_string());
      auto x = core::tensor::zeros({8});
      for (int i = 0; i < 8; ++i) x.data<float>()[i] = static_cast<float>(rank * 10 + i);
      auto y = transport::all_reduce(*data.value(), {0, 1, 2, 3}, x, {}, 10s);
      sums[rank].assign(y.data<float>(), y.data<float>() + 8);
    });
  for (auto& t : th) t.join();
  REQUIRE(server->wait().ok());
  for (int r = 0; r < 4; ++r) {
    REQUIRE_MESSAGE(errors[r] == "", errors[r]);
    REQUIRE(sums[r].size() == 8);
    for (int i = 0; i < 8; ++i) CHECK(sums[r][i] == static_cast<float>(60 + 4 * i));
  }
}

TEST_CASE(
    "garbage, a wrong token, an oversized frame, silence and a duplicate rank are refused; the job "
    "still forms") {
  log_sink sink;
  auto server = serve(2, 2, sink);
  auto port = server->port();

  CHECK(refused(port, raw_bytes("GET / HTTP/1.1\r\nHost: troupe\r\n\r\n")));
  CHECK(sink.eventually_has("bad magic"));

  transport::wire_writer huge;
  huge.put(transport::rendezvous_frame::magic);
  huge.put(transport::rendezvous_frame::version);
  huge.put(std::uint16_t{transport::rendezvous_frame::register_worker});
  huge.put(std::uint32_t{1u << 30});
  CHECK(refused(port, huge.bytes()));
  CHECK(sink.eventually_has("a frame of 1073741824 bytes, over the limit of 1048576"));

  CHECK(refused(port, {}));
  CHECK(sink.eventually_has("did not register within 300 ms"));

  auto wrong = worker(port, 0, 0);
  wrong.job_token = "some other job";
  auto w = rendezvous_client::join(wrong);
  REQUIRE_FALSE(w.ok());
  CHECK(w.err().message.find("refused this worker (node 0, local rank 0): wrong job token") !=
        std::string::npos);
  CHECK(sink.eventually_has("wrong job token"));

  auto bad_node = worker(port, 3, 0);
  auto b = rendezvous_client::join(bad_node);
  REQUIRE_FALSE(b.ok());
  CHECK(b.err().message.find("node rank 3 is outside 0..0") != std::string::npos);

  std::optional<outcome> first;
  std::thread t0([&] { first = join_and_start(worker(port, 0, 0)); });
  // Once rank 0 is in, a second (node 0, local rank 0) is turned away.
  REQUIRE(sink.eventually_has("rank 0 (node 0, local rank 0, host 127.0.0.1) registered"));
  auto dup = rendezvous_client::join(worker(port, 0, 0));
  REQUIRE_FALSE(dup.ok());
  CHECK(dup.err().message.find(
            "rank 0 (node 0, local rank 0) is already registered from 127.0.0.1") !=
        std::string::npos);
  auto second = join_and_start(worker(port, 0, 1));
  t0.join();
  CHECK_MESSAGE(second.error == "", second.error);
  CHECK(second.rank == 1);
  REQUIRE(first.has_value());
  CHECK_MESSAGE(first->error == "", first->error);
  CHECK(first->rank == 0);
  CHECK(server->wait().ok());
}

TEST_CASE("a master port that is taken is named with a hint to pick another --master_port") {
  log_sink sink;
  auto first = serve(1, 1, sink);
  transport::rendezvous_server_options o;
  o.listen = {"127.0.0.1", first->port()};
  o.job_token = token;
  auto second = rendezvous_server::bind(o);
  REQUIRE_FALSE(second.ok());
  CHECK(second.err().to_string() == "port " + std::to_string(first->port()) +
                                        " on 127.0.0.1 is already in use\n  hint: pick another "
                                        "--master_port");
}

TEST_CASE(
    "a worker that never arrives: the time-out names it and those that came, and the waiting "
    "workers are told") {
  log_sink sink;
  auto server = serve(4, 2, sink, 500ms);
  std::vector<outcome> got(3);
  std::vector<std::thread> th;
  for (int r = 0; r < 3; ++r)
    th.emplace_back([&, r] { got[r] = join_and_start(worker(server->port(), r / 2, r % 2)); });
  auto res = server->wait();
  for (auto& t : th) t.join();
  REQUIRE_FALSE(res.ok());
  const std::string& m = res.err().message;
  CHECK(m.find("timed out after 500 ms with 3 of 4 workers registered") != std::string::npos);
  CHECK(m.find("missing: rank 3 (node 1, local rank 1, on host 127.0.0.1)") != std::string::npos);
  CHECK(m.find("arrived: rank 0 (node 0, local rank 0, host 127.0.0.1), rank 1 (node 0, local "
               "rank 1, host 127.0.0.1), rank 2 (node 1, local rank 0, host 127.0.0.1)") !=
        std::string::npos);
  for (auto& g : got) {
    CHECK(g.error.find("the job could not form") != std::string::npos);
    CHECK(g.error.find("missing: rank 3") != std::string::npos);
  }
}

TEST_CASE("a node that sends no worker at all is named as a node") {
  log_sink sink;
  auto server = serve(4, 2, sink, 300ms);
  std::vector<std::thread> th;
  for (int l = 0; l < 2; ++l)
    th.emplace_back([&, l] { join_and_start(worker(server->port(), 0, l)); });
  auto res = server->wait();
  for (auto& t : th) t.join();
  REQUIRE_FALSE(res.ok());
  CHECK(res.err().message.find("missing: node 1 (ranks 2-3; none of its workers arrived)") !=
        std::string::npos);
}

TEST_CASE("a worker that leaves after the table but before starting stops the job with its name") {
  log_sink sink;
  auto server = serve(2, 2, sink);
  std::optional<outcome> staying;
  std::thread t0([&] { staying = join_and_start(worker(server->port(), 0, 0)); });
  {
    auto leaving = rendezvous_client::join(worker(server->port(), 0, 1));
    CHECK(leaving.ok());
  }
  t0.join();
  auto res = server->wait();
  REQUIRE_FALSE(res.ok());
  CHECK(
      res.err().message.find("rank 1 (node 0, local rank 1, host 127.0.0.1) left the rendezvous") !=
      std::string::npos);
  REQUIRE(staying.has_value());
  CHECK(staying->error.find("rank 1 (node 0, local rank 1, host 127.0.0.1) left") !=
        std::string::npos);
}

TEST_CASE("a worker whose master never answers gives up naming the address") {
  std::uint16_t dead;
  {
    asio::io_context io;
    asio::ip::tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
    dead = a.local_endpoint().port();
  }
  auto o = worker(dead, 0, 0);
  o.timeout = 300ms;
  auto c = rendezvous_client::join(o);
  REQUIRE_FALSE(c.ok());
  CHECK(c.err().message.find("cannot reach the rendezvous at 127.0.0.1:" + std::to_string(dead) +
                             " within 300 ms") != std::string::npos);
}

TEST_CASE("a job that does not split into whole nodes is refused before listening") {
  transport::rendezvous_server_options o;
  o.listen = {"127.0.0.1", 0};
  o.world_size = 6;
  o.local_world_size = 4;
  auto s = rendezvous_server::bind(o);
  REQUIRE_FALSE(s.ok());
  CHECK(s.err().message.find("6 workers with 4 per node") != std::string::npos);
}

TEST_CASE("the rendezvous bodies decode back to what was encoded and nothing else") {
  transport::registration reg;
  reg.token = transport::token_hash(token);
  reg.worker.node_rank = 1;
  reg.worker.local_rank = 2;
  reg.worker.data = {"10.0.0.7", 29400};
  reg.worker.blob = std::string("nccl\0id", 7);
  std::vector<char> body = transport::encode_registration(reg);
  auto back = transport::decode_registration(body.data(), body.size());
  REQUIRE(back.has_value());
  CHECK(back->token == reg.token);
  CHECK(back->worker.node_rank == 1);
  CHECK(back->worker.local_rank == 2);
  CHECK(back->worker.data == reg.worker.data);
  CHECK(back->worker.blob == reg.worker.blob);
  body.push_back('x');
  CHECK_FALSE(transport::decode_registration(body.data(), body.size()).has_value());
  body.resize(body.size() - 2);
  CHECK_FALSE(transport::decode_registration(body.data(), body.size()).has_value());

  transport::job_table table;
  table.workers = {reg.worker, reg.worker};
  table.workers[1].data.host = "10.0.0.8";
  std::vector<char> t = transport::encode_table(1, table);
  auto got = transport::decode_table(t.data(), t.size());
  REQUIRE(got.has_value());
  CHECK(got->first == 1);
  REQUIRE(got->second.workers.size() == 2);
  CHECK(got->second.workers[0].rank == 0);
  CHECK(got->second.workers[1].rank == 1);
  CHECK(got->second.data_endpoints() == table.data_endpoints());
  CHECK(transport::encode_table(got->first, got->second) == t);
  t.pop_back();
  CHECK_FALSE(transport::decode_table(t.data(), t.size()).has_value());

  std::vector<char> why = transport::encode_reason("wrong job token");
  CHECK(transport::decode_reason(why.data(), why.size()) == "wrong job token");
}

TEST_CASE("a table announcing more rows than its bytes can hold is refused") {
  // Rank 0 of 6 workers in 8 + 100 bytes: at 18 bytes a row at least, 5 fit.
  transport::wire_writer w;
  w.put(std::int32_t{0});
  w.put(std::int32_t{6});
  w.bytes().resize(8 + 100, 0);
  CHECK_FALSE(transport::decode_table(w.bytes().data(), w.bytes().size()).has_value());
  // Two rows of the fewest bytes each (empty host and blob) still decode.
  transport::job_table two;
  two.workers.resize(2);
  std::vector<char> t = transport::encode_table(0, two);
  CHECK(t.size() == 8 + 2 * 18);
  CHECK(transport::decode_table(t.data(), t.size()).has_value());
}
