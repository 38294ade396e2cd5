// The nccl transport. Everywhere (the CPU build too): its control records and the NCCL id in the
// rendezvous blob. Where CUDA and NCCL are built in and a GPU is visible (they skip with a message
// otherwise): one rank on one GPU (tensors to itself in any order, collectives, errors); two
// processes on one GPU, which NCCL refuses, with an error that must name the duplicate GPU; and
// three processes on one GPU that NCCL is told sit on three hosts (NCCL_HOSTID, sockets over
// loopback), which is how a job of several ranks runs on a machine with one GPU. The processes
// are this test binary started again on a hidden case ("nccl peer process").
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "transport/nccl_wire.hpp"

#if defined(TROUPE_HAVE_NCCL)
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "kernels/select.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "transport/nccl.hpp"
#include "transport/rendezvous.hpp"
#include "transport/transport.hpp"
#endif

using namespace troupe;
using core::dtype;
using core::tensor;
using transport::control_kind;
using transport::control_record;

namespace {

tensor pattern(core::shape_t shape, dtype t, unsigned seed) {
  tensor x = tensor::zeros(std::move(shape), t);
  auto* b = static_cast<unsigned char*>(x.raw());
  for (std::size_t i = 0; i < x.bytes(); ++i) b[i] = static_cast<unsigned char>(seed * 131 + i * 7);
  return x;
}

bool same_bytes(const tensor& a, const tensor& b) {
  return a.type() == b.type() && a.shape() == b.shape() &&
         (a.bytes() == 0 || std::memcmp(a.raw(), b.raw(), a.bytes()) == 0);
}

// Writes `v` at byte `off` of a record.
template <class T>
void poke(tensor& frame, std::size_t off, T v) {
  std::memcpy(static_cast<char*>(frame.raw()) + off, &v, sizeof v);
}

std::string decode_error(const tensor& frame) {
  control_record r;
  tensor payload;
  return r.decode(frame, &payload);
}

}  // namespace

TEST_CASE("nccl control records carry dtype, shape and sequence number, and host bytes inline") {
  tensor host = pattern({3, 5}, dtype::bf16, 1);
  control_record r;
  tensor payload;
  REQUIRE(r.decode(control_record::encode_host(host), &payload) == "");
  CHECK(r.kind == control_kind::host);
  CHECK(same_bytes(payload, host));

  tensor shape_only = tensor::zeros({2, 0, 7}, dtype::f64);
  tensor frame = control_record::encode_device(shape_only, 41);
  CHECK(frame.bytes() == control_record::header_size);
  control_record d;
  tensor none;
  REQUIRE(d.decode(frame, &none) == "");
  CHECK(d.kind == control_kind::device);
  CHECK(d.dt == dtype::f64);
  CHECK(d.shape == core::shape_t{2, 0, 7});
  CHECK(d.seq == 41);
  CHECK(d.payload_bytes() == 0);
  CHECK_FALSE(none.defined());

  control_record big;
  REQUIRE(big.decode(control_record::encode_device(tensor::zeros({4, 3}, dtype::i32), 7), &none) ==
          "");
  CHECK(big.payload_bytes() == 48);
}

