// The tensor-parallel group's collectives over a transport. See tp_group.hpp.
#include "actors/tp_group.hpp"

#include <algorithm>

#include "actors/recorder.hpp"
#include "core/error.hpp"

namespace troupe::actors {

namespace {

/// The group's endpoint as record_to() sees it: every send is shown to the sink first (its
/// message hash goes to the sender's log), and every tensor received from a peer after it
/// arrived (its bytes go to the receiver's .tensors file under runtime.record_tensors).
class observed_endpoint final : public ::troupe::transport::transport {
 public:
  observed_endpoint(std::function<::troupe::transport::transport&()> inner, message_sink* sink,
                    address me, std::vector<int> ranks, kernels::backend& be,
                    const std::string& collective)
      : inner_(std::move(inner)), sink_(sink), me_(me), ranks_(std::move(ranks)), be_(be),
        collective_(collective) {}

  std::string name() const override { return inner_().name(); }
  int rank() const override { return inner_().rank(); }
  void send(int dst, core::tensor t, const ::troupe::transport::tag& tg) override {
    ::troupe::transport::transport& ep = inner_();
    const int src = ep.rank();
    observe_send(*sink_, me_, src, peer(dst), dst, tg, t, &be_, nullptr, nullptr, &collective_);
    ep.send(dst, std::move(t), tg);
  }
  core::tensor recv(int src, const ::troupe::transport::tag& tg, std::chrono::milliseconds timeout) override {
    ::troupe::transport::transport& ep = inner_();
    core::tensor t = ep.recv(src, tg, timeout);
    if (sink_->wants_received()) {
      if (t.defined() && !t.dev().is_cpu()) be_.wait_ready(t);
      observe_receive(*sink_, src, ep.rank(), tg, t, &be_);
    }
    return t;
  }
  bool ready(int src, const ::troupe::transport::tag& tg) override { return inner_().ready(src, tg); }

 private:
  /// The stage of group member `rank`.
  address peer(int rank) const {
    address a = me_;
    const auto it = std::find(ranks_.begin(), ranks_.end(), rank);
    TROUPE_CHECK(it != ranks_.end(), "rank " + std::to_string(rank) +
                                         " is not in this tensor-parallel group");
    a.c = static_cast<std::int32_t>(it - ranks_.begin());
    return a;
  }

