// Host transfers shared by all backends, and the defaults of the generation ops (a backend
// without them refuses by name).
#include "kernels/backend.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/check.hpp"
#include "kernels/message_hash.hpp"

namespace troupe::kernels {

tensor backend::to_host(const tensor& x) {
  synchronize();
  tensor host = tensor::zeros(x.shape(), x.type());
  copy(x, host);
  synchronize();
  return host;
}

tensor backend::from_host(const tensor& host) {
  tensor x = empty(host.shape(), host.type());
  copy(host, x);
  return x;
}

namespace {

class ready_value final : public pending_value {
 public:
  explicit ready_value(std::uint64_t v) : v_(v) {}
  std::uint64_t get() override { return v_; }

 private:
  std::uint64_t v_;
};

}  // namespace

namespace {

[[noreturn]] void no_generation(const backend& be, const char* op) {
  throw core::failure(be.name() + " backend has no " + op +
                      " (hint: generate text on the cpu or cuda backend)");
}

}  // namespace

void backend::embedding_forward_at(const tensor&, const tensor&, const tensor&, const tensor&,
                                   tensor&) {
  no_generation(*this, "embedding_forward_at");
}
void backend::rope_forward_at(const tensor&, const tensor&, int, int, int, const rope_spec&,
                              tensor&) {
  no_generation(*this, "rope_forward_at");
}
namespace {
[[noreturn]] void no_documents(const backend& be, const char* op) {
  throw core::failure(std::string(op) + ": the " + be.name() +
                      " backend does not train on packed documents (instruction shards of "
                      "packed rows, data.packing = true) (hint: train on the cpu backend, or "
                      "prepare padded rows with data.packing = false)");
}
}  // namespace

void backend::embedding_backward_at(const tensor&, const tensor&, const tensor&, tensor&,
                                    tensor&) {
  no_documents(*this, "embedding_backward_at");
}
void backend::rope_backward_at(const tensor&, const tensor&, int, int, int, const rope_spec&,
                               tensor&) {
  no_documents(*this, "rope_backward_at");
}
void backend::kv_cache_write(const tensor&, const tensor&, const tensor&, const attention_dims&,
                             tensor&, tensor&) {
  no_generation(*this, "kv_cache_write");
}
void backend::attention_decode(const tensor&, const tensor&, const tensor&, const tensor&,
                               const tensor&, const attention_dims&, tensor&) {
  no_generation(*this, "attention_decode");
}

std::shared_ptr<pending_value> backend::message_hash_async(const tensor& x) {
  if (!x.defined() || x.bytes() == 0) return std::make_shared<ready_value>(message_hash(nullptr, 0));
  const tensor host = x.dev().is_cpu() ? x : to_host(x);
  return std::make_shared<ready_value>(message_hash(host.raw(), host.bytes()));
}

namespace {

/// Checks `blocks` against the message_hash_blocks_of(bytes) digests it must hold.
void require_blocks(const tensor& blocks, std::uint64_t bytes, const char* op) {
  require_type(blocks, core::dtype::i64, op, "blocks");
  require_numel(blocks, static_cast<std::int64_t>(message_hash_blocks_of(bytes)), op,
                "blocks (message_hash_blocks_of(bytes))");
}

/// The first level of x's message hash into `blocks`, through a host copy of x.
void hash_blocks_into(backend& be, const tensor& x, tensor& blocks) {
  if (x.bytes() == 0) return;
  const tensor host = x.dev().is_cpu() ? x : be.to_host(x);
  if (blocks.dev().is_cpu()) {
    message_hash_blocks(host.raw(), host.bytes(), blocks.data<std::uint64_t>());
    return;
  }
  tensor out = tensor::zeros(blocks.shape(), core::dtype::i64);
  message_hash_blocks(host.raw(), host.bytes(), out.data<std::uint64_t>());
  be.copy(out, blocks);
}

}  // namespace

void backend::adamw_runs_hashed(tensor& param, const tensor& grad, tensor& m, tensor& v,
                                const std::vector<adamw_run>& runs, const adamw_params& p,
                                tensor& low, tensor& blocks) {
  require_blocks(blocks, param.bytes(), "adamw_runs_hashed");
  adamw_runs(param, grad, m, v, runs, p, low);
  if (param.bytes() == 0) return;
  hash_blocks_into(*this, param, blocks);
}

void backend::message_hash_sumsq_blocks(const tensor& x, const tensor& counts, tensor& blocks,
                                        tensor& sums) {
  const char* op = "message_hash_sumsq_blocks";
  require_type(x, core::dtype::f32, op, "x");
  require_blocks(blocks, x.bytes(), op);
  const std::int64_t nb = blocks.numel();
  require_type(counts, core::dtype::i32, op, "counts");
  require_numel(counts, nb, op, "counts (one per block)");
  require_type(sums, core::dtype::f64, op, "sums");
  require_numel(sums, nb, op, "sums (one per block)");
  if (nb == 0) return;
  hash_blocks_into(*this, x, blocks);
  const tensor host_counts = counts.dev().is_cpu() ? counts : to_host(counts);
  const std::int32_t* c = host_counts.data<std::int32_t>();
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t room = std::min(norm_block, x.numel() - b * norm_block);
    if (c[b] < 0 || c[b] > room)
      throw core::failure(std::string(op) + ": counts[" + std::to_string(b) + "] is " +
                          std::to_string(c[b]) + ", outside [0, " + std::to_string(room) +
                          "] (the block's elements)");
  }
  // Each stretch of blocks whose counts are full but for the last (a tensor, or tensors back to
  // back) is one tensor for sumsq_blocks_list: its blocks are the stretch's blocks.
  std::vector<tensor> parts;
  std::vector<std::int64_t> first;  // the first block of each part
  std::int64_t part_blocks = 0;
  for (std::int64_t b = 0; b < nb; ++b) {
    if (c[b] == 0) continue;
    std::int64_t e = b;
    while (c[e] == norm_block && e + 1 < nb && c[e + 1] > 0) ++e;
    parts.push_back(x.slice(b * norm_block, {(e - b) * norm_block + c[e]}));
    first.push_back(b);
    part_blocks += e - b + 1;
    b = e;
  }
  zero(sums);
  if (parts.empty()) return;
  tensor part_sums = empty({part_blocks}, core::dtype::f64);
  sumsq_blocks_list(parts, part_sums);
  std::int64_t at = 0;
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const std::int64_t n = (parts[k].numel() + norm_block - 1) / norm_block;
    tensor dst = sums.slice(first[k], {n});
    copy(part_sums.slice(at, {n}), dst);
    at += n;
  }
}

std::shared_ptr<pending_value> backend::message_hash_of_blocks_async(const tensor& blocks,
                                                                    std::uint64_t bytes) {
  require_blocks(blocks, bytes, "message_hash_of_blocks_async");
  const tensor host = blocks.dev().is_cpu() ? blocks : to_host(blocks);
  return std::make_shared<ready_value>(message_hash_of_blocks(
      host.numel() > 0 ? host.data<std::uint64_t>() : nullptr, bytes));
}

namespace {
struct host_mark : time_mark {
  std::chrono::steady_clock::time_point at;
};
}  // namespace

std::shared_ptr<time_mark> backend::mark_time() {
  auto m = std::make_shared<host_mark>();
  m->at = std::chrono::steady_clock::now();
  return m;
}

std::vector<std::chrono::steady_clock::time_point> backend::mark_times(
    const std::vector<std::shared_ptr<time_mark>>& marks) {
  std::vector<std::chrono::steady_clock::time_point> out;
  out.reserve(marks.size());
  for (const auto& m : marks) {
    auto* h = dynamic_cast<const host_mark*>(m.get());
    if (!h) throw core::failure(name() + " backend: mark_times got a mark of another backend");
    out.push_back(h->at);
  }
  return out;
}

}  // namespace troupe::kernels