TEST_CASE("a malformed nccl control record is refused with the reason") {
  CHECK(decode_error(tensor::zeros({10}, dtype::u16)).find("shorter than its 128-byte header") !=
        std::string::npos);
  CHECK(decode_error(tensor::zeros({64}, dtype::u16)).find("bad magic") != std::string::npos);

  tensor good = control_record::encode_host(pattern({4}, dtype::f32, 2));
  tensor f = good.clone();
  poke<std::uint16_t>(f, 4, 9);
  CHECK(decode_error(f).find("version 9") != std::string::npos);
  f = good.clone();
  poke<std::uint8_t>(f, 6, 3);
  CHECK(decode_error(f).find("unknown transfer kind 3") != std::string::npos);
  f = good.clone();
  poke<std::uint8_t>(f, 7, 9);
  CHECK(decode_error(f).find("unknown dtype 9") != std::string::npos);
  f = good.clone();
  poke<std::uint8_t>(f, 8, 9);
  CHECK(decode_error(f).find("9 dimensions") != std::string::npos);
  f = good.clone();
  poke<std::int64_t>(f, 24, -4);
  CHECK(decode_error(f).find("negative dimension") != std::string::npos);
  f = good.clone();
  poke<std::uint64_t>(f, 88, 12);
  CHECK(decode_error(f).find("payload of 12 bytes for a [4] fp32 tensor") != std::string::npos);
  f = good.clone();
  poke<std::uint8_t>(f, 6, static_cast<std::uint8_t>(control_kind::device));
  CHECK(decode_error(f).find("16 bytes after the header, expected 0") != std::string::npos);
}

TEST_CASE("the NCCL id travels as a blob word, found among other words, and bad ones are named") {
  transport::nccl_id id;
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(255 - i);
  std::string word = transport::nccl_id_word(id);
  CHECK(word.rfind("nccl_id=", 0) == 0);
  CHECK(word.size() == 8 + 2 * transport::nccl_id_bytes);
  auto back = transport::nccl_id_from_blob("caf_port=4242 " + word + " other=x");
  REQUIRE(back.ok());
  CHECK(back.value() == id);

  auto missing = transport::nccl_id_from_blob("caf_port=4242");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.err().message.find("rank 0's rendezvous blob has no nccl_id word") !=
        std::string::npos);
  CHECK(missing.err().hint.find("make_nccl_blob") != std::string::npos);
  auto short_id = transport::nccl_id_from_blob("nccl_id=abcd");
  REQUIRE_FALSE(short_id.ok());
  CHECK(short_id.err().message.find("4 hex digits, expected 256") != std::string::npos);
  std::string bad = word;
  bad[10] = 'Z';
  auto not_hex = transport::nccl_id_from_blob(bad);
  REQUIRE_FALSE(not_hex.ok());
  CHECK(not_hex.err().message.find("not lowercase hex") != std::string::npos);
}

#if defined(TROUPE_HAVE_NCCL)

using transport::nccl_group;
using transport::nccl_transport;
using transport::tag;
using namespace std::chrono_literals;

