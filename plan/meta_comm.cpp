// The dry run's tensor-parallel collectives. See meta_comm.hpp.
#include "plan/meta_comm.hpp"

#include <vector>

#include "core/error.hpp"

namespace troupe::plan {

using core::tensor;

meta_comm::meta_comm(int size, int rank, bool sequence_parallel, int kv_replicas,
                     kernels::meta_backend& be, kernels::meta_backend& uncounted, bool device)
    : size_(size), rank_(rank), sp_(sequence_parallel), kv_replicas_(kv_replicas), be_(be),
      uncounted_(uncounted), device_(device) {
  TROUPE_CHECK(size >= 1 && rank >= 0 && rank < size && kv_replicas >= 1 && size % kv_replicas == 0,
               "meta_comm: rank " + std::to_string(rank) + " of " + std::to_string(size) + " with " +
                   std::to_string(kv_replicas) + " key/value replicas");
}

tensor meta_comm::result(const core::shape_t& shape) {
  return (device_ ? be_ : uncounted_).empty(shape, core::dtype::f32);
}

tensor meta_comm::reduce_scatter(int n, const tensor& x, const core::shape_t& out) {
  if (!device_) return result(out);
  const std::int64_t len = x.numel() / n;
  std::vector<tensor> sent;  // tp_group::send_device's buffers, one per peer
  {
    kernels::meta_backend::scope s(be_, "communication");
    for (int k = 1; k < n; ++k) sent.push_back(be_.empty({len}, x.type()));
  }
  return result(out);
}

tensor meta_comm::gather(int n, const tensor& slice, const core::shape_t& out) {
  if (!device_) return uncounted_.empty(out, slice.type());
  std::vector<tensor> sent;
  {
    kernels::meta_backend::scope s(be_, "communication");
    for (int k = 1; k < n; ++k) sent.push_back(be_.empty({slice.numel()}, slice.type()));
  }
  return be_.empty(out, slice.type());
}

tensor meta_comm::sum(int n, const tensor& x) {
  if (!device_) return result(x.shape());
  // tp_group::device_all_reduce: this rank's slice of the sum, then every slice gathered.
  const tensor mine = reduce_scatter(n, x, {x.numel() / n});
  return gather(n, mine, x.shape());
}

tensor meta_comm::gather_rows(const tensor& x) {
  if (!sp_ || size_ == 1) return x;
  return gather(size_, x, {x.dim(0) * size_, x.dim(1)});
}

tensor meta_comm::reduce_rows(const tensor& x) {
  if (size_ == 1) return x;
  if (!sp_) return all_reduce(x);
  TROUPE_CHECK(x.dim(0) % size_ == 0, std::to_string(x.dim(0)) + " rows do not split over " +
                                          std::to_string(size_) + " sequence-parallel ranks");
  return reduce_scatter(size_, x, {x.dim(0) / size_, x.dim(1)});
}

tensor meta_comm::all_reduce(const tensor& x) { return size_ == 1 ? x : sum(size_, x); }

tensor meta_comm::all_gather(const tensor& x) {
  if (size_ == 1) return x.reshape({x.numel()});
  return gather(size_, x, {x.numel() * size_});
}

tensor meta_comm::all_reduce_kv(const tensor& x) {
  return kv_replicas_ == 1 ? x : sum(kv_replicas_, x);
}

}  // namespace troupe::plan
