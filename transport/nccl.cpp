// The nccl transport (see nccl.hpp for the contract, docs/networking.md for the design).
//
// Threads: callers of send (one mutex per destination keeps control records and ncclSend calls in
// the same order), callers of recv (they only wait on the arrival map),
// the control channel's IO thread (its callbacks only queue notes), and this transport's progress
// thread, which decodes control records, posts every ncclRecv in sequence order per sender, polls
// the events of queued transfers (releasing sent tensors, enforcing op_timeout) and watches the
// communicators for asynchronous errors.
//
// Every communicator is non-blocking (ncclConfig_t::blocking = 0): no NCCL call can hold a thread
// forever, since each is followed by polling ncclCommGetAsyncError against a deadline and the
// transport's failure flag. The price is that NCCL runs each group on a helper thread of its own.
// A communicator is only ever used under its slot's mutex, one call at a time.
#include "transport/nccl.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/cuda_handoff.hpp"
#include "transport/nccl_wire.hpp"

namespace troupe::transport {
namespace {

using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

static_assert(sizeof(ncclUniqueId) == nccl_id_bytes, "NCCL_UNIQUE_ID_BYTES changed");

std::string rank_name(int r) { return "rank " + std::to_string(r); }

std::string ms_text(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

std::string members_text(const std::vector<int>& m) {
  std::string s = "ranks [";
  for (std::size_t i = 0; i < m.size(); ++i) s += (i ? ", " : "") + std::to_string(m[i]);
  return s + "]";
}

// NCCL's words for a failed call, its last warning (which names the real cause, such as a
// duplicate GPU) and, where we recognise the cause, what to do.
std::string nccl_error_text(ncclResult_t r, const std::string& call) {
  std::string msg = call + " failed: " + ncclGetErrorString(r);
  std::string last = ncclGetLastError(nullptr);
  if (!last.empty()) msg += " (NCCL: " + last + ")";
  if (last.find("Duplicate GPU") != std::string::npos)
    msg +=
        " (hint: NCCL needs one GPU per rank; give each rank of this host its own device, "
        "e.g. nccl_options::device = local rank, or CUDA_VISIBLE_DEVICES per worker)";
  return msg;
}

// Waits until a non-blocking communicator's last call has finished: polls its asynchronous state
// until it is no longer ncclInProgress, giving up at `deadline` or when the transport fails.
// Throws core::failure with file:line on an NCCL error.
void settle(ncclResult_t r, ncclComm_t comm, const std::string& call, const char* file, int line,
            clock_type::time_point deadline, const std::atomic<bool>& failed) {
  auto where = std::string(file) + ":" + std::to_string(line) + ": ";
  // Some calls return success while their work still runs on an NCCL thread (ncclCommSplit does,
  // in NCCL 2.28): the communicator's own state is the answer.
  if (r == ncclSuccess && comm) {
    ncclResult_t q = ncclCommGetAsyncError(comm, &r);
    if (q != ncclSuccess) r = q;
  }
  auto pause = 1us;
  while (r == ncclInProgress) {
    if (failed.load()) throw core::failure(where + call + " interrupted: the transport failed");
    if (clock_type::now() > deadline)
      throw core::failure(where + call + " did not complete in time");
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, 1000us);
    ncclResult_t q = ncclCommGetAsyncError(comm, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess) throw core::failure(where + nccl_error_text(r, call));
}

/// Checks an NCCL call on a non-blocking communicator and waits for it (see settle).
#define TROUPE_NCCL_CHECK(call, comm, deadline, failed)                         \
  do {                                                                          \
    ncclResult_t troupe_r_ = (call);                                            \
    settle(troupe_r_, (comm), #call, __FILE__, __LINE__, (deadline), (failed)); \
  } while (0)

// Makes `device` current for the scope and restores the caller's device afterwards.
class device_guard {
 public:
  explicit device_guard(int device) {
    TROUPE_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) TROUPE_CUDA_CHECK(cudaSetDevice(device));
    changed_ = prev_ != device;
  }
  ~device_guard() {
    if (changed_) cudaSetDevice(prev_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

struct event {
  cudaEvent_t e = nullptr;
  event() { TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~event() {
    if (e) cudaEventDestroy(e);
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
};
using event_ptr = std::shared_ptr<event>;

event_ptr record_on(cudaStream_t s) {
  auto ev = std::make_shared<event>();
  TROUPE_CUDA_CHECK(cudaEventRecord(ev->e, s));
  return ev;
}

using kernels::cuda::stream_handle;
using stream_ptr = std::shared_ptr<stream_handle>;

// The memory pool of received tensors and the stream their memory is freed on. Received tensors
// hold it, so they may outlive the transport.
struct device_state {
  int device = 0;
  cudaMemPool_t pool = nullptr;
  stream_ptr free_stream;

  explicit device_state(int dev) : device(dev), free_stream(std::make_shared<stream_handle>(dev)) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    TROUPE_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    // Keep freed memory for the next receive instead of returning it at every synchronisation.
    std::uint64_t keep = ~std::uint64_t{0};
    TROUPE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    // Reuse a block once its free has run, never by making a receive stream wait for a consumer's
    // compute (that would hold every later receive behind it).
    int no = 0;
    TROUPE_CUDA_CHECK(
        cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &no));
  }
  ~device_state() {
    // The pool goes once its last block is freed (CUDA defers the destruction until then).
    if (pool) cudaMemPoolDestroy(pool);
  }
  device_state(const device_state&) = delete;
  device_state& operator=(const device_state&) = delete;
};

// The release of a received block: on the free stream, after every stream that used the tensor
// (the receive stream and each consumer that called wait_ready) has passed the point it had
// reached when the last handle went. Called from the storage's destructor: nothing may throw, and
// when an event cannot be had (the driver is going at exit) the block is left unfreed, the safe
// side.
void release_received(device_state& ds, void* p, const std::shared_ptr<void>& sync) {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) return;
  cudaStream_t fs = ds.free_stream->stream;
  bool ordered = true;
  if (auto* h = static_cast<kernels::cuda::handoff_state*>(sync.get())) {
    std::lock_guard<std::mutex> lk(h->mu);
    for (const auto& u : h->users) {
      if (u->stream == fs) continue;
      cudaEvent_t e = nullptr;
      ordered = cudaSetDevice(u->device) == cudaSuccess &&
                cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess &&
                cudaEventRecord(e, u->stream) == cudaSuccess &&
                cudaStreamWaitEvent(fs, e, 0) == cudaSuccess;
      if (e) cudaEventDestroy(e);
      if (!ordered) break;
    }
  }
  if (ordered && cudaSetDevice(ds.device) == cudaSuccess) cudaFreeAsync(p, fs);
  cudaGetLastError();
  cudaSetDevice(prev);
}

ncclDataType_t sum_type(core::dtype t) {
  switch (t) {
    case core::dtype::f32:
      return ncclFloat32;
    case core::dtype::bf16:
      return ncclBfloat16;
    case core::dtype::f16:
      return ncclFloat16;
    case core::dtype::f64:
      return ncclFloat64;
    case core::dtype::i32:
      return ncclInt32;
    case core::dtype::i64:
      return ncclInt64;
    case core::dtype::u16:
      break;
  }
  throw core::failure(std::string("nccl collectives cannot sum ") + core::dtype_name(t) +
                      " tensors (fp32, bf16, fp16, fp64, int32 and int64 only)");
}

// Round r of a round-robin tournament on m (even) players: everyone meets everyone once in m - 1
// rounds, and nobody plays twice in a round, so each round is one ncclCommSplit.
int partner(int i, int r, int m) {
  if (i == m - 1) return r;
  if (i == r) return m - 1;
  return ((2 * r - i) % (m - 1) + (m - 1)) % (m - 1);
}

}  // namespace

// One NCCL communicator and the stream its work runs on.
struct comm_slot {
  std::mutex mu;
  ncclComm_t comm = nullptr;
  std::shared_ptr<kernels::cuda::stream_handle> handle;  // shared with hand-off states
  cudaStream_t stream = nullptr;
  int peer = 0;      // the other end's rank within a two-rank communicator
  std::string what;  // for errors: "the communicator for sends to rank 2"
};

struct nccl_group::state {
  comm_slot slot;
};

struct nccl_transport::impl {
  // A control record's arrival (or a peer's loss) as the control channel or a self-send reports it.
  struct note {
    int src = 0;
    tag tg;
    bool lost = false;
    std::string lost_why;
    bool self = false;  // from this rank: `rec` and `data` are filled, nothing is on tcp
    control_record rec;
    tensor data;  // self-sends: the tensor itself (host or device), delivered as it is
  };
  // A device transfer announced but not yet posted (an earlier one from its sender is missing).
  struct pending {
    tag tg;
    control_record rec;
  };
  struct arrival {
    tensor t;
    event_ptr done;  // null when complete on arrival (host tensors, empty device tensors)
  };
  struct flight {
    event_ptr done;
    tensor keep;  // a sent tensor, held until the GPU has read it
    std::string what;
    clock_type::time_point since;
    bool is_send = false;
  };
  struct sender {
    std::mutex mu;
    std::uint64_t next_seq = 0;
  };

  nccl_options opt;
  std::unique_ptr<tcp_transport> control;
  int me = -1;
  int n = 0;
  std::shared_ptr<device_state> ds;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;

  std::unique_ptr<nccl_group> world;
  std::vector<std::unique_ptr<nccl_group>> groups;
  std::vector<std::unique_ptr<comm_slot>> out, in;  // pair communicators, by peer rank
  std::vector<std::unique_ptr<sender>> senders;     // by destination rank
  std::mutex slots_mu;
  std::vector<comm_slot*> slots;  // every communicator, for aborts and health
  std::deque<std::unique_ptr<ncclComm_t>> split_targets;  // NCCL writes split results there

  std::atomic<bool> failed{false};
  mutable std::mutex mu;  // guards the members below
  std::condition_variable cv;
  std::string why;  // the first failure's cause
  std::deque<note> inbox;
  std::map<std::pair<int, tag>, arrival> arrived;
  std::vector<flight> flights;
  bool stop = false;
  std::thread progress;

  // Progress thread only.
  std::vector<std::map<std::uint64_t, pending>> waiting;
  std::vector<std::uint64_t> next_recv;

  std::string cause() const {
    std::lock_guard<std::mutex> lk(mu);
    return why;
  }

  void open_stream(comm_slot& s) {
    s.handle = std::make_shared<stream_handle>(opt.device);
    s.stream = s.handle->stream;
  }

  void add_slot(comm_slot& s) {
    std::lock_guard<std::mutex> lk(slots_mu);
    slots.push_back(&s);
  }

  void push(note nt) {
    {
      std::lock_guard<std::mutex> lk(mu);
      inbox.push_back(std::move(nt));
    }
    cv.notify_all();
  }

  // Makes the transport fail once: aborts every communicator (so nothing on the GPU waits
  // forever), closes the control channel at once (so peers learn it now rather than at a time-out)
  // and tells the owner. Callers must hold no slot mutex.
  void fail(const std::string& c) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (failed.load()) return;
      why = c;
      failed.store(true);
    }
    cv.notify_all();
    std::vector<comm_slot*> all;
    {
      std::lock_guard<std::mutex> lk(slots_mu);
      all = slots;
    }
    for (comm_slot* s : all) {
      std::lock_guard<std::mutex> lk(s->mu);
      if (s->comm) ncclCommAbort(s->comm);
      s->comm = nullptr;
    }
    if (control) control->abort();
    if (opt.on_failure) opt.on_failure(rank_name(me) + ": " + c);
  }

  // ---- setup ----

  ncclComm_t split_from(comm_slot& parent, int color, int key, clock_type::time_point deadline) {
    split_targets.push_back(std::make_unique<ncclComm_t>(nullptr));
    ncclComm_t* target = split_targets.back().get();
    std::lock_guard<std::mutex> lk(parent.mu);
    TROUPE_CHECK(parent.comm, "the job's communicator is gone");
    TROUPE_NCCL_CHECK(ncclCommSplit(parent.comm, color, key, target, &cfg), parent.comm, deadline,
                      failed);
    if (*target) {
      ncclResult_t r = ncclInProgress;
      settle(r, *target, "the new communicator's initialisation", __FILE__, __LINE__, deadline,
             failed);
    }
    return *target;
  }

  void setup(const nccl_id& id, clock_type::time_point deadline) {
    device_guard g(opt.device);
    ds = std::make_shared<device_state>(opt.device);
    cfg.blocking = 0;
    cfg.splitShare = 0;  // shared resources would serialise the pair communicators again

    std::vector<int> everyone(n);
    for (int r = 0; r < n; ++r) everyone[r] = r;
    world =
        std::make_unique<nccl_group>(*this, std::make_unique<nccl_group::state>(), everyone, me);
    comm_slot& w = world_slot();
    w.what = "the job's communicator";
    open_stream(w);
    add_slot(w);
    ncclUniqueId uid;
    std::memcpy(&uid, id.data(), sizeof uid);
    {
      std::lock_guard<std::mutex> lk(w.mu);
      TROUPE_NCCL_CHECK(ncclCommInitRankConfig(&w.comm, n, uid, me, &cfg), w.comm, deadline,
                        failed);
    }

    out.resize(n);
    in.resize(n);
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      out[p] = std::make_unique<comm_slot>();
      out[p]->what = "the communicator for sends to " + rank_name(p);
      in[p] = std::make_unique<comm_slot>();
      in[p]->what = "the communicator for receives from " + rank_name(p);
      add_slot(*out[p]);
      add_slot(*in[p]);
    }
    if (n > 1) {
      int m = n + (n & 1);
      // Pass 0 makes each pair's communicator for lower -> higher, pass 1 for higher -> lower.
      for (int pass = 0; pass < 2; ++pass)
        for (int r = 0; r < m - 1; ++r) {
          int p = partner(me, r, m);
          bool playing = p < n;
          ncclComm_t c =
              split_from(w, playing ? std::min(me, p) : NCCL_SPLIT_NOCOLOR, me, deadline);
          if (!playing) continue;
          TROUPE_CHECK(c, "NCCL made no communicator for the pair of " + rank_name(me) + " and " +
                              rank_name(p));
          bool sends = (pass == 0) == (me < p);
          comm_slot& s = sends ? *out[p] : *in[p];
          std::lock_guard<std::mutex> lk(s.mu);
          s.comm = c;
          open_stream(s);
          s.peer = me < p ? 1 : 0;
        }
    }
    connect_all(deadline);
  }