namespace {

const char* const token = "nccl-test-token";

bool gpu_or_skip() {
  if (kernels::cuda_available()) return true;
  MESSAGE("skipped: no CUDA device in this build or on this machine");
  return false;
}

// Every NCCL socket of these tests (bootstrap and, between "hosts", data) stays on loopback.
void loopback_only() { setenv("NCCL_SOCKET_IFNAME", "lo", 0); }

std::string failure_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// One worker of a job: its transport, joined through a rendezvous on loopback.
// The transport is the last member, so it goes first: its callbacks use the others.
struct worker {
  std::atomic<int> arrivals{0};
  std::atomic<int> failures{0};
  std::mutex mu;
  std::string failure_text;
  std::unique_ptr<transport::rendezvous_client> client;
  std::unique_ptr<nccl_transport> t;
};

transport::nccl_options worker_options(worker& w) {
  transport::nccl_options o;
  o.control.listen = {"127.0.0.1", 0};
  o.control.job_token = token;
  o.control.connect_timeout = 60s;
  o.device = 0;
  o.setup_timeout = 90s;
  o.op_timeout = 90s;
  o.on_arrival = [&w](int, const tag&) { ++w.arrivals; };
  o.on_failure = [&w](const std::string& why) {
    std::lock_guard<std::mutex> lk(w.mu);
    w.failure_text = why;
    ++w.failures;
  };
  return o;
}

// Binds, registers (local rank `local`, with the NCCL id when it is rank 0) and starts; returns
// start()'s status. The caller then calls client->start().
core::status join_job(worker& w, std::uint16_t master_port, int local) {
  auto t = nccl_transport::bind(worker_options(w));
  if (!t.ok()) return t.err();
  w.t = std::move(t.value());
  transport::rendezvous_client_options co;
  co.master = {"127.0.0.1", master_port};
  co.job_token = token;
  co.node_rank = 0;
  co.local_rank = local;
  co.host = "127.0.0.1";
  co.data_port = w.t->port();
  co.timeout = 90s;
  if (local == 0) {
    auto blob = transport::make_nccl_blob();
    if (!blob.ok()) return blob.err();
    co.blob = blob.value();
  }
  auto c = transport::rendezvous_client::join(co);
  if (!c.ok()) return c.err();
  w.client = std::move(c.value());
  return w.t->start(w.client->rank(), w.client->table());
}

std::unique_ptr<transport::rendezvous_server> rendezvous(int world) {
  transport::rendezvous_server_options so;
  so.listen = {"127.0.0.1", 0};
  so.job_token = token;
  so.world_size = world;
  so.local_world_size = world;
  so.timeout = 120s;
  so.log = [](const std::string&) {};
  auto s = transport::rendezvous_server::bind(so);
  REQUIRE_MESSAGE(s.ok(), s.err().to_string());
  return std::move(s.value());
}

// A started one-rank job.
struct solo {
  std::unique_ptr<transport::rendezvous_server> server = rendezvous(1);
  worker w;
  solo() {
    auto st = join_job(w, server->port(), 0);
    REQUIRE_MESSAGE(st.ok(), st.err().to_string());
    auto go = w.client->start();
    REQUIRE_MESSAGE(go.ok(), go.err().to_string());
  }
};

tensor upload(kernels::backend& be, const tensor& host) {
  tensor d = be.empty(host.shape(), host.type());
  be.copy(host, d);
  be.record_ready(d);
  return d;
}

tensor download(kernels::backend& be, const tensor& dev) {
  be.wait_ready(dev);
  return be.to_host(dev);
}

CUstream_st* stream_of(kernels::backend& be) {
  return static_cast<kernels::cuda::cuda_backend&>(be).stream();
}

tensor filled_f32(std::int64_t n, const std::function<float(std::int64_t)>& f) {
  tensor x = tensor::zeros({n}, dtype::f32);
  for (std::int64_t i = 0; i < n; ++i) x.data<float>()[i] = f(i);
  return x;
}

tensor nan_f32(std::int64_t n) {
  return filled_f32(n, [](std::int64_t) { return std::nanf(""); });
}

}  // namespace

TEST_CASE(
    "nccl, one rank: tagged device and host tensors sent to itself come back in any order, "
    "byte for byte") {
  if (!gpu_or_skip()) return;
  loopback_only();
  auto be = kernels::make_backend("cuda:0");
  solo job;
  nccl_transport& t = *job.w.t;
  CHECK(t.rank() == 0);
  CHECK(t.size() == 1);

  struct item {
    tensor original;
    bool on_device;
    tag tg;
  };
  std::vector<item> items = {
      {pattern({1024}, dtype::f32, 1), true, {}},
      {pattern({3, 5, 7}, dtype::bf16, 2), true, {}},
      {pattern({0, 4}, dtype::f32, 3), true, {}},
      {pattern({2048, 4096}, dtype::f32, 4), true, {}},  // 32 MiB
      {pattern({17}, dtype::i32, 5), true, {}},
      {pattern({2, 3, 1, 1, 2, 1, 1, 2}, dtype::f16, 6), true, {}},
      {pattern({4, 4}, dtype::f64, 7), false, {}},
      {pattern({3}, dtype::u16, 8), false, {}},
  };
  for (std::size_t i = 0; i < items.size(); ++i) {
    items[i].tg = tag{static_cast<std::int64_t>(i), 7, 1, static_cast<std::int32_t>(i % 3), 0};
    // The sent tensor's handle goes at once: the transport must hold it until the GPU read it.
    t.send(0, items[i].on_device ? upload(*be, items[i].original) : items[i].original.clone(),
           items[i].tg);
  }
  for (int spin = 0; spin < 1000 && job.w.arrivals.load() < static_cast<int>(items.size()); ++spin)
    std::this_thread::sleep_for(10ms);
  CHECK(job.w.arrivals.load() == static_cast<int>(items.size()));
  CHECK(t.ready(0, items.back().tg));
  CHECK_FALSE(t.ready(0, tag{99, 7, 1, 0, 0}));
  const std::vector<std::size_t> order = {5, 0, 7, 3, 1, 6, 2, 4};
  for (std::size_t i : order) {
    CAPTURE(i);
    tensor got = t.recv(0, items[i].tg, 10s);
    CHECK(got.dev().is_cpu() == !items[i].on_device);
    tensor host = items[i].on_device ? download(*be, got) : got;
    CHECK(same_bytes(host, items[i].original));
  }
  CHECK(t.flush(10s));
  CHECK(t.failure().empty());
}

