// Collectives as patterns of point-to-point transfers. Reductions gather every member's slice at
// its owner and add them in group order, so the result is the same bits whatever the arrival
// order — the property data-parallel determinism rests on (docs/design.md, Determinism contract).
#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "transport/transport.hpp"

namespace troupe::transport {
namespace {

int position(const std::vector<int>& group, int rank) {
  auto it = std::find(group.begin(), group.end(), rank);
  TROUPE_CHECK(it != group.end(), "rank " + std::to_string(rank) + " is not in the group");
  return static_cast<int>(it - group.begin());
}

tensor slice_of(const tensor& x, int k, int n) {
  TROUPE_CHECK(x.numel() % n == 0, "tensor of " + std::to_string(x.numel()) +
                                       " elements does not split into " + std::to_string(n) +
                                       " equal slices");
  std::int64_t len = x.numel() / n;
  return x.slice(k * len, {len});
}

}  // namespace

tensor reduce_scatter(transport& t, const std::vector<int>& group, const tensor& x, tag tg,
                      std::chrono::milliseconds timeout) {
  int n = static_cast<int>(group.size());
  int me = position(group, t.rank());
  for (int k = 0; k < n; ++k) {
    if (k == me) continue;
    tg.part = k;
    t.send(group[k], slice_of(x, k, n).clone(), tg);
  }
  std::vector<tensor> parts(n);
  tg.part = me;
  for (int k = 0; k < n; ++k)
    parts[k] = k == me ? slice_of(x, me, n) : t.recv(group[k], tg, timeout);
  return ordered_sum(parts);
}

tensor all_gather(transport& t, const std::vector<int>& group, const tensor& slice, tag tg,
                  std::chrono::milliseconds timeout) {
  int n = static_cast<int>(group.size());
  int me = position(group, t.rank());
  tg.part = me;
  for (int k = 0; k < n; ++k)
    if (k != me) t.send(group[k], slice.clone(), tg);
  tensor out = tensor::zeros({slice.numel() * n}, slice.type());
  for (int k = 0; k < n; ++k) {
    tg.part = k;
    tensor part = k == me ? slice : t.recv(group[k], tg, timeout);
    TROUPE_CHECK(part.bytes() == slice.bytes(), "all_gather: rank " + std::to_string(group[k]) +
                                                    " sent " + std::to_string(part.bytes()) +
                                                    " bytes, expected " + std::to_string(slice.bytes()));
    std::memcpy(static_cast<char*>(out.raw()) + k * slice.bytes(), part.raw(), slice.bytes());
  }
  return out;
}

tensor all_reduce(transport& t, const std::vector<int>& group, const tensor& x, tag tg,
                  std::chrono::milliseconds timeout) {
  tensor mine = reduce_scatter(t, group, x, tg, timeout);
  tg.kind ^= 0x80000000u;  // the gather phase must not collide with the scatter phase's tags
  return all_gather(t, group, mine, tg, timeout).reshape(x.shape());
}

tensor broadcast(transport& t, const std::vector<int>& group, int root, const tensor& x, tag tg,
                 std::chrono::milliseconds timeout) {
  position(group, root);
  tg.part = 0;
  if (t.rank() == root) {
    for (int r : group)
      if (r != root) t.send(r, x.clone(), tg);
    return x;
  }
  return t.recv(root, tg, timeout);
}

}  // namespace troupe::transport
