// The collectives of one tensor-parallel group over a transport: model::layer_comm for the
// layers, the vocabulary-parallel embedding and the loss (model/tensor_parallel.hpp). No CAF: the
// collectives block, so each rank of the group calls them from its own thread (a test's thread,
// or the worker thread of its stage).
//
// Tags. Before each op of a layer (forward, backward_input, backward_weight, ...) the caller names
// it with begin(); the op's collectives then take tags (step, kind = tp_kind_base | phase << 8 |
// n, chunk = layer, mb = micro-batch) where n counts the collectives since begin(). Every rank of
// the group runs the same ops in the same order, so their tags match, and no two collectives of
// a step share one.
//
// Each blocking receive of a collective is published in the group's tp_wait slot
// (actors/tp_wait.hpp) while it waits, so the watchdog can name what a blocked stage waits for.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include <string>

#include "actors/tp_wait.hpp"
#include "actors/wire.hpp"
#include "kernels/backend.hpp"
#include "model/layer.hpp"
#include "transport/transport.hpp"

namespace troupe::actors {

using core::tensor;

/// Which op of a layer (or of the embedding / head) a collective belongs to.
using tp_phase = model::comm_op;

class message_sink;

class tp_group final : public model::layer_comm {
 public:
  /// `ranks`: the group's global ranks in group order (tensor parallel innermost: consecutive
  /// ranks, docs/model.md); this endpoint's rank must be one of them. `kv_replicas`: ranks that
  /// hold the same key/value head (model::kv_replicas), consecutive in the group.
  tp_group(transport::transport& t, std::vector<int> ranks, kernels::backend& be,
           bool sequence_parallel, int kv_replicas, std::chrono::milliseconds timeout);
  /// The same for global rank `me`, whose endpoint `endpoint` returns at the first collective
  /// (a job's endpoints exist only once its stages are built).
  tp_group(std::function<transport::transport&()> endpoint, int me, std::vector<int> ranks,
           kernels::backend& be, bool sequence_parallel, int kv_replicas,
           std::chrono::milliseconds timeout);

  /// Names the op whose collectives come next.
  void begin(std::int64_t step, int layer, int micro_batch, tp_phase phase);
  /// The step begin_op's tags carry (a stage sets it when its step begins).
  void set_step(std::int64_t step) { step_ = step; }
  void begin_op(int layer, int micro_batch, model::comm_op op) override {
    begin(step_, layer, micro_batch, op);
  }

  /// Shows `sink` every tensor this rank's collectives send (and, when it asks, receive), as
  /// route() and receive() show it the stage's other messages (actors/recorder.hpp): `me` is this
  /// rank's stage; the peers are the stages of the same (dp, pp) with their tp rank. The records'
  /// op names the collective ("all_reduce", "gather_rows", ...).
  void record_to(message_sink* sink, const address& me);
  /// The collective running now ("all_reduce", "reduce_rows", ...; "" before the first).
  const std::string& collective() const { return collective_; }

  int rank() const override { return me_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  bool sequence_parallel() const override { return sp_; }
  tensor gather_rows(const tensor& x) override;
  tensor reduce_rows(const tensor& x) override;
  tensor all_reduce(const tensor& x) override;
  tensor all_gather(const tensor& x) override;
  tensor all_reduce_kv(const tensor& x) override;

  /// What this rank is blocked on inside a collective, readable from any thread.
  std::shared_ptr<const tp_wait> wait_slot() const { return wait_; }

 private:
  // The endpoint, with every receive published in wait_ while it waits.
  class watched final : public transport::transport {
   public:
    explicit watched(tp_group& g) : g_(g) {}
    std::string name() const override { return g_.t_().name(); }
    int rank() const override { return g_.t_().rank(); }
    void send(int dst, tensor t, const ::troupe::transport::tag& tg) override {
      g_.t_().send(dst, std::move(t), tg);
    }
    tensor recv(int src, const ::troupe::transport::tag& tg, std::chrono::milliseconds timeout) override;
    bool ready(int src, const ::troupe::transport::tag& tg) override { return g_.t_().ready(src, tg); }

   private:
    tp_group& g_;
  };
  /// Names the pattern of the transfers whose receives come next and takes its tag.
  transport::tag start(const char* pattern);
  transport::tag next_tag();
  tensor host(const tensor& x);
  tensor device(const tensor& h, const core::shape_t& shape);
  bool on_device(const tensor& x) const { return !x.dev().is_cpu(); }
  // The device collectives (x on this rank's GPU, flat fp32): the same patterns of point-to-point
  // transfers as transport/collectives.cpp, with the sums in group order on the GPU, so a group
  // gives the same bits over the local transport (one process) and over nccl (one per rank).
  tensor device_reduce_scatter(const std::vector<int>& group, const tensor& x, transport::tag tg);
  tensor device_all_gather(const std::vector<int>& group, const tensor& slice, transport::tag tg);
  tensor device_all_reduce(const std::vector<int>& group, const tensor& x, transport::tag tg);
  void send_device(int dst, const tensor& x, const transport::tag& tg);
  tensor recv_device(int src, const transport::tag& tg);

  std::function<transport::transport&()> t_;
  std::vector<int> ranks_;
  std::vector<int> kv_group_;  // the ranks holding this rank's key/value head
  kernels::backend& be_;
  bool sp_;
  std::chrono::milliseconds timeout_;
  int me_ = 0;
  std::int64_t step_ = 0;
  transport::tag base_{};
  std::uint32_t count_ = 0;
  std::string collective_;
  std::unique_ptr<transport::transport> observed_;  // record_to's view of the endpoint
  model::comm_op phase_ = model::comm_op::forward;
  const char* pattern_ = "";  // the transfers' pattern: all_gather, reduce_scatter, all_reduce
  std::shared_ptr<tp_wait> wait_ = std::make_shared<tp_wait>();
  watched net_{*this};
};

}  // namespace troupe::actors