TEST_CASE(
    "nccl, one rank: all_reduce, reduce_scatter, all_gather and broadcast on the job and on "
    "a split group; host collectives over the transport") {
  if (!gpu_or_skip()) return;
  loopback_only();
  auto be = kernels::make_backend("cuda:0");
  solo job;
  nccl_transport& t = *job.w.t;
  auto split = t.split({0});
  REQUIRE_MESSAGE(split.ok(), split.err().to_string());
  REQUIRE(split.value() != nullptr);
  const std::int64_t n = 4096;
  tensor x =
      filled_f32(n, [](std::int64_t i) { return 0.5f * static_cast<float>(i % 101) - 3.0f; });
  for (nccl_group* g : {&t.world(), split.value()}) {
    CHECK(g->members() == std::vector<int>{0});
    CHECK(g->position() == 0);
    tag tg{1, 3, 0, -1, 0};
    tensor d = upload(*be, x);
    g->all_reduce(d, tg, stream_of(*be));
    CHECK(same_bytes(be->to_host(d), x));
    tensor slice = upload(*be, nan_f32(n));
    g->reduce_scatter(d, slice, tg, stream_of(*be));
    CHECK(same_bytes(be->to_host(slice), x));
    tensor all = upload(*be, nan_f32(n));
    g->all_gather(d, all, tg, stream_of(*be));
    CHECK(same_bytes(be->to_host(all), x));
    g->broadcast(d, 0, tg, stream_of(*be));
    CHECK(same_bytes(be->to_host(d), x));
    tensor half = tensor::zeros({256}, dtype::bf16);  // numbers, not arbitrary bit patterns
    for (int i = 0; i < 256; ++i)
      half.data<std::uint16_t>()[i] = core::f32_to_bf16(static_cast<float>(i % 17) - 8.0f);
    tensor dh = upload(*be, half);
    g->all_reduce(dh, tg, stream_of(*be));
    CHECK(same_bytes(be->to_host(dh), half));
  }
  tensor u = upload(*be, pattern({8}, dtype::u16, 3));
  CHECK(has(failure_of([&] { t.world().all_reduce(u, tag{}, stream_of(*be)); }),
            "cannot sum uint16"));
  tensor d = upload(*be, x), small = upload(*be, nan_f32(n / 2));
  CHECK(has(failure_of([&] { t.world().reduce_scatter(d, small, tag{}, stream_of(*be)); }),
            "gives slices of 4096 elements"));
  CHECK(has(failure_of([&] { t.world().all_reduce(x, tag{}, stream_of(*be)); }),
            "expects tensors on cuda:0, got cpu"));

  tensor summed = transport::all_reduce(t, {0}, x, tag{2, 3, 0, -1, 0}, 10s);
  CHECK(same_bytes(summed, x));
  CHECK(t.failure().empty());
}

