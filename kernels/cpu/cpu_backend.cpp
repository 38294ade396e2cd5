// Memory primitives of the CPU backend (empty, zero, copy), and its construction.
#include "kernels/cpu/cpu_backend.hpp"

#include <cblas.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "kernels/check.hpp"
#include "kernels/cpu/blas_core.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

cpu_backend::cpu_backend() {
  // OpenBLAS's own threads give different bits for different thread counts (its edge tiles
  // depend on how it splits the output; measured in docs/kernels.md), and its threaded driver
  // serialises concurrent callers behind one lock. So OpenBLAS always runs single-threaded and
  // linear.cpp splits each GEMM into shape-determined blocks on our own pool instead.
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
  // Referencing blas_core.cpp links it, and its static initialiser has chosen OpenBLAS's kernels
  // for this processor before main() (blas_core.cpp says why).
  (void)blas_core_chosen();
}

namespace {

// Blocks at least this large are kept for reuse when freed, up to spare_max_bytes per backend
// (a few of the tiny demo's 51 MB logits; a GPT-2 124M micro-batch's are larger and go back).
constexpr std::size_t spare_min_bytes = std::size_t{1} << 20;
constexpr std::size_t spare_max_bytes = std::size_t{256} << 20;

}  // namespace

cpu_backend::memory_counter::~memory_counter() {
  for (auto& [size, p] : spare) std::free(p);
}

tensor cpu_backend::empty(const core::shape_t& shape, core::dtype t) {
  for (auto d : shape) TROUPE_CHECK(d >= 0, "negative dimension in " + core::shape_string(shape));
  const std::uint64_t bytes =
      static_cast<std::uint64_t>(core::numel_of(shape)) * core::dtype_size(t);
  tensor out;
  if (bytes >= spare_min_bytes) {
    // The block size tensor::zeros would allocate; a kept block of exactly that size is reused.
    const std::size_t alloc = (bytes + 63) / 64 * 64;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lk(mem_->spare_mu);
      for (auto it = mem_->spare.begin(); it != mem_->spare.end(); ++it)
        if (it->first == alloc) {
          p = it->second;
          mem_->spare_bytes -= alloc;
          mem_->spare.erase(it);
          break;
        }
    }
    if (!p) p = std::aligned_alloc(64, alloc);
    if (!p) throw core::failure("host allocation of " + std::to_string(alloc) + " bytes failed");
    std::memset(p, 0, alloc);
    auto st = std::make_shared<core::storage>();
    st->data = p;
    st->bytes = bytes;
    // Back to the spare list while it has room, else to the system.
    st->release = [counter = std::weak_ptr<memory_counter>(mem_), alloc](void* q) {
      if (auto c = counter.lock()) {
        std::lock_guard<std::mutex> lk(c->spare_mu);
        if (c->spare_bytes + alloc <= spare_max_bytes) {
          c->spare.emplace_back(alloc, q);
          c->spare_bytes += alloc;
          return;
        }
      }
      std::free(q);
    };
    out = tensor::over(std::move(st), 0, shape, t);
  } else {
    out = tensor::zeros(shape, t);
  }
  // The storage's own release frees the memory; wrap it to count. Storage bytes, not the 64-byte
  // rounded allocation: the planner counts tensor bytes.
  const std::shared_ptr<core::storage>& st = out.store();
  std::uint64_t now = mem_->live.fetch_add(bytes) + bytes;
  std::uint64_t peak = mem_->peak.load();
  while (now > peak && !mem_->peak.compare_exchange_weak(peak, now)) {
  }
  st->release = [counter = mem_, bytes, free_it = std::move(st->release)](void* p) {
    counter->live.fetch_sub(bytes);
    free_it(p);
  };
  return out;
}

std::uint64_t cpu_backend::peak_memory_bytes() const { return mem_->peak.load(); }
std::uint64_t cpu_backend::live_memory_bytes() const { return mem_->live.load(); }

void cpu_backend::zero(tensor& x) {
  op_check c("zero", {{"x", &x}});
  c.require(x.defined() && x.dev().is_cpu(), "x must be a defined host tensor");
  if (x.bytes()) std::memset(x.raw(), 0, x.bytes());
}

void cpu_backend::copy(const tensor& src, tensor& dst) {
  op_check c("copy", {{"src", &src}, {"dst", &dst}});
  c.require(src.defined() && dst.defined() && src.dev().is_cpu() && dst.dev().is_cpu(),
            "src and dst must be defined host tensors");
  c.require(src.bytes() == dst.bytes(), "src and dst must have the same byte size");
  if (src.bytes() && src.raw() != dst.raw()) std::memmove(dst.raw(), src.raw(), src.bytes());
}

}  // namespace troupe::kernels::cpu
