// Memory primitives of the CPU backend (empty, zero, copy), and its construction.
#include "kernels/cpu/cpu_backend.hpp"

#include <cblas.h>

#include <cstring>
#include <mutex>

#include "kernels/check.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {

cpu_backend::cpu_backend() {
  // OpenBLAS's own threads give different bits for different thread counts (its edge tiles
  // depend on how it splits the output; measured in docs/kernels.md), and its threaded driver
  // serialises concurrent callers behind one lock. So OpenBLAS always runs single-threaded and
  // linear.cpp splits each GEMM into shape-determined blocks on our own pool instead.
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

tensor cpu_backend::empty(const core::shape_t& shape, core::dtype t) {
  tensor out = tensor::zeros(shape, t);
  // The storage's own release frees the memory; wrap it to count. Storage bytes, not the 64-byte
  // rounded allocation: the planner counts tensor bytes.
  const std::shared_ptr<core::storage>& st = out.store();
  const std::uint64_t bytes = st->bytes;
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