  std::function<::troupe::transport::transport&()> inner_;
  message_sink* sink_;
  address me_;
  std::vector<int> ranks_;
  kernels::backend& be_;
  const std::string& collective_;
};

}  // namespace

tp_group::tp_group(transport::transport& t, std::vector<int> ranks, kernels::backend& be,
                   bool sequence_parallel, int kv_replicas, std::chrono::milliseconds timeout)
    : tp_group([&t]() -> transport::transport& { return t; }, t.rank(), std::move(ranks), be,
               sequence_parallel, kv_replicas, timeout) {}

tp_group::tp_group(std::function<transport::transport&()> endpoint, int me,
                   std::vector<int> ranks, kernels::backend& be, bool sequence_parallel,
                   int kv_replicas, std::chrono::milliseconds timeout)
    : t_(std::move(endpoint)), ranks_(std::move(ranks)), be_(be), sp_(sequence_parallel),
      timeout_(timeout) {
  const auto it = std::find(ranks_.begin(), ranks_.end(), me);
  TROUPE_CHECK(it != ranks_.end(), "rank " + std::to_string(me) +
                                       " is not in its tensor-parallel group");
  me_ = static_cast<int>(it - ranks_.begin());
  TROUPE_CHECK(kv_replicas >= 1 && size() % kv_replicas == 0,
               std::to_string(kv_replicas) + " key/value replicas in a group of " +
                   std::to_string(size()));
  const int first = me_ / kv_replicas * kv_replicas;
  kv_group_.assign(ranks_.begin() + first, ranks_.begin() + first + kv_replicas);
}

void tp_group::record_to(message_sink* sink, const address& me) {
  if (!sink) return;
  TROUPE_CHECK(!observed_, "a tensor-parallel group records to one message sink");
  observed_ = std::make_unique<observed_endpoint>(t_, sink, me, ranks_, be_, collective_);
  t_ = [o = observed_.get()]() -> transport::transport& { return *o; };
}

void tp_group::begin(std::int64_t step, int layer, int micro_batch, tp_phase phase) {
  base_ = {};
  base_.step = step;
  base_.chunk = layer;
  base_.mb = micro_batch;
  base_.kind = tp_kind_base | (static_cast<std::uint32_t>(phase) << 8);
  count_ = 0;
  phase_ = phase;
}

transport::tag tp_group::start(const char* pattern) {
  pattern_ = pattern;
  return next_tag();
}

tensor tp_group::watched::recv(int src, const ::troupe::transport::tag& tg,
                               std::chrono::milliseconds timeout) {
  tp_wait_info w;
  w.step = g_.base_.step;
  w.layer = g_.base_.chunk;
  w.micro_batch = g_.base_.mb;
  w.op = g_.phase_;
  w.collective = g_.pattern_;
  // An all-reduce is a reduce-scatter, then an all-gather under the tag with its top bit flipped.
  if (std::string(g_.pattern_) == "all_reduce")
    w.half = (tg.kind & 0x80000000u) ? "all-gather" : "reduce-scatter";
  w.index = static_cast<int>(g_.count_) - 1;
  w.peer = src;
  w.since = std::chrono::steady_clock::now();
  struct clear {
    tp_wait& slot;
    ~clear() { slot.leave(); }
  };
  g_.wait_->enter(w);
  const clear done{*g_.wait_};
  return g_.t_().recv(src, tg, timeout);
}

transport::tag tp_group::next_tag() {
  TROUPE_CHECK(count_ < 256, "more than 256 tensor-parallel collectives in one op");
  transport::tag tg = base_;
  tg.kind += count_++;
  return tg;
}

tensor tp_group::host(const tensor& x) {
  TROUPE_CHECK(x.type() == core::dtype::f32,
               "tensor-parallel collectives sum fp32 tensors (got another dtype)");
  const tensor h = x.dev().is_cpu() ? x : be_.to_host(x);
  return h.reshape({h.numel()});
}

tensor tp_group::device(const tensor& h, const core::shape_t& shape) {
  const tensor r = h.reshape(shape);
  return be_.dev().is_cpu() ? r : be_.from_host(r);
}

namespace {

int tp_group_position(const std::vector<int>& group, int rank) {
  const auto it = std::find(group.begin(), group.end(), rank);
  TROUPE_CHECK(it != group.end(), "rank " + std::to_string(rank) + " is not in the group");
  return static_cast<int>(it - group.begin());
}

void require_f32(const tensor& x) {
  TROUPE_CHECK(x.type() == core::dtype::f32,
               "tensor-parallel collectives sum fp32 tensors (got " +
                   std::string(core::dtype_name(x.type())) + ")");
}

}  // namespace

void tp_group::send_device(int dst, const tensor& x, const transport::tag& tg) {
  // A buffer of its own: the receiver keeps it, and x may be a view of a tensor still in use.
  tensor buf = be_.empty({x.numel()}, x.type());
  be_.copy(x, buf);
  be_.record_ready(buf);
  net_.send(dst, std::move(buf), tg);
}

tensor tp_group::recv_device(int src, const transport::tag& tg) {
  tensor r = net_.recv(src, tg, timeout_);
  TROUPE_CHECK(!r.dev().is_cpu(), "rank " + std::to_string(src) + " sent a host tensor under " +
                                      tg.to_string() + " to a device collective");
  be_.wait_ready(r);
  return r;
}

tensor tp_group::device_reduce_scatter(const std::vector<int>& group, const tensor& x,
                                       transport::tag tg) {
  const int n = static_cast<int>(group.size());
  const int me = tp_group_position(group, t_().rank());
  TROUPE_CHECK(x.numel() % n == 0, "tensor of " + std::to_string(x.numel()) +
                                       " elements does not split into " + std::to_string(n) +
                                       " equal slices");
  const std::int64_t len = x.numel() / n;
  const tensor flat = x.reshape({x.numel()});
  for (int k = 0; k < n; ++k) {
    if (k == me) continue;
    tg.part = static_cast<std::uint32_t>(k);
    send_device(group[k], flat.slice(k * len, {len}), tg);
  }
  // parts[0] + parts[1] + ..., as transport::ordered_sum adds them.
  tg.part = static_cast<std::uint32_t>(me);
  tensor out = be_.empty({len}, core::dtype::f32);
  for (int k = 0; k < n; ++k) {
    const tensor part = k == me ? flat.slice(me * len, {len}) : recv_device(group[k], tg);
    TROUPE_CHECK(part.numel() == len && part.type() == core::dtype::f32,
                 "reduce_scatter: rank " + std::to_string(group[k]) + " sent " +
                     core::shape_string(part.shape()) + ", expected [" + std::to_string(len) +
                     "] fp32");
    if (k == 0) be_.copy(part, out);
    else be_.accumulate(part, out);
  }
  return out;
}

tensor tp_group::device_all_gather(const std::vector<int>& group, const tensor& slice,
                                   transport::tag tg) {
  const int n = static_cast<int>(group.size());
  const int me = tp_group_position(group, t_().rank());
  const std::int64_t len = slice.numel();
  tg.part = static_cast<std::uint32_t>(me);
  for (int k = 0; k < n; ++k)
    if (k != me) send_device(group[k], slice, tg);
  tensor out = be_.empty({len * n}, slice.type());
  for (int k = 0; k < n; ++k) {
    tg.part = static_cast<std::uint32_t>(k);
    const tensor part = k == me ? slice.reshape({len}) : recv_device(group[k], tg);
    TROUPE_CHECK(part.bytes() == slice.bytes(), "all_gather: rank " + std::to_string(group[k]) +
                                                    " sent " + std::to_string(part.bytes()) +
                                                    " bytes, expected " + std::to_string(slice.bytes()));
    tensor dst = out.slice(k * len, {len});
    be_.copy(part, dst);
  }
  return out;
}

tensor tp_group::device_all_reduce(const std::vector<int>& group, const tensor& x,
                                   transport::tag tg) {
  const tensor mine = device_reduce_scatter(group, x, tg);
  tg.kind ^= 0x80000000u;  // as transport::all_reduce: the gather phase has tags of its own
  return device_all_gather(group, mine, tg).reshape(x.shape());
}

tensor tp_group::gather_rows(const tensor& x) {
  collective_ = "gather_rows";
  if (!sp_ || size() == 1) return x;
  if (on_device(x)) {
    require_f32(x);
    return device_all_gather(ranks_, x, start("all_gather")).reshape({x.dim(0) * size(), x.dim(1)});
  }
  const tensor g = transport::all_gather(net_, ranks_, host(x), start("all_gather"), timeout_);
  return device(g, {x.dim(0) * size(), x.dim(1)});
}

tensor tp_group::reduce_rows(const tensor& x) {
  collective_ = "reduce_rows";
  if (size() == 1) return x;
  if (!sp_) return all_reduce(x);
  TROUPE_CHECK(x.dim(0) % size() == 0, std::to_string(x.dim(0)) + " rows do not split over " +
                                           std::to_string(size()) + " sequence-parallel ranks");
  if (on_device(x)) {
    require_f32(x);
    return device_reduce_scatter(ranks_, x, start("reduce_scatter"))
        .reshape({x.dim(0) / size(), x.dim(1)});
  }
  const tensor r = transport::reduce_scatter(net_, ranks_, host(x), start("reduce_scatter"), timeout_);
  return device(r, {x.dim(0) / size(), x.dim(1)});
}

tensor tp_group::all_reduce(const tensor& x) {
  collective_ = "all_reduce";
  if (size() == 1) return x;
  if (on_device(x)) {
    require_f32(x);
    return device_all_reduce(ranks_, x, start("all_reduce"));
  }
  return device(transport::all_reduce(net_, ranks_, host(x), start("all_reduce"), timeout_), x.shape());
}

tensor tp_group::all_gather(const tensor& x) {
  collective_ = "all_gather";
  if (size() == 1) return x.reshape({x.numel()});
  if (on_device(x)) return device_all_gather(ranks_, x, start("all_gather"));
  const tensor g = transport::all_gather(net_, ranks_, host(x), start("all_gather"), timeout_);
  return device(g, {g.numel()});
}

tensor tp_group::all_reduce_kv(const tensor& x) {
  collective_ = "all_reduce_kv";
  // Every rank takes a tag, so the counters of the group stay in step.
  const transport::tag tg = start("all_reduce");
  if (kv_group_.size() == 1) return x;
  if (on_device(x)) {
    require_f32(x);
    return device_all_reduce(kv_group_, x, tg);
  }
  return device(transport::all_reduce(net_, kv_group_, host(x), tg, timeout_), x.shape());
}

const char* comm_op_name(model::comm_op op) {
  switch (op) {
    case model::comm_op::forward: return "forward";
    case model::comm_op::backward_input: return "backward_input";
    case model::comm_op::backward_weight: return "backward_weight";
    case model::comm_op::recompute: return "recompute";
    case model::comm_op::embedding_forward: return "embedding_forward";
    case model::comm_op::embedding_backward: return "embedding_backward";
    case model::comm_op::loss: return "loss";
    case model::comm_op::head_backward: return "head_backward";
    case model::comm_op::recompute_embedding: return "recompute_embedding";
    case model::comm_op::recompute_loss: return "recompute_loss";
  }
  return "op";
}

std::string describe_wait(const tp_wait_info& w, const std::string& peer) {
  std::string s = std::string("in the tensor-parallel ") + w.collective + " (";
  if (*w.half) s += std::string("its ") + w.half + " half, ";
  s += "collective " + std::to_string(w.index) + " of " + comm_op_name(w.op) + ") of ";
  if (w.layer == -1) s += "the embedding";
  else if (w.layer == -2) s += "the head";
  else s += "layer " + std::to_string(w.layer);
  s += ", micro-batch " + std::to_string(w.micro_batch) + ", step " + std::to_string(w.step) +
       ": waiting to receive from " + peer;
  return s;
}

}  // namespace troupe::actors
