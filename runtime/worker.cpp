#include "runtime/worker.hpp"

#include <unistd.h>

#include <caf/io/all.hpp>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/machine.hpp"
#include "runtime/host.hpp"
#include "transport/rendezvous.hpp"
#include "transport/tcp.hpp"
#ifdef TROUPE_HAVE_NCCL
#include "transport/nccl.hpp"
#endif

namespace troupe::actors {
namespace {

using outcome_promise = std::promise<core::status>;

class worker_actor_config : public caf::actor_system_config {
 public:
  explicit worker_actor_config(int threads) {
    register_messages(*this);
    configure_scheduler(*this, threads);
    load<caf::io::middleman>();
  }
};

/// One worker's actors (null where it hosts none).
struct local_actors {
  caf::actor stage, shard, loader, coordinator, writer;
};

/// The actors of the workers of higher rank, which introduce themselves to this one: CAF 0.17
/// drops one of two connections two nodes open to each other at the same moment, so worker r
/// connects only to the workers below it, and those above connect to it.
struct introductions {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, std::pair<caf::actor, local_actors>> peers;  // rank -> (node, actors)
};

struct node_state {
  local_actors mine;
  std::shared_ptr<outcome_promise> outcome;
  bool settled = false;
  bool started = false;
  bool coordinator_gone = false;
};

using node_t = caf::stateful_actor<node_state>;

void settle(node_t* self, core::status st) {
  if (self->state.settled) return;
  self->state.settled = true;
  self->state.outcome->set_value(std::move(st));
}

/// The node actor of one worker process: hands its actors to peers, reports a heartbeat to the
/// coordinator, and learns how the job ended — from worker 0's stop message, or, when worker 0's
/// process is gone, from the coordinator's down message.
caf::behavior node_actor(node_t* self, std::shared_ptr<job> j, int rank, local_actors mine,
                         std::shared_ptr<outcome_promise> outcome,
                         std::shared_ptr<introductions> intros) {
  self->state.mine = mine;
  self->state.outcome = std::move(outcome);
  // An exception in a handler (an introduction that cannot be stored, say) ends this worker with
  // the reason rather than leaving the process waiting on an outcome that never comes.
  self->set_exception_handler([self, rank](caf::scheduled_actor*, std::exception_ptr& e) {
    settle(self, core::error::make("the node actor of worker rank " + std::to_string(rank) +
                                       " failed: " + exception_text(e),
                                   "this is a bug in troupe; the worker's log has the context"));
    return caf::make_error(caf::exit_reason::user_shutdown);
  });
  self->set_down_handler([self, j, rank](caf::down_msg& m) {
    if (m.source != j->coordinator.address()) return;
    if (m.reason == caf::exit_reason::normal || m.reason == caf::exit_reason::user_shutdown) {
      // Worker 0 tells every node how the job ended right after its coordinator stops; give that
      // message time to arrive before concluding anything.
      self->state.coordinator_gone = true;
      self->delayed_send(self, std::chrono::seconds(15), stop_atom::value);
      return;
    }
    const std::string host = j->hosts.count(0) ? j->hosts.at(0) : "?";
    settle(self, core::error::make("worker rank 0 (host " + host + "), which runs the coordinator, "
                                   "died or became unreachable (" + self->system().render(m.reason) +
                                   "); worker rank " + std::to_string(rank) + " stops",
                                   "see worker 0's log for why it stopped; resume from the last "
                                   "checkpoint with --resume"));
  });
  return {
      [=](dir_atom) {
        auto& m = self->state.mine;
        return caf::make_message(m.stage, m.shard, m.loader, m.coordinator, m.writer);
      },
      [=](dir_atom, std::int32_t from, caf::actor node, caf::actor stage, caf::actor shard,
          caf::actor loader, caf::actor coordinator, caf::actor writer) {
        {
          std::lock_guard<std::mutex> lock(intros->mu);
          intros->peers[from] = {node, local_actors{stage, shard, loader, coordinator, writer}};
        }
        intros->cv.notify_all();
        return true;
      },
      [=](start_atom) {
        self->state.started = true;
        if (rank != 0) self->monitor(j->coordinator);
        self->send(self, tick_atom::value);
      },
      [=](tick_atom) {
        if (self->state.settled) return;
        self->request(self->state.mine.stage, std::chrono::milliseconds(900), status_atom::value)
            .then(
                [=](std::string& line) {
                  self->send(j->coordinator,
                             worker_heartbeat{rank, static_cast<std::int32_t>(::getpid()), line});
                },
                [=](caf::error&) {
                  // A tensor-parallel stage blocked in a collective cannot answer: its group's
                  // slot (actors/tp_wait.hpp) says what it waits for, and the coordinator's
                  // watchdog reports that in its place.
                  const address at{role::stage, j->layout.dp_of(rank), j->layout.pp_of(rank),
                                   j->layout.tp_of(rank)};
                  if (auto b = j->tp_blocked(at))
                    self->send(j->coordinator,
                               worker_heartbeat{rank, static_cast<std::int32_t>(::getpid()),
                                                b->first, b->second.count()});
                });
        self->delayed_send(self, std::chrono::seconds(1), tick_atom::value);
      },
      [=](stop_atom, bool ok, std::string& message, std::string& hint) {
        settle(self, ok ? core::status{}
                        : core::status{core::error::make(message, hint.empty() ? "see worker 0's log" : hint)});
        return true;
      },
      [=](stop_atom) {
        // Fifteen seconds after a normal stop of the coordinator and still no word from worker 0.
        settle(self, core::error::make("the coordinator (worker rank 0) stopped without telling worker rank " +
                                           std::to_string(rank) + " how the job ended",
                                       "see worker 0's log"));
      },
  };
}

/// The value of word `key=` in a rendezvous blob of space-separated key=value words.
std::string blob_word(const std::string& blob, const std::string& key) {
  std::size_t at = 0;
  while (at < blob.size()) {
    std::size_t end = blob.find(' ', at);
    if (end == std::string::npos) end = blob.size();
    if (blob.compare(at, key.size() + 1, key + "=") == 0) return blob.substr(at + key.size() + 1, end - at - key.size() - 1);
    at = end + 1;
  }
  return "";
}

/// What a worker is doing once its job's outcome is known (read by the shutdown guard).
std::atomic<const char*> shutdown_phase{"stopping its actors"};

/// Bounds a worker's shutdown once the job's outcome is known: stopping the actor system, closing
/// the data transport (NCCL communicators wait for their peers) and the process's exit must not
/// keep a finished job's worker alive — the launcher would wait for it forever. Checkpoints and
/// metrics are written before the outcome is known, so exiting then loses nothing.
void guard_shutdown(int rank, bool ok, std::chrono::seconds limit) {
  std::thread([rank, ok, limit] {
    std::this_thread::sleep_for(limit);
    std::fprintf(stderr,
                 "troupe worker rank %d: the job %s, but shutting down has been stuck for %lld s "
                 "while %s; exiting without waiting further (hint: with NCCL, a peer that never "
                 "closes its communicators causes this; its log says why)\n",
                 rank, ok ? "finished" : "failed", static_cast<long long>(limit.count()),
                 shutdown_phase.load());
    std::fflush(stderr);
    std::_Exit(ok ? 0 : 1);
  }).detach();
}

/// The data plane of one worker: tcp for CPU ranks, nccl for GPU ranks.
struct data_plane {
  transport::tcp_transport* tcp = nullptr;
#ifdef TROUPE_HAVE_NCCL
  transport::nccl_transport* nccl = nullptr;
#endif
  std::uint16_t port() const {
#ifdef TROUPE_HAVE_NCCL
    if (nccl) return nccl->port();
#endif
    return tcp->port();
  }
};

core::error with_rank(core::error e, int rank) {
  if (e.where.rank < 0) e.where.rank = rank;
  return e;
}

/// Enters worker `r`'s actors in the directory.
void enter(job& j, int r, const local_actors& a) {
  const int d = j.layout.dp_of(r), p = j.layout.pp_of(r), t = j.layout.tp_of(r);
  j.stages[{d, p, t}] = a.stage;
  j.shards[{p, d, t}] = a.shard;
  if (a.loader) j.loaders[d] = a.loader;
  if (a.coordinator) j.coordinator = a.coordinator;
  if (a.writer) j.writer = a.writer;
}

/// Asks the node actor of worker `r` (lower rank than this one) for its actors, and introduces
/// this worker's to it.
core::result<local_actors> meet(caf::scoped_actor& self, const job& j, int r, const caf::actor& node,
                                int rank, const caf::actor& my_node, const local_actors& mine) {
  core::result<local_actors> out = core::error::make("no answer");
  auto failed = [&](const caf::error& e) {
    out = core::error::make("worker rank " + std::to_string(r) + " (host " + j.hosts.at(r) +
                                ") did not answer on its control port: " + self->system().render(e),
                            "check that every worker runs the same troupe build and config");
  };
  self->request(node, std::chrono::seconds(30), dir_atom::value)
      .receive(
          [&](caf::actor stage, caf::actor shard, caf::actor loader, caf::actor coordinator,
              caf::actor writer) { out = local_actors{stage, shard, loader, coordinator, writer}; },
          failed);
  if (!out.ok()) return out;
  self->request(node, std::chrono::seconds(30), dir_atom::value, static_cast<std::int32_t>(rank), my_node,
                mine.stage, mine.shard, mine.loader, mine.coordinator, mine.writer)
      .receive([](bool) {}, failed);
  return out;
}

/// Whether the process of `node` is known to be gone: its connection was lost, so the proxy is
/// down and monitoring it answers at once. A message to it would be dropped unanswered.
bool known_gone(caf::scoped_actor& self, const caf::actor& node) {
  self->monitor(node);
  bool down = false, more = true;
  while (more && !down)
    self->receive([&](caf::down_msg& d) { down = d.source == node.address(); },
                  caf::after(std::chrono::milliseconds(1)) >> [&] { more = false; });
  return down;
}

/// Worker 0, once the job is over: tells every other worker's node how it ended, and waits (a
/// bounded time) until each has heard it, so its process stays reachable until then. A node whose
/// process is known to be gone (a killed worker) is not waited for.
void tell_nodes(caf::scoped_actor& self, const job& j, const core::result<model::train_summary>& r) {
  const bool ok = r.ok();
  const std::string message = ok ? std::string() : r.err().message;
  const std::string hint = ok ? std::string() : r.err().hint;
  for (auto& [rank, node] : j.nodes) {
    if (!ok && known_gone(self, node)) continue;
    self->request(node, std::chrono::seconds(5), stop_atom::value, ok, message, hint)
        .receive([](bool) {}, [](caf::error&) {});
  }
}

}  // namespace

core::result<model::train_summary> run_worker(const core::config& cfg_in, const worker_options& opt) {
  core::config cfg = cfg_in;
  const int world = cfg.parallel.data_parallel * cfg.parallel.pipeline_stage * cfg.parallel.model_parallel;
  const int rank = opt.node_rank * opt.local_world_size + opt.local_rank;
  if (opt.world_size != world)
    return core::error::at_key(cfg.source, "parallel", 0, 0,
                               "the launcher started " + std::to_string(opt.world_size) +
                                   " workers but the config needs data_parallel × model_parallel × "
                                   "pipeline_stage = " + std::to_string(world),
                               "pass --worker_num " + std::to_string(world) + " to troupe launch");
  // A GPU per local rank; with TROUPE_NCCL_HOST_PER_RANK=1 (below) every rank shares GPU 0.
  const char* shared_gpu = std::getenv("TROUPE_NCCL_HOST_PER_RANK");
  const bool share_gpu0 = shared_gpu && std::string(shared_gpu) == "1";
  if (cfg.runtime.device == "cuda") cfg.runtime.device = "cuda:" + std::to_string(share_gpu0 ? 0 : opt.local_rank);
  if (cfg.runtime.threads == 0) {
    // The node's cores are shared by its workers.
    const int cores = core::usable_cores();
    cfg.runtime.threads = std::max(1, cores / std::max(1, opt.local_world_size));
  }
  auto prepared = prepare_job(cfg, opt.run, {rank});
  if (!prepared.ok()) return with_rank(prepared.err(), rank);
  hosted_job& h = prepared.value();
  job& j = *h.j;

  // Data plane first: its port goes into the registration.
  transport::tcp_options to;
  to.job_token = opt.job_token;
  to.log = [rank](const std::string& line) { std::fprintf(stderr, "troupe worker %d: %s\n", rank, line.c_str()); };

  data_plane data;
  std::string blob;
  const bool gpu = cfg.runtime.device != "cpu";
  if (gpu) {
#ifdef TROUPE_HAVE_NCCL
    // NCCL refuses two ranks on one GPU of one host. For exercising this path with a single GPU
    // (tests, a laptop), TROUPE_NCCL_HOST_PER_RANK=1 puts every rank on GPU 0 and gives each its
    // own NCCL host id, so that NCCL treats the ranks as separate hosts and connects them over
    // sockets.
    if (share_gpu0) {
      char name[256] = {0};
      ::gethostname(name, sizeof name - 1);
      ::setenv("NCCL_HOSTID", (std::string(name) + "-rank" + std::to_string(rank)).c_str(), 1);
    }
    transport::nccl_options no;
    no.control = to;
    no.device = cfg.runtime.device.rfind("cuda:", 0) == 0 ? std::atoi(cfg.runtime.device.c_str() + 5) : 0;
    no.setup_timeout = opt.rendezvous_timeout;
    auto t = transport::nccl_transport::bind(no);
    if (!t.ok()) return with_rank(t.err(), rank);
    data.nccl = t.value().get();
    j.endpoints[rank] = std::move(t.value());
    if (rank == 0) {
      auto id = transport::make_nccl_blob();
      if (!id.ok()) return with_rank(id.err(), rank);
      blob = id.value() + " ";
    }
#else
    return with_rank(core::error::at_key(cfg.source, "runtime.device", 0, 0,
                                         "a launched job on GPUs needs the nccl transport, and this build has none",
                                         "build with CUDA and NCCL (docs/cuda.md), or set runtime.device = \"cpu\""),
                     rank);
#endif
  } else {
    if (opt.run.fault && opt.run.fault->kind == core::fault_kind::drop && opt.run.fault->rank == rank) {
      to.drop_step = opt.run.fault->step;  // TROUPE_FAULT=drop (test only; tcp only)
      to.drop_label = opt.run.fault->label();
    }
    auto tcp = transport::tcp_transport::bind(to);
    if (!tcp.ok()) return with_rank(tcp.err(), rank);
    data.tcp = tcp.value().get();
    j.endpoints[rank] = std::move(tcp.value());
  }

  auto done = std::make_shared<std::promise<core::result<model::train_summary>>>();
  auto outcome = std::make_shared<outcome_promise>();
  core::result<model::train_summary> result = model::train_summary{};
  {
    worker_actor_config acfg(h.threads);
    caf::actor_system sys{acfg};
    spawn_hosted(sys, h, opt.run.halt_after_step, done);
    const int d = j.layout.dp_of(rank), p = j.layout.pp_of(rank), t = j.layout.tp_of(rank);
    local_actors mine{j.stages.at({d, p, t}), j.shards.at({p, d, t}),
                      j.loaders.count(d) ? j.loaders.at(d) : caf::actor{}, j.coordinator, j.writer};
    auto intros = std::make_shared<introductions>();
    caf::actor node = sys.spawn(node_actor, h.j, rank, mine, outcome, intros);
    auto stop_local = [&] {
      caf::anon_send_exit(node, caf::exit_reason::user_shutdown);
      for (auto* a : {&mine.stage, &mine.shard, &mine.loader, &mine.coordinator, &mine.writer})
        if (*a) caf::anon_send_exit(*a, caf::exit_reason::user_shutdown);
    };
    auto fail = [&](core::error e) -> core::result<model::train_summary> {
      stop_local();
      return with_rank(std::move(e), rank);
    };
    auto port = sys.middleman().publish(node, 0);
    if (!port)
      return fail(core::error::make("cannot open the control port (CAF middleman): " + sys.render(port.error()),
                                    "check that this host allows listening on TCP ports"));

    transport::rendezvous_client_options ro;
    ro.master = opt.master;
    ro.job_token = opt.job_token;
    ro.node_rank = opt.node_rank;
    ro.local_rank = opt.local_rank;
    ro.data_port = data.port();
    // The step this worker resumes at, checked against every other worker's below.
    ro.blob = blob + "step=" + std::to_string(h.first_step) + " caf=" + std::to_string(*port);
    ro.timeout = opt.rendezvous_timeout;
    ro.retry_refused = opt.run.restarts > 0;
    auto client = transport::rendezvous_client::join(ro);
    if (!client.ok()) return fail(client.err());
    if (client.value()->rank() != rank)
      return fail(core::error::make("the rendezvous gave this worker rank " + std::to_string(client.value()->rank()) +
                                        " but the launcher expected " + std::to_string(rank),
                                    "every node must use the same --local_worker_num"));
    const transport::job_table& table = client.value()->table();
    for (const auto& w : table.workers) j.hosts[w.rank] = w.data.host;
    // Every worker resolves the resume point itself (--resume, or the launcher's restart from the
    // last checkpoint): on nodes that see different checkpoints, they would train different steps.
    for (const auto& w : table.workers) {
      const std::string theirs = blob_word(w.blob, "step");
      if (theirs != std::to_string(h.first_step))
        return fail(core::error::make(
            "worker rank " + std::to_string(w.rank) + " (host " + w.data.host + ") starts at step " +
                (theirs.empty() ? std::string("?") : theirs) + " and this worker at step " +
                std::to_string(h.first_step) + ": the nodes see different checkpoints",
            "put checkpoint.dir (default <runtime.run_dir>/checkpoints) on storage that every node "
            "shares, and pass every node the same --resume (docs/launch.md)"));
    }

#ifdef TROUPE_HAVE_NCCL
    if (data.nccl) {
      if (auto st = data.nccl->start(rank, table); !st.ok()) return fail(st.err());
    }
#endif
    if (data.tcp) {
      data.tcp->start(rank, table.data_endpoints());
      if (auto st = data.tcp->wait_connected(opt.rendezvous_timeout); !st.ok()) return fail(st.err());
    }

    // Control plane: connect to the node actor of every worker below this one, and wait for
    // every worker above to connect here.
    {
      caf::scoped_actor self{sys};
      for (const auto& w : table.workers) {
        if (w.rank >= rank) continue;
        const std::string caf_port = blob_word(w.blob, "caf");
        if (caf_port.empty())
          return fail(core::error::make("worker rank " + std::to_string(w.rank) + " registered without a control port",
                                        "every worker must run the same troupe build"));
        const auto peer_port = static_cast<std::uint16_t>(std::stoi(caf_port));
        auto remote = sys.middleman().remote_actor(w.data.host, peer_port);
        if (!remote)
          return fail(core::error::make("cannot reach the control port of worker rank " + std::to_string(w.rank) +
                                            " at " + w.data.host + ":" + std::to_string(peer_port) + ": " +
                                            sys.render(remote.error()),
                                        "check firewalls between the nodes"));
        auto actors = meet(self, j, w.rank, *remote, rank, node, mine);
        if (!actors.ok()) return fail(actors.err());
        j.nodes[w.rank] = *remote;
        enter(j, w.rank, actors.value());
      }
      std::unique_lock<std::mutex> lock(intros->mu);
      const int above = world - rank - 1;
      if (!intros->cv.wait_for(lock, opt.rendezvous_timeout, [&] { return static_cast<int>(intros->peers.size()) == above; })) {
        std::string missing;
        for (int r = rank + 1; r < world; ++r)
          if (!intros->peers.count(r)) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        return fail(core::error::make("workers of rank " + missing + " never connected to the control port of rank " +
                                          std::to_string(rank),
                                      "see those workers' logs"));
      }
      for (auto& [r, p] : intros->peers) {
        j.nodes[r] = p.first;
        enter(j, r, p.second);
      }
    }
    // Every worker's directory is complete before anyone starts.
    if (auto st = client.value()->start(); !st.ok()) return fail(st.err());
    caf::anon_send(node, start_atom::value);

    if (rank == 0) {
      caf::anon_send(j.coordinator, start_atom::value);
      auto future = done->get_future();
      future.wait();
      result = future.get();
      if (!result.ok() && opt.report) opt.report(with_rank(result.err(), rank));
      caf::scoped_actor self{sys};
      tell_nodes(self, j, result);
    } else {
      auto future = outcome->get_future();
      future.wait();
      if (auto st = future.get(); !st.ok()) result = st.err();
    }
    j.over = true;  // a stalled stage (TROUPE_FAULT=stall) may stop waiting
    guard_shutdown(rank, result.ok(), std::chrono::seconds(45));
    stop_local();
    shutdown_phase = "stopping the actor system";
    if (j.layout.tp > 1) {
      // This worker's tensor-parallel stage runs detached (actors/stage.cpp): the system's end
      // waits until its last handle is gone. Once the local actors are done nothing reads them.
      sys.await_all_actors_done();
      mine = local_actors{};
      j.clear_directory();
    }
  }
  j.clear_directory();
  // Close the data transport now, flushing and saying goodbye, so peers still finishing do not
  // mistake this worker's exit for a crash.
  shutdown_phase = "closing the data transport (flushing, then NCCL finalize)";
  j.endpoints[rank].reset();
  shutdown_phase = "closing the recorder";
  close_recorder(h);
  if (rank == 0) print_summary(opt.run.log, result);
  shutdown_phase = "exiting the process (CUDA and NCCL teardown)";
  if (!result.ok()) return with_rank(result.err(), rank);
  return result;
}

}  // namespace troupe::actors