TEST_CASE(
    "nccl, one rank: a tag that never comes times out naming ranks and tag; unknown peers "
    "are refused; after abort every call names the cause") {
  if (!gpu_or_skip()) return;
  loopback_only();
  auto be = kernels::make_backend("cuda:0");
  solo job;
  nccl_transport& t = *job.w.t;
  const tag never{99, 1, 2, 3, 4};
  CHECK(has(failure_of([&] { t.recv(0, never, 100ms); }),
            "rank 0 waited 100 ms for a tensor from rank 0 (step 99 kind 1 chunk 2 mb 3 part 4) "
            "that never came"));
  CHECK(has(failure_of([&] { t.recv(3, never, 100ms); }),
            "rank 0 receives from rank 3 in a job of 1 ranks"));
  tensor d = upload(*be, pattern({16}, dtype::f32, 1));
  CHECK(
      has(failure_of([&] { t.send(2, d, never); }), "rank 0 sends to rank 2 in a job of 1 ranks"));
  auto bad_split = t.split({0, 5});
  REQUIRE_FALSE(bad_split.ok());
  CHECK(has(bad_split.err().message, "rank 5 is not in the job of 1 ranks"));
  CHECK(t.failure().empty());

  t.abort("the test pulls the plug");
  CHECK(t.failure() == "rank 0: aborted: the test pulls the plug");
  CHECK(job.w.failures.load() == 1);
  CHECK(job.w.failure_text == "rank 0: aborted: the test pulls the plug");
  CHECK(has(failure_of([&] { t.send(0, d, never); }),
            "rank 0 cannot send step 99 kind 1 chunk 2 mb 3 part 4 to rank 0: aborted: the test "
            "pulls the plug"));
  auto before = std::chrono::steady_clock::now();
  CHECK(has(failure_of([&] { t.recv(0, never, 60s); }),
            "rank 0 cannot receive step 99 kind 1 chunk 2 mb 3 part 4 from rank 0: aborted"));
  CHECK(std::chrono::steady_clock::now() - before < 5s);
  CHECK(has(failure_of([&] { t.world().all_reduce(d, never, stream_of(*be)); }),
            "cannot run all_reduce over ranks [0]"));
  CHECK(job.w.failures.load() == 1);
}

// ---- several processes on the one GPU ----

