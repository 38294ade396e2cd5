// Backend selection by device name and the process-wide kernel settings (kernels/select.hpp).
#include "kernels/select.hpp"

#include <charconv>

#include "core/error.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"
#ifdef TROUPE_HAVE_CUDA
#include "kernels/cuda/cuda_backend.hpp"
#endif

namespace troupe::kernels {

namespace {

// The GPU index of "cuda" (0) or "cuda:<i>"; -1 when `device` is neither.
int cuda_index(const std::string& device) {
  if (device == "cuda") return 0;
  const std::string prefix = "cuda:";
  if (device.rfind(prefix, 0) != 0 || device.size() == prefix.size()) return -1;
  int index = -1;
  const char* first = device.data() + prefix.size();
  const char* last = device.data() + device.size();
  auto [end, ec] = std::from_chars(first, last, index);
  if (ec != std::errc() || end != last || index < 0) return -1;
  return index;
}

}  // namespace

std::unique_ptr<backend> make_backend(const std::string& device, gpu_share share) {
  if (device == "cpu") {
    if (share.count > 1)
      throw core::failure("runtime.split_gpu splits a GPU's SMs; the CPU backend has none to split "
                          "(hint: set runtime.device = \"cuda\" or runtime.split_gpu = false)");
    return std::make_unique<cpu::cpu_backend>();
  }
  const int index = cuda_index(device);
  if (index < 0)
    throw core::failure("unknown device \"" + device +
                        "\" (hint: runtime.device takes cpu, cuda or cuda:<index>)");
#ifdef TROUPE_HAVE_CUDA
  if (!cuda_device_present())
    throw core::failure("device \"" + device +
                        "\": no GPU is visible to the CUDA runtime (hint: check nvidia-smi and "
                        "CUDA_VISIBLE_DEVICES, or set runtime.device = \"cpu\")");
  return make_cuda_backend(index, share.index, share.count);
#else
  throw core::failure("device \"" + device +
                      "\": this build has no CUDA backend (hint: configure with -DTROUPE_CUDA=ON "
                      "on a machine with nvcc, or set runtime.device = \"cpu\")");
#endif
}

bool cuda_available() {
#ifdef TROUPE_HAVE_CUDA
  return cuda_device_present();
#else
  return false;
#endif
}

std::uint64_t device_memory_bytes(const std::string& device) {
  const int index = cuda_index(device);
  if (index < 0) return 0;
#ifdef TROUPE_HAVE_CUDA
  if (!cuda_device_present()) return 0;
  return cuda_device_memory(index);
#else
  return 0;
#endif
}

void set_cpu_threads(int n) { cpu::set_threads(n); }

void set_gemm_tune_file(const std::string& path) {
#ifdef TROUPE_HAVE_CUDA
  cuda::set_gemm_tune_file(path);
#else
  if (!path.empty())
    throw core::failure("runtime.gemm_tune_file \"" + path +
                        "\": this build has no CUDA backend (hint: remove the key, or configure "
                        "with -DTROUPE_CUDA=ON on a machine with nvcc)");
#endif
}

}  // namespace troupe::kernels
