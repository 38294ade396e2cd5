// The tensor-parallel collectives of the plan's dry run: a model::layer_comm for one rank of a
// group whose tensors live on a meta backend (kernels/meta_backend.hpp). Meta tensors carry no
// values, so a collective's result does not depend on what the peers send: each rank returns the
// shapes actors::tp_group returns at once, without waiting for its peers, and the dry run can
// step every rank of a group one after another on one thread.
//
// What it allocates is what tp_group allocates on the rank's backend, by path:
//  - device (a dry run for CUDA): the device collectives of actors/tp_group.cpp. A reduce-scatter
//    of x sends n-1 copies of its slices (each x/n, allocated by the sender and held until the
//    peer has summed it), then allocates its slice of the sum; an all-gather sends n-1 copies of
//    its slice and allocates the whole result; an all-reduce is the two. The send buffers are
//    counted as live until the collective returns (its peers run the same collective at the same
//    time and let them go there), the results live on as the caller keeps them.
//  - host (a dry run for the CPU): the CPU backend's collectives sum in host tensors the transport
//    allocates, outside the backend's count (what metrics.jsonl reports); their results are
//    handed out from `uncounted`.
// tests/plan/meta_comm_test.cpp runs the real tp_group's device path on meta backends over the
// in-process transport (a thread per rank) and checks that each rank keeps the same bytes and
// peaks within one phase's send buffers; tests/plan/memory_test.cpp checks the CPU path's plans
// against real tensor-parallel CPU runs.
#pragma once

#include "kernels/meta_backend.hpp"
#include "model/layer.hpp"

namespace troupe::plan {

class meta_comm final : public model::layer_comm {
 public:
  /// Rank `rank` of `size`; `kv_replicas` ranks hold the same key/value head
  /// (model::kv_replicas). `be` is the rank's backend; `uncounted` hands out the CPU path's host
  /// results. REQUIRES: both outlive the comm.
  meta_comm(int size, int rank, bool sequence_parallel, int kv_replicas, kernels::meta_backend& be,
            kernels::meta_backend& uncounted, bool device);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool sequence_parallel() const override { return sp_; }
  core::tensor gather_rows(const core::tensor& x) override;
  core::tensor reduce_rows(const core::tensor& x) override;
  core::tensor all_reduce(const core::tensor& x) override;
  core::tensor all_gather(const core::tensor& x) override;
  core::tensor all_reduce_kv(const core::tensor& x) override;

 private:
  // The collectives over a group of n ranks, as tp_group's device or host path allocates them.
  core::tensor reduce_scatter(int n, const core::tensor& x, const core::shape_t& out);
  core::tensor gather(int n, const core::tensor& slice, const core::shape_t& out);
  core::tensor sum(int n, const core::tensor& x);
  core::tensor result(const core::shape_t& shape);

  int size_, rank_;
  bool sp_;
  int kv_replicas_;
  kernels::meta_backend& be_;
  kernels::meta_backend& uncounted_;
  bool device_;
};

}  // namespace troupe::plan