  comm_slot& world_slot();

  // NCCL connects a pair on its first transfer, which needs both ends inside NCCL at once; the
  // runtime's sends and receives happen at unrelated times, so every pair is connected here, in
  // one group, with a one-byte transfer each way.
  void connect_all(clock_type::time_point deadline) {
    void* scratch = nullptr;
    TROUPE_CUDA_CHECK(cudaMalloc(&scratch, 2 * static_cast<std::size_t>(n) + 2));
    auto* b = static_cast<char*>(scratch);
    std::vector<comm_slot*> used;
    TROUPE_NCCL_CHECK(ncclGroupStart(), nullptr, deadline, failed);
    ncclResult_t r = ncclSuccess;
    for (int p = 0; p < n && r == ncclSuccess; ++p) {
      if (p == me) continue;
      used.push_back(out[p].get());
      used.push_back(in[p].get());
      r = ncclSend(b, 1, ncclUint8, out[p]->peer, out[p]->comm, out[p]->stream);
      if (r == ncclSuccess)
        r = ncclRecv(b + 2 + 2 * p, 1, ncclUint8, in[p]->peer, in[p]->comm, in[p]->stream);
    }
    ncclResult_t end = ncclGroupEnd();
    if (r != ncclSuccess)
      throw core::failure(nccl_error_text(r, "queueing the connecting transfers"));
    for (comm_slot* s : used)
      settle(end, s->comm, "ncclGroupEnd (connecting every pair)", __FILE__, __LINE__, deadline,
             failed);
    for (comm_slot* s : used) {
      while (true) {
        cudaError_t q = cudaStreamQuery(s->stream);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) TROUPE_CUDA_CHECK(q);
        if (clock_type::now() > deadline)
          throw core::failure("the connecting transfer on " + s->what + " did not finish in time");
        std::this_thread::sleep_for(1ms);
      }
    }
    TROUPE_CUDA_CHECK(cudaFree(scratch));
  }

