#include "transport/local.hpp"

#include <cstring>

#include "core/error.hpp"

namespace troupe::transport {

std::string tag::to_string() const {
  return "step " + std::to_string(step) + " kind " + std::to_string(kind) + " chunk " +
         std::to_string(chunk) + " mb " + std::to_string(mb) + " part " + std::to_string(part);
}

tensor ordered_sum(const std::vector<tensor>& parts) {
  TROUPE_CHECK(!parts.empty(), "ordered_sum of nothing");
  tensor out = parts[0].clone();
  float* o = out.data<float>();
  for (std::size_t p = 1; p < parts.size(); ++p) {
    TROUPE_CHECK(parts[p].numel() == out.numel() && parts[p].type() == core::dtype::f32,
                 "ordered_sum: part " + std::to_string(p) + " is " +
                     core::shape_string(parts[p].shape()) + ", expected " +
                     core::shape_string(out.shape()) + " fp32");
    const float* x = parts[p].data<float>();
    for (std::int64_t i = 0; i < out.numel(); ++i) o[i] += x[i];
  }
  return out;
}

void local_hub::put(int src, int dst, const tag& tg, tensor t) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto [it, fresh] = slots_.emplace(key{src, dst, tg}, std::move(t));
    TROUPE_CHECK(fresh, "rank " + std::to_string(src) + " sent twice to rank " +
                            std::to_string(dst) + " under " + tg.to_string());
  }
  cv_.notify_all();
}

tensor local_hub::take(int src, int dst, const tag& tg, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  auto k = key{src, dst, tg};
  const bool there =
      cv_.wait_for(lk, timeout, [&] { return slots_.count(k) > 0 || !closed_.empty(); });
  if (there && slots_.count(k) == 0)
    throw core::failure("rank " + std::to_string(dst) + " stopped waiting for a tensor from rank " +
                        std::to_string(src) + " (" + tg.to_string() + "): " + closed_);
  if (!there)
    throw core::failure("rank " + std::to_string(dst) + " waited " +
                        std::to_string(timeout.count()) + " ms for a tensor from rank " +
                        std::to_string(src) + " (" + tg.to_string() + ") that never came");
  auto node = slots_.extract(k);
  return std::move(node.mapped());
}

bool local_hub::has(int src, int dst, const tag& tg) {
  std::lock_guard<std::mutex> lk(mu_);
  return slots_.count(key{src, dst, tg}) > 0;
}

std::size_t local_hub::in_flight() {
  std::lock_guard<std::mutex> lk(mu_);
  return slots_.size();
}

void local_hub::close(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = why.empty() ? "closed" : why;
  }
  cv_.notify_all();
}

void local_transport::send(int dst, tensor t, const tag& tg) { hub_->put(rank_, dst, tg, std::move(t)); }

tensor local_transport::recv(int src, const tag& tg, std::chrono::milliseconds timeout) {
  return hub_->take(src, rank_, tg, timeout);
}

bool local_transport::ready(int src, const tag& tg) { return hub_->has(src, rank_, tg); }

}  // namespace troupe::transport
