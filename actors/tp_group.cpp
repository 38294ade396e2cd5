// The tensor-parallel group's collectives over a transport. See tp_group.hpp.
#include "actors/tp_group.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace troupe::actors {

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

void tp_group::begin(std::int64_t step, int layer, int micro_batch, tp_phase phase) {
  base_ = {};
  base_.step = step;
  base_.chunk = layer;
  base_.mb = micro_batch;
  base_.kind = tp_kind_base | (static_cast<std::uint32_t>(phase) << 8);
  count_ = 0;
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

tensor tp_group::gather_rows(const tensor& x) {
  if (!sp_ || size() == 1) return x;
  const tensor g = transport::all_gather(t_(), ranks_, host(x), next_tag(), timeout_);
  return device(g, {x.dim(0) * size(), x.dim(1)});
}

tensor tp_group::reduce_rows(const tensor& x) {
  if (size() == 1) return x;
  if (!sp_) return all_reduce(x);
  TROUPE_CHECK(x.dim(0) % size() == 0, std::to_string(x.dim(0)) + " rows do not split over " +
                                           std::to_string(size()) + " sequence-parallel ranks");
  const tensor r = transport::reduce_scatter(t_(), ranks_, host(x), next_tag(), timeout_);
  return device(r, {x.dim(0) / size(), x.dim(1)});
}

tensor tp_group::all_reduce(const tensor& x) {
  if (size() == 1) return x;
  return device(transport::all_reduce(t_(), ranks_, host(x), next_tag(), timeout_), x.shape());
}

tensor tp_group::all_gather(const tensor& x) {
  if (size() == 1) return x.reshape({x.numel()});
  const tensor g = transport::all_gather(t_(), ranks_, host(x), next_tag(), timeout_);
  return device(g, {g.numel()});
}

tensor tp_group::all_reduce_kv(const tensor& x) {
  // Every rank takes a tag, so the counters of the group stay in step.
  const transport::tag tg = next_tag();
  if (kv_group_.size() == 1) return x;
  return device(transport::all_reduce(t_(), kv_group_, host(x), tg, timeout_), x.shape());
}

}  // namespace troupe::actors