  // ---- the progress thread ----

  void run() {
    try {
      TROUPE_CUDA_CHECK(cudaSetDevice(opt.device));
    } catch (const std::exception& e) {
      fail(e.what());
    }
    auto next_health = clock_type::now();
    while (true) {
      std::deque<note> batch;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait_for(lk, flights.empty() ? 50ms : 1ms, [&] { return stop || !inbox.empty(); });
        if (stop) return;
        batch.swap(inbox);
      }
      try {
        for (note& nt : batch) take(nt);
        for (int src = 0; src < n; ++src) post_ready(src);
        poll_flights();
        if (clock_type::now() >= next_health) {
          check_health();
          next_health = clock_type::now() + 100ms;
        }
      } catch (const std::exception& e) {
        fail(e.what());
      }
    }
  }

  void take(note& nt) {
    if (nt.lost) {
      fail("lost " + rank_name(nt.src) + ": " + nt.lost_why);
      return;
    }
    if (failed.load()) return;
    control_record rec;
    tensor payload;
    if (nt.self) {
      rec = nt.rec;
      payload = nt.data;
    } else {
      tensor frame = control->recv(nt.src, nt.tg, 0ms);
      std::string bad = rec.decode(frame, &payload);
      if (!bad.empty()) {
        fail("a malformed control record from " + rank_name(nt.src) + " (" + nt.tg.to_string() +
             "): " + bad);
        return;
      }
    }
    if (rec.kind == control_kind::host || nt.self) {
      deliver(nt.src, nt.tg, arrival{std::move(payload), nullptr});
      return;
    }
    auto& w = waiting[nt.src];
    if (rec.seq < next_recv[nt.src] || w.count(rec.seq)) {
      fail(rank_name(nt.src) + " announced transfer number " + std::to_string(rec.seq) + " (" +
           nt.tg.to_string() + ") twice");
      return;
    }
    w.emplace(rec.seq, pending{nt.tg, std::move(rec)});
  }

  void post_ready(int src) {
    auto& w = waiting[src];
    while (!w.empty() && w.begin()->first == next_recv[src] && !failed.load()) {
      pending p = std::move(w.begin()->second);
      w.erase(w.begin());
      ++next_recv[src];
      post(src, p);
    }
  }

  // Queues the receive of one announced device transfer into fresh pool memory; the tensor's
  // hand-off event marks the end of the transfer on this rank's receive stream.
  void post(int src, pending& p) {
    comm_slot& s = *in[src];
    const std::uint64_t bytes = p.rec.payload_bytes();
    auto st = std::make_shared<core::storage>();
    st->bytes = bytes;
    st->dev = core::device{core::device_kind::cuda, opt.device};
    tensor t;
    event_ptr done;
    const std::string what =
        "the transfer of " + p.tg.to_string() + " from " + rank_name(src) + " to " + rank_name(me);
    if (bytes) {
      std::lock_guard<std::mutex> lk(s.mu);
      if (!s.comm) return;  // aborted meanwhile
      TROUPE_CUDA_CHECK(cudaMallocFromPoolAsync(&st->data, bytes, ds->pool, s.stream));
      // The storage is read in its own destructor, before its members go (as cuda_backend does).
      const core::storage* owner = st.get();
      st->release = [d = ds, owner](void* q) { release_received(*d, q, owner->sync); };
      t = tensor::over(st, 0, p.rec.shape, p.rec.dt);
      auto deadline = clock_type::now() + opt.op_timeout;
      TROUPE_NCCL_CHECK(ncclRecv(st->data, bytes, ncclUint8, s.peer, s.comm, s.stream), s.comm,
                        deadline, failed);
      kernels::cuda::record_ready(s.handle, t);
      done = record_on(s.stream);
    } else {
      t = tensor::over(st, 0, p.rec.shape, p.rec.dt);
    }
    if (done) {
      std::lock_guard<std::mutex> lk(mu);
      flights.push_back(flight{done, tensor{}, what, clock_type::now(), false});
    }
    deliver(src, p.tg, arrival{std::move(t), done});
  }

  void deliver(int src, const tag& tg, arrival a) {
    bool fresh;
    {
      std::lock_guard<std::mutex> lk(mu);
      fresh = arrived.emplace(std::pair{src, tg}, std::move(a)).second;
    }
    if (!fresh) {
      fail(rank_name(src) + " sent twice to " + rank_name(me) + " under " + tg.to_string());
      return;
    }
    cv.notify_all();
    if (opt.on_arrival) opt.on_arrival(src, tg);
  }

  void poll_flights() {
    std::vector<flight> finished;
    std::string problem;
    {
      std::lock_guard<std::mutex> lk(mu);
      auto now = clock_type::now();
      for (std::size_t i = 0; i < flights.size();) {
        cudaError_t q = cudaEventQuery(flights[i].done->e);
        if (q == cudaSuccess) {
          finished.push_back(std::move(flights[i]));
          flights[i] = std::move(flights.back());
          flights.pop_back();
          continue;
        }
        if (q != cudaErrorNotReady && problem.empty())
          problem = flights[i].what + ": CUDA error " + cudaGetErrorName(q) + ": " +
                    cudaGetErrorString(q);
        else if (now - flights[i].since > opt.op_timeout && problem.empty())
          problem = flights[i].what + " has not finished on the GPU after " +
                    ms_text(opt.op_timeout) +
                    " (nccl_options::op_timeout); a peer stopped or hangs";
        ++i;
      }
    }
    if (!problem.empty()) fail(problem);
  }

  void check_health() {
    std::vector<comm_slot*> all;
    {
      std::lock_guard<std::mutex> lk(slots_mu);
      all = slots;
    }
    std::string problem;
    for (comm_slot* s : all) {
      std::lock_guard<std::mutex> lk(s->mu);
      if (!s->comm) continue;
      ncclResult_t r = ncclSuccess;
      if (ncclCommGetAsyncError(s->comm, &r) != ncclSuccess || r == ncclSuccess ||
          r == ncclInProgress)
        continue;
      problem = nccl_error_text(r, "an operation on " + s->what);
      break;
    }
    if (!problem.empty()) fail(problem);
  }

  // ---- callers ----

  void started(const char* what) const {
    TROUPE_CHECK(me >= 0, std::string("nccl transport: ") + what + " before start()");
  }

  void send(int dst, tensor t, const tag& tg) {
    started("send");
    TROUPE_CHECK(dst >= 0 && dst < n, rank_name(me) + " sends to " + rank_name(dst) +
                                          " in a job of " + std::to_string(n) + " ranks (" +
                                          tg.to_string() + ")");
    TROUPE_CHECK(t.defined(), rank_name(me) + " sends an empty tensor under " + tg.to_string());
    TROUPE_CHECK(
        t.rank() <= control_record::max_dims,
        "nccl transport: tensors of at most 8 dimensions, got " + core::shape_string(t.shape()));
    const std::string prefix =
        rank_name(me) + " cannot send " + tg.to_string() + " to " + rank_name(dst) + ": ";
    if (failed.load()) throw core::failure(prefix + cause());
    const bool on_device = !t.dev().is_cpu();
    if (on_device)
      TROUPE_CHECK(t.dev().index == opt.device,
                   rank_name(me) + " sends a tensor on " + t.dev().to_string() +
                       " but its nccl transport uses cuda:" + std::to_string(opt.device));
    if (!on_device) {
      if (dst == me) {
        note nt;
        nt.src = me;
        nt.tg = tg;
        nt.self = true;
        nt.rec = control_record{control_kind::host, t.type(), t.shape(), 0};
        nt.data = std::move(t);
        push(std::move(nt));
      } else {
        control->send(dst, control_record::encode_host(t), tg);
      }
      return;
    }
    std::string err;
    {
      sender& o = *senders[dst];
      std::lock_guard<std::mutex> lk(o.mu);
      try {
        device_guard g(opt.device);
        const std::uint64_t seq = o.next_seq;
        if (dst == me) {
          // To itself (a worker's stage and its optimizer shard): the handle itself, as the local
          // transport moves it between the backends of one process. The sender recorded its
          // ready event and the consumer waits for it; nothing is copied.
          note nt;
          nt.src = me;
          nt.tg = tg;
          nt.self = true;
          nt.rec = control_record{control_kind::device, t.type(), t.shape(), 0};
          nt.data = std::move(t);
          push(std::move(nt));
          return;
        }
        control->send(dst, control_record::encode_device(t, seq), tg);
        ++o.next_seq;
        comm_slot& s = *out[dst];
        event_ptr done;
        {
          std::lock_guard<std::mutex> sl(s.mu);
          if (!s.comm) throw core::failure("the communicator was aborted");
          kernels::cuda::wait_ready(s.handle, t);
          if (t.bytes())
            TROUPE_NCCL_CHECK(ncclSend(t.raw(), t.bytes(), ncclUint8, s.peer, s.comm, s.stream),
                              s.comm, clock_type::now() + opt.op_timeout, failed);
          done = record_on(s.stream);
        }
        std::lock_guard<std::mutex> fl(mu);
        flights.push_back(flight{done, std::move(t),
                                 "the transfer of " + tg.to_string() + " from " + rank_name(me) +
                                     " to " + rank_name(dst),
                                 clock_type::now(), true});
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    if (!err.empty()) {
      fail("sending " + tg.to_string() + " to " + rank_name(dst) + ": " + err);
      throw core::failure(prefix + cause());
    }
  }

  tensor recv(int src, const tag& tg, std::chrono::milliseconds timeout) {
    started("recv");
    TROUPE_CHECK(src >= 0 && src < n, rank_name(me) + " receives from " + rank_name(src) +
                                          " in a job of " + std::to_string(n) + " ranks (" +
                                          tg.to_string() + ")");
    std::unique_lock<std::mutex> lk(mu);
    auto key = std::pair{src, tg};
    cv.wait_for(lk, timeout, [&] { return arrived.count(key) || failed.load(); });
    auto it = arrived.find(key);
    const std::string prefix =
        rank_name(me) + " cannot receive " + tg.to_string() + " from " + rank_name(src) + ": ";
    if (it == arrived.end()) {
      if (failed.load()) throw core::failure(prefix + why);
      throw core::failure(rank_name(me) + " waited " + ms_text(timeout) + " for a tensor from " +
                          rank_name(src) + " (" + tg.to_string() + ") that never came");
    }
    // After a failure the communicators are aborted: a transfer not complete by then never will be.
    if (failed.load() && it->second.done && cudaEventQuery(it->second.done->e) != cudaSuccess)
      throw core::failure(prefix + why);
    tensor t = std::move(it->second.t);
    arrived.erase(it);
    return t;
  }

  template <class Enqueue>
  void collective(comm_slot& slot, const std::string& what, cudaStream_t stream, Enqueue enqueue) {
    if (failed.load()) throw core::failure(rank_name(me) + " cannot run " + what + ": " + cause());
    std::string err;
    event_ptr done;
    {
      std::lock_guard<std::mutex> lk(slot.mu);
      try {
        if (!slot.comm) throw core::failure("the communicator was aborted");
        device_guard g(opt.device);
        event_ptr ready = record_on(stream);
        TROUPE_CUDA_CHECK(cudaStreamWaitEvent(slot.stream, ready->e, 0));
        settle(enqueue(slot.comm, slot.stream), slot.comm, what, __FILE__, __LINE__,
               clock_type::now() + opt.op_timeout, failed);
        done = record_on(slot.stream);
        TROUPE_CUDA_CHECK(cudaStreamWaitEvent(stream, done->e, 0));
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    if (!err.empty()) {
      fail(what + ": " + err);
      throw core::failure(rank_name(me) + " cannot run " + what + ": " + cause());
    }
    std::lock_guard<std::mutex> lk(mu);
    flights.push_back(flight{done, tensor{}, what, clock_type::now(), false});
  }

  void check_device(const tensor& x, const std::string& what) const {
    TROUPE_CHECK(x.defined() && !x.dev().is_cpu() && x.dev().index == opt.device,
                 what + ": expects tensors on cuda:" + std::to_string(opt.device) + ", got " +
                     (x.defined() ? x.dev().to_string() : std::string("an empty tensor")));
  }

  // ---- shutdown ----

  void close_comms(std::chrono::milliseconds linger) {
    std::vector<comm_slot*> all;
    {
      std::lock_guard<std::mutex> lk(slots_mu);
      all = slots;
    }
    auto deadline = clock_type::now() + linger;
    std::atomic<bool> never{false};
    // Every communicator's finalize is started before any is waited for: a finalize may wait for
    // the peer's finalize of the same communicator, and ranks list their pair communicators in
    // different orders. Waiting for each in turn left the workers of a two-GPU job (NVLink, P2P)
    // alive after its last step; the shutdown guard in runtime/worker.cpp bounds what remains.
    std::vector<std::unique_lock<std::mutex>> locks;
    std::vector<comm_slot*> started;
    for (comm_slot* s : all) {
      std::unique_lock<std::mutex> lk(s->mu);
      if (!s->comm) continue;
      ncclResult_t r = ncclCommFinalize(s->comm);
      if (r != ncclSuccess && r != ncclInProgress) {
        ncclCommAbort(s->comm);
        s->comm = nullptr;
        continue;
      }
      started.push_back(s);
      locks.push_back(std::move(lk));
    }
    // Children before the job's communicator they were split from.
    std::reverse(started.begin(), started.end());
    for (comm_slot* s : started) {
      try {
        settle(ncclInProgress, s->comm, "ncclCommFinalize", __FILE__, __LINE__, deadline, never);
        ncclCommDestroy(s->comm);
      } catch (const std::exception&) {
        ncclCommAbort(s->comm);  // a peer is gone or stuck: leave without waiting for it
      }
      s->comm = nullptr;
    }
  }
};

comm_slot& nccl_transport::impl::world_slot() { return world->st_->slot; }

// ---- nccl_group ----

nccl_group::nccl_group(nccl_transport::impl& owner, std::unique_ptr<state> st,
                       std::vector<int> members, int position)
    : owner_(owner), st_(std::move(st)), members_(std::move(members)), position_(position) {}

nccl_group::~nccl_group() = default;

namespace {

std::string describe(const char* op, const std::vector<int>& members, const tag& tg) {
  return std::string(op) + " over " + members_text(members) + " (" + tg.to_string() + ")";
}

}  // namespace

void nccl_group::all_reduce(tensor& x, const tag& tg, CUstream_st* stream) {
  auto what = describe("all_reduce", members_, tg);
  owner_.check_device(x, what);
  ncclDataType_t t = sum_type(x.type());
  owner_.collective(st_->slot, what, stream, [&](ncclComm_t c, cudaStream_t s) {
    return ncclAllReduce(x.raw(), x.raw(), static_cast<std::size_t>(x.numel()), t, ncclSum, c, s);
  });
}

void nccl_group::reduce_scatter(const tensor& x, tensor& slice, const tag& tg,
                                CUstream_st* stream) {
  auto what = describe("reduce_scatter", members_, tg);
  owner_.check_device(x, what);
  owner_.check_device(slice, what);
  TROUPE_CHECK(slice.type() == x.type() &&
                   slice.numel() * static_cast<std::int64_t>(members_.size()) == x.numel(),
               what + ": a " + core::shape_string(x.shape()) + " tensor over " +
                   std::to_string(members_.size()) + " members gives slices of " +
                   std::to_string(x.numel() / static_cast<std::int64_t>(members_.size())) +
                   " elements of its dtype, got " + core::shape_string(slice.shape()));
  ncclDataType_t t = sum_type(x.type());
  owner_.collective(st_->slot, what, stream, [&](ncclComm_t c, cudaStream_t s) {
    return ncclReduceScatter(x.raw(), slice.raw(), static_cast<std::size_t>(slice.numel()), t,
                             ncclSum, c, s);
  });
}

void nccl_group::all_gather(const tensor& slice, tensor& out, const tag& tg, CUstream_st* stream) {
  auto what = describe("all_gather", members_, tg);
  owner_.check_device(slice, what);
  owner_.check_device(out, what);
  TROUPE_CHECK(out.type() == slice.type() && out.bytes() == slice.bytes() * members_.size(),
               what + ": slices of " + core::shape_string(slice.shape()) + " from " +
                   std::to_string(members_.size()) + " members do not fill " +
                   core::shape_string(out.shape()));
  owner_.collective(st_->slot, what, stream, [&](ncclComm_t c, cudaStream_t s) {
    return ncclAllGather(slice.raw(), out.raw(), slice.bytes(), ncclUint8, c, s);
  });
}

void nccl_group::broadcast(tensor& x, int root, const tag& tg, CUstream_st* stream) {
  auto what = describe("broadcast", members_, tg);
  owner_.check_device(x, what);
  auto it = std::find(members_.begin(), members_.end(), root);
  TROUPE_CHECK(it != members_.end(), what + ": the root " + rank_name(root) + " is not a member");
  int root_pos = static_cast<int>(it - members_.begin());
  owner_.collective(st_->slot, what, stream, [&](ncclComm_t c, cudaStream_t s) {
    return ncclBroadcast(x.raw(), x.raw(), x.bytes(), ncclUint8, root_pos, c, s);
  });
}

// ---- nccl_transport ----

core::result<std::string> make_nccl_blob() {
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess)
    return core::error::make(nccl_error_text(r, "ncclGetUniqueId"),
                             "NCCL's bootstrap needs a usable network interface (see "
                             "NCCL_SOCKET_IFNAME)");
  nccl_id id;
  std::memcpy(id.data(), &uid, sizeof uid);
  return nccl_id_word(id);
}

nccl_transport::nccl_transport(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

core::result<std::unique_ptr<nccl_transport>> nccl_transport::bind(nccl_options opt) {
  auto m = std::make_unique<impl>();
  m->opt = std::move(opt);
  tcp_options c = m->opt.control;
  impl* raw = m.get();
  c.on_arrival = [raw](int src, const tag& tg) {
    impl::note nt;
    nt.src = src;
    nt.tg = tg;
    raw->push(std::move(nt));
  };
  c.on_peer_lost = [raw](int r, const std::string& why) {
    impl::note nt;
    nt.src = r;
    nt.lost = true;
    nt.lost_why = why;
    raw->push(std::move(nt));
  };
  auto t = tcp_transport::bind(std::move(c));
  if (!t.ok()) return t.err();
  m->control = std::move(t.value());
  return std::unique_ptr<nccl_transport>(new nccl_transport(std::move(m)));
}

nccl_transport::~nccl_transport() {
  auto& m = *impl_;
  if (m.me >= 0 && !m.failed.load()) flush(m.opt.control.linger);
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.stop = true;
  }
  m.cv.notify_all();
  if (m.progress.joinable()) m.progress.join();
  // The control channel goes first: after its destructor no callback can reach this object.
  m.control.reset();
  if (m.ds) {
    try {
      device_guard g(m.opt.device);
      m.close_comms(m.opt.control.linger);
    } catch (const std::exception&) {
      // The device is unusable; the driver reclaims everything at exit.
    }
  }
}

std::uint16_t nccl_transport::port() const { return impl_->control->port(); }

core::status nccl_transport::start(int rank, const job_table& table) {
  auto& m = *impl_;
  TROUPE_CHECK(m.me < 0, "nccl transport: start() called twice");
  const int n = static_cast<int>(table.workers.size());
  if (rank < 0 || rank >= n)
    return core::error::make("nccl transport: rank " + std::to_string(rank) +
                             " is outside the table of " + std::to_string(n) + " workers");
  auto id = nccl_id_from_blob(table.workers[0].blob);
  if (!id.ok()) {
    core::error e = id.err();
    e.message = rank_name(rank) + " cannot join the NCCL communicators: " + e.message;
    return e;
  }
  m.me = rank;
  m.n = n;
  m.waiting.resize(n);
  m.next_recv.assign(n, 0);
  for (int r = 0; r < n; ++r) m.senders.push_back(std::make_unique<impl::sender>());
  m.control->start(rank, table.data_endpoints());
  auto deadline = clock_type::now() + m.opt.setup_timeout;
  if (auto st = m.control->wait_connected(m.opt.setup_timeout); !st.ok()) {
    core::error e = st.err();
    e.message = rank_name(rank) + ": the nccl transport's control channel: " + e.message;
    return e;
  }
  try {
    m.setup(id.value(), deadline);
  } catch (const std::exception& e) {
    std::string why = std::string("cannot join the NCCL communicators: ") + e.what();
    m.fail(why);
    core::error err = core::error::make(rank_name(rank) + " " + why,
                                        "every rank must call start() at the same time, each on "
                                        "its own GPU; set NCCL_DEBUG=WARN for NCCL's own account");
    return err;
  }
  m.progress = std::thread([&m] { m.run(); });
  return {};
}

int nccl_transport::rank() const { return impl_->me; }
int nccl_transport::size() const { return impl_->n; }

void nccl_transport::send(int dst, tensor t, const tag& tg) { impl_->send(dst, std::move(t), tg); }

tensor nccl_transport::recv(int src, const tag& tg, std::chrono::milliseconds timeout) {
  return impl_->recv(src, tg, timeout);
}

bool nccl_transport::ready(int src, const tag& tg) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->arrived.count(std::pair{src, tg}) > 0;
}

nccl_group& nccl_transport::world() {
  impl_->started("world()");
  TROUPE_CHECK(impl_->world, "nccl transport: start() failed, there is no communicator");
  return *impl_->world;
}

core::result<nccl_group*> nccl_transport::split(const std::vector<int>& members) {
  auto& m = *impl_;
  m.started("split");
  auto fail_with = [&](const std::string& msg) {
    core::error e =
        core::error::make(rank_name(m.me) + " cannot split " + members_text(members) + ": " + msg);
    return e;
  };
  if (m.failed.load()) return fail_with(m.cause());
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= m.n)
      return fail_with(rank_name(members[i]) + " is not in the job of " + std::to_string(m.n) +
                       " ranks");
    if (std::count(members.begin(), members.end(), members[i]) > 1)
      return fail_with(rank_name(members[i]) + " is listed twice");
  }
  auto it = std::find(members.begin(), members.end(), m.me);
  if (!members.empty() && it == members.end())
    return fail_with("this rank is not a member (pass an empty group to stay out)");
  const int position = members.empty() ? -1 : static_cast<int>(it - members.begin());
  ncclComm_t c = nullptr;
  std::string err;
  try {
    device_guard g(m.opt.device);
    int color =
        members.empty() ? NCCL_SPLIT_NOCOLOR : *std::min_element(members.begin(), members.end());
    c = m.split_from(m.world_slot(), color, std::max(position, 0),
                     clock_type::now() + m.opt.setup_timeout);
  } catch (const std::exception& e) {
    err = e.what();
  }
  if (!err.empty()) {
    m.fail("split of " + members_text(members) + ": " + err);
    return fail_with(err);
  }
  if (members.empty()) return static_cast<nccl_group*>(nullptr);
  if (!c) return fail_with("NCCL made no communicator for this rank's group");
  int count = 0, user_rank = -1;
  ncclCommCount(c, &count);
  ncclCommUserRank(c, &user_rank);
  if (count != static_cast<int>(members.size()) || user_rank != position) {
    ncclCommAbort(c);
    return fail_with("NCCL formed a group of " + std::to_string(count) +
                     " ranks with this rank at " + std::to_string(user_rank) +
                     "; the ranks of this split disagree about who is in it");
  }
  auto st = std::make_unique<nccl_group::state>();
  st->slot.comm = c;
  st->slot.what = "the communicator of " + members_text(members);
  {
    device_guard g(m.opt.device);
    m.open_stream(st->slot);
  }
  m.add_slot(st->slot);
  m.groups.push_back(std::make_unique<nccl_group>(m, std::move(st), members, position));
  return m.groups.back().get();
}

bool nccl_transport::flush(std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  auto deadline = clock_type::now() + timeout;
  while (true) {
    {
      std::lock_guard<std::mutex> lk(m.mu);
      if (m.failed.load()) return false;
      bool sending = std::any_of(m.flights.begin(), m.flights.end(),
                                 [](const impl::flight& f) { return f.is_send; });
      if (!sending) break;
    }
    if (clock_type::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  // Host tensors and control records leave through the control channel's queue.
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
  return m.control->flush(std::max(left, std::chrono::milliseconds(0))) && !m.failed.load();
}

void nccl_transport::abort(const std::string& why) { impl_->fail("aborted: " + why); }

std::string nccl_transport::failure() const {
  std::string c = impl_->cause();
  return c.empty() ? c : rank_name(impl_->me) + ": " + c;
}

}  // namespace troupe::transport