namespace {

struct spawned {
  pid_t pid = -1;
  std::string log;
};

// Starts this test binary again on the hidden peer case, as local rank `local` of `world`.
spawned spawn_peer(const std::string& scenario, int local, int world, std::uint16_t port,
                   std::vector<std::string> env) {
  spawned s;
  s.log = "/tmp/troupe-nccl-test-" + std::to_string(getpid()) + "-" + scenario + "-" +
          std::to_string(local) + ".log";
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  env.push_back("TROUPE_NCCL_PEER=" + scenario + " " + std::to_string(local) + " " +
                std::to_string(world) + " " + std::to_string(port));
  std::vector<std::string> args = {"/proc/self/exe", "-ns", "-tc=nccl peer process*"};
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, s.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  int rc = posix_spawn(&s.pid, "/proc/self/exe", &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE_MESSAGE(rc == 0, "posix_spawn failed: " << std::strerror(rc));
  return s;
}

// Exit codes of the peers (-1: killed at the deadline).
std::vector<int> wait_all(std::vector<spawned>& ps, std::chrono::seconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<int> codes(ps.size(), -2);
  for (std::size_t done = 0; done < ps.size();) {
    for (std::size_t i = 0; i < ps.size(); ++i) {
      if (codes[i] != -2) continue;
      int status = 0;
      if (waitpid(ps[i].pid, &status, WNOHANG) == ps[i].pid) {
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        ++done;
      }
    }
    if (done < ps.size() && std::chrono::steady_clock::now() > deadline) {
      for (std::size_t i = 0; i < ps.size(); ++i)
        if (codes[i] == -2) {
          kill(ps[i].pid, SIGKILL);
          waitpid(ps[i].pid, nullptr, 0);
          codes[i] = -1;
        }
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  return codes;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The peer side: prints what it sees and returns its exit code (0: every check held).
struct peer_log {
  int failed = 0;
  void say(const std::string& s) {
    std::printf("%s\n", s.c_str());
    std::fflush(stdout);
  }
  void expect(bool ok, const std::string& what) {
    if (!ok) ++failed;
    say((ok ? "ok: " : "FAIL: ") + what);
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Two ranks on one GPU and one host: NCCL must refuse, and the error must say why.
int peer_duplicate(peer_log& log, int local, std::uint16_t port) {
  worker w;
  auto st = join_job(w, port, local);
  if (st.ok()) {
    log.expect(false, "NCCL accepted two ranks on one GPU");
    return 1;
  }
  const std::string m = st.err().to_string();
  log.say("start() failed as it should: " + m);
  log.expect(has(m, "rank " + std::to_string(local) + " cannot join the NCCL communicators"),
             "the error names this rank");
  log.expect(has(m, "Duplicate GPU"), "the error names the duplicate GPU");
  log.expect(has(m, "NCCL needs one GPU per rank"), "the error says what to do");
  return log.failed ? 1 : 0;
}

float p2p_value(int src, int dst, int i, std::int64_t e) {
  return static_cast<float>((src * 7 + dst * 3 + i * 11 + e) % 1000);
}

// A job of `world` ranks on one GPU, each rank told it is on its own host: every pair exchanges
// large tensors both ways before anyone receives, in an order no schedule would choose; then
// collectives with exact integer sums; then the last rank dies and the others must say so.
int peer_hosts(peer_log& log, int local, int world, std::uint16_t port) {
  auto t0 = std::chrono::steady_clock::now();
  worker w;
  auto st = join_job(w, port, local);
  if (!st.ok()) {
    log.expect(false, "start(): " + st.err().to_string());
    return 1;
  }
  auto go = w.client->start();
  if (!go.ok()) {
    log.expect(false, "rendezvous start: " + go.err().to_string());
    return 1;
  }
  nccl_transport& t = *w.t;
  const int me = t.rank();
  log.say("rank " + std::to_string(me) + ": communicators ready after " +
          std::to_string(seconds_since(t0)) + " s");
  auto be = kernels::make_backend("cuda:0");
  CUstream_st* s = stream_of(*be);

  // Point to point: 3 transfers to every rank (itself included), 6-8 MiB each.
  const std::int64_t sizes[3] = {std::int64_t{3} << 19, std::int64_t{1} << 21, 1536 * 1024 + 3};
  auto p0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < world; ++k) {
      int dst = (me + k) % world;
      tensor h = filled_f32(sizes[i], [&](std::int64_t e) { return p2p_value(me, dst, i, e); });
      t.send(dst, upload(*be, h), tag{i, 1, me, dst, 0});
    }
  int bad = 0;
  for (int i = 2; i >= 0; --i)
    for (int src = world - 1; src >= 0; --src) {
      tensor got = download(*be, t.recv(src, tag{i, 1, src, me, 0}, 90s));
      if (got.numel() != sizes[i]) {
        ++bad;
        continue;
      }
      for (std::int64_t e = 0; e < sizes[i]; ++e)
        if (got.data<float>()[e] != p2p_value(src, me, i, e)) {
          ++bad;
          break;
        }
    }
  log.expect(bad == 0, "every tensor from every rank arrived intact (" + std::to_string(bad) +
                           " wrong) in " + std::to_string(seconds_since(p0)) + " s");
  log.expect(t.flush(60s), "every send left the GPU");

  // Collectives on the job: integer values, so any summation order gives the same bits.
  const std::int64_t n = std::int64_t{1} << 20;
  tensor x = upload(*be, filled_f32(n, [&](std::int64_t e) { return (me + 1.0f) * (e % 97); }));
  t.world().all_reduce(x, tag{10, 2, 0, -1, 0}, s);
  tensor xs = be->to_host(x);
  const float ranks_sum = world * (world + 1) / 2.0f;
  bool ok = true;
  for (std::int64_t e = 0; e < n; ++e) ok = ok && xs.data<float>()[e] == ranks_sum * (e % 97);
  log.expect(ok, "all_reduce over the job");

  const std::int64_t per = 4096;
  tensor y =
      upload(*be, filled_f32(per * world, [&](std::int64_t e) { return me + 1.0f * (e % 13); }));
  tensor slice = upload(*be, nan_f32(per));
  t.world().reduce_scatter(y, slice, tag{10, 3, 0, -1, 0}, s);
  tensor ss = be->to_host(slice);
  ok = true;
  for (std::int64_t e = 0; e < per; ++e)
    ok = ok &&
         ss.data<float>()[e] == world * (world - 1) / 2.0f + world * 1.0f * ((me * per + e) % 13);
  log.expect(ok, "reduce_scatter over the job");

  tensor mine = tensor::zeros({1000}, dtype::i32);
  for (int e = 0; e < 1000; ++e) mine.data<std::int32_t>()[e] = me * 1000 + e;
  tensor gathered = upload(*be, tensor::zeros({1000 * world}, dtype::i32));
  t.world().all_gather(upload(*be, mine), gathered, tag{10, 4, 0, -1, 0}, s);
  tensor gs = be->to_host(gathered);
  ok = true;
  for (int e = 0; e < 1000 * world; ++e) ok = ok && gs.data<std::int32_t>()[e] == e;
  log.expect(ok, "all_gather over the job");

  tensor b =
      upload(*be, me == 1 ? pattern({333}, dtype::f16, 5) : tensor::zeros({333}, dtype::f16));
  t.world().broadcast(b, 1, tag{10, 5, 0, -1, 0}, s);
  log.expect(same_bytes(be->to_host(b), pattern({333}, dtype::f16, 5)), "broadcast from rank 1");

  // Groups {0, 2} and {1}: the data-parallel shape of a two-stage pipeline.
  std::vector<int> group = me == 1 ? std::vector<int>{1} : std::vector<int>{0, 2};
  auto g = t.split(group);
  if (!g.ok()) {
    log.expect(false, "split: " + g.err().to_string());
    return 1;
  }
  tensor v = upload(*be, filled_f32(512, [&](std::int64_t e) { return me + 1.0f + e % 5; }));
  g.value()->all_reduce(v, tag{10, 6, 0, -1, 0}, s);
  tensor vs = be->to_host(v);
  ok = true;
  for (std::int64_t e = 0; e < 512; ++e) {
    float want = 0;
    for (int r : group) want += r + 1.0f + e % 5;
    ok = ok && vs.data<float>()[e] == want;
  }
  log.expect(ok, "all_reduce over the split group " + std::string(me == 1 ? "{1}" : "{0, 2}"));

  std::vector<int> everyone;
  for (int r = 0; r < world; ++r) everyone.push_back(r);
  tensor hs =
      transport::all_reduce(t, everyone, filled_f32(96, [&](std::int64_t) { return me + 1.0f; }),
                            tag{11, 1, 0, -1, 0}, 60s);
  ok = true;
  for (int e = 0; e < 96; ++e) ok = ok && hs.data<float>()[e] == ranks_sum;
  log.expect(ok, "host all_reduce (transport.hpp) over the nccl transport");
  log.expect(t.failure().empty(), "no failure so far: " + t.failure());

  // The last rank dies without a word; the others must name it, promptly.
  transport::all_reduce(t, everyone, tensor::zeros({world}), tag{12, 1, 0, -1, 0}, 60s);
  if (me == world - 1) {
    log.expect(t.flush(30s), "everything this rank sent has left it");
    log.say("rank " + std::to_string(me) + " exits abruptly");
    std::fflush(stdout);
    _exit(log.failed ? 1 : 0);  // no destructor runs: its peers see a crash, not a goodbye
  }
  auto d0 = std::chrono::steady_clock::now();
  std::string m = failure_of([&] { t.recv(world - 1, tag{13, 1, 0, 0, 0}, 90s); });
  double took = seconds_since(d0);
  log.say("recv from the dead rank: " + m);
  log.expect(took < 30, "noticed in " + std::to_string(took) + " s");
  log.expect(has(m, "rank " + std::to_string(me) + " cannot receive step 13") &&
                 has(m, "lost rank " + std::to_string(world - 1)),
             "the error names this rank, the tag and the lost rank");
  for (int spin = 0; spin < 3000 && w.failures.load() == 0; ++spin)
    std::this_thread::sleep_for(10ms);
  std::string told;
  {
    std::lock_guard<std::mutex> lk(w.mu);
    told = w.failure_text;
  }
  log.expect(w.failures.load() == 1 && has(told, "rank " + std::to_string(me) + ": lost rank "),
             "on_failure was called once: " + told);
  w.t.reset();
  log.say("transport closed after the failure");
  return log.failed ? 1 : 0;
}

}  // namespace

TEST_CASE("nccl peer process (started by the multi-process nccl tests)" * doctest::skip()) {
  const char* spec = std::getenv("TROUPE_NCCL_PEER");
  REQUIRE(spec);
  std::istringstream in(spec);
  std::string scenario;
  int local = 0, world = 0;
  std::uint16_t port = 0;
  in >> scenario >> local >> world >> port;
  peer_log log;
  int code = 1;
  try {
    code = scenario == "duplicate" ? peer_duplicate(log, local, port)
                                   : peer_hosts(log, local, world, port);
  } catch (const std::exception& e) {
    log.say(std::string("FAIL: exception: ") + e.what());
  }
  std::fflush(stdout);
  _exit(code);
}

TEST_CASE(
    "nccl, two processes on one GPU: NCCL refuses them and the error names the duplicate GPU") {
  if (!gpu_or_skip()) return;
  auto server = rendezvous(2);
  std::vector<spawned> ps;
  for (int k = 0; k < 2; ++k)
    ps.push_back(spawn_peer("duplicate", k, 2, server->port(), {"NCCL_SOCKET_IFNAME=lo"}));
  auto codes = wait_all(ps, 60s);
  for (std::size_t k = 0; k < ps.size(); ++k) {
    std::string out = read_file(ps[k].log);
    MESSAGE("peer " << k << " (exit " << codes[k] << "):\n" << out);
    CHECK(codes[k] == 0);
    CHECK(has(out, "Duplicate GPU"));
    std::remove(ps[k].log.c_str());
  }
}

TEST_CASE(
    "nccl, three processes on one GPU as three hosts: pairs exchange both ways in any order, "
    "collectives sum exactly, a dead rank is named") {
  if (!gpu_or_skip()) return;
  auto server = rendezvous(3);
  std::vector<spawned> ps;
  for (int k = 0; k < 3; ++k)
    ps.push_back(spawn_peer("hosts", k, 3, server->port(),
                            {"NCCL_HOSTID=troupe-nccl-test-host-" + std::to_string(k),
                             "NCCL_SOCKET_IFNAME=lo", "NCCL_IB_DISABLE=1", "NCCL_MNNVL_ENABLE=0"}));
  auto codes = wait_all(ps, 150s);
  for (std::size_t k = 0; k < ps.size(); ++k) {
    std::string out = read_file(ps[k].log);
    MESSAGE("peer " << k << " (exit " << codes[k] << "):\n" << out);
    CHECK(codes[k] == 0);
    CHECK_FALSE(has(out, "FAIL"));
    std::remove(ps[k].log.c_str());
  }
}

#endif  // TROUPE_HAVE_NCCL
