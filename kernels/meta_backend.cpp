#include "kernels/meta_backend.hpp"

#include <algorithm>
#include <atomic>

namespace troupe::kernels {

namespace {
// The CUDA allocator's granules (kernels/cuda/cuda_allocator.cpp).
constexpr std::uint64_t small_granule = 512;
constexpr std::uint64_t small_limit = std::uint64_t{1} << 20;
constexpr std::uint64_t large_granule = std::uint64_t{2} << 20;

// Where meta storages point: addresses never dereferenced, but not null (a storage releases only
// non-null data) and never shared by two live storages (ops check that outputs do not alias
// inputs), handed out from a range no host allocation uses.
std::atomic<std::uintptr_t> next_address{std::uintptr_t{1} << 60};

void* fake_address(std::size_t bytes) {
  const std::uintptr_t span = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;
  return reinterpret_cast<void*>(next_address.fetch_add(span));
}
}  // namespace

meta_backend::meta_backend(options o) : opt_(o) {}

std::uint64_t meta_backend::rounded(std::uint64_t bytes) const {
  if (!opt_.cuda_rounding) return bytes;
  if (bytes == 0) bytes = 1;
  const std::uint64_t g = bytes <= small_limit ? small_granule : large_granule;
  return (bytes + g - 1) / g * g;
}

std::uint64_t meta_backend::live_bytes() const {
  std::lock_guard<std::mutex> lk(counter_->mu);
  return counter_->live;
}
std::uint64_t meta_backend::peak_bytes() const {
  std::lock_guard<std::mutex> lk(counter_->mu);
  return counter_->peak;
}
std::map<std::string, std::uint64_t> meta_backend::peak_by_label() const {
  std::lock_guard<std::mutex> lk(counter_->mu);
  return counter_->peak_split;
}
std::map<std::string, std::uint64_t> meta_backend::live_by_label() const {
  std::lock_guard<std::mutex> lk(counter_->mu);
  return counter_->by_label;
}

void meta_backend::reset_peak() {
  std::lock_guard<std::mutex> lk(counter_->mu);
  counter_->peak = counter_->live;
  counter_->peak_split = counter_->by_label;
}

tensor meta_backend::empty(const core::shape_t& shape, core::dtype t) {
  for (auto d : shape)
    if (d < 0) throw core::failure("meta empty: negative dimension in " + core::shape_string(shape));
  auto st = std::make_shared<core::storage>();
  st->bytes = static_cast<std::size_t>(core::numel_of(shape)) * core::dtype_size(t);
  st->data = fake_address(st->bytes);
  st->dev = dev_;
  std::string label = label_;
  if (classify_) {
    std::string c = classify_(shape, t);
    if (!c.empty()) label = std::move(c);
  }
  const std::uint64_t bytes = rounded(st->bytes);
  {
    counter& c = *counter_;
    std::lock_guard<std::mutex> lk(c.mu);
    c.live += bytes;
    c.by_label[label] += bytes;
    if (c.live > c.peak) {
      c.peak = c.live;
      c.peak_split = c.by_label;
    }
  }
  st->release = [cnt = counter_, bytes, label](void*) {
    std::lock_guard<std::mutex> lk(cnt->mu);
    cnt->live -= bytes;
    cnt->by_label[label] -= bytes;
  };
  // tensor::over checks the view against storage bytes only; the data is never touched.
  return tensor::over(std::move(st), 0, shape, t);
}

void meta_backend::linear_backward_input_gelu(const tensor& dy, const tensor& w, const tensor& pre,
                                              tensor& dx) {
  // The CUDA backend fuses it into one GEMM epilogue; the default (the CPU's) allocates a
  // temporary the size of dx.
  if (!opt_.cuda_fusions) backend::linear_backward_input_gelu(dy, w, pre, dx);
}

}  // namespace troupe::kernels
