#include "kernels/cuda/sm_partition.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/cuda_context.hpp"

namespace troupe::kernels::cuda {

namespace {

/// The driver's green-context functions (CUDA 12.4 on; streams in them from 12.5).
struct green_api {
  PFN_cuDeviceGetDevResource_v12040 get_resource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 split = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 describe = nullptr;
  PFN_cuGreenCtxCreate_v12040 create = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 stream = nullptr;
  std::string missing;  // the first function the driver lacks, "" when all are there
};

template <class F>
void find(const char* name, int version, F& fn, std::string& missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &found) ==
          cudaSuccess &&
      found == cudaDriverEntryPointSuccess) {
    fn = reinterpret_cast<F>(p);
    return;
  }
  (void)cudaGetLastError();
  if (missing.empty()) missing = name;
}

const green_api& api() {
  static const green_api a = [] {
    green_api g;
    find("cuDeviceGetDevResource", 12040, g.get_resource, g.missing);
    find("cuDevSmResourceSplitByCount", 12040, g.split, g.missing);
    find("cuDevResourceGenerateDesc", 12040, g.describe, g.missing);
    find("cuGreenCtxCreate", 12040, g.create, g.missing);
    find("cuGreenCtxStreamCreate", 12050, g.stream, g.missing);
    return g;
  }();
  return a;
}

std::string driver_error(CUresult r) {
  return "CUDA driver error " + std::to_string(static_cast<int>(r));
}

/// One share: its green context and its SM count.
struct share {
  CUgreenCtx green = nullptr;
  int sms = 0;
};

[[noreturn]] void refuse(int device, int count, const std::string& why) {
  throw core::failure("runtime.split_gpu: cannot split the SMs of cuda:" + std::to_string(device) +
                      " into " + std::to_string(count) + " shares: " + why +
                      " (hint: run fewer workers per GPU, or set runtime.split_gpu = false)");
}

/// Splits the GPU's SMs into `count` groups of the largest aligned size and makes each share's
/// green context.
std::vector<share> make_shares(int device, int count) {
  const green_api& g = api();
  if (!g.missing.empty())
    refuse(device, count, "the driver has no " + g.missing + " (green contexts need a driver of "
                          "CUDA 12.5 or later)");
  TROUPE_CUDA_CHECK(cudaSetDevice(device));
  TROUPE_CUDA_CHECK(cudaFree(nullptr));  // the primary context, which green contexts retain
  CUdevResource all{};
  if (CUresult r = g.get_resource(static_cast<CUdevice>(device), &all, CU_DEV_RESOURCE_TYPE_SM))
    refuse(device, count, "its SM resource could not be read (" + driver_error(r) + ")");
  const unsigned align = std::max(1u, all.sm.smCoscheduledAlignment);
  const unsigned least = std::max(all.sm.minSmPartitionSize, align);
  // The largest aligned group size that still gives `count` groups.
  for (unsigned size = all.sm.smCount / count / align * align; size >= least; size -= align) {
    unsigned groups = 0;
    if (g.split(nullptr, &groups, &all, nullptr, 0, size) != CUDA_SUCCESS ||
        groups < static_cast<unsigned>(count))
      continue;
    std::vector<CUdevResource> parts(count);
    groups = static_cast<unsigned>(count);
    if (CUresult r = g.split(parts.data(), &groups, &all, nullptr, 0, size))
      refuse(device, count, "the split failed (" + driver_error(r) + ")");
    std::vector<share> out;
    for (auto& part : parts) {
      CUdevResourceDesc desc = nullptr;
      if (CUresult r = g.describe(&desc, &part, 1))
        refuse(device, count, "a share's descriptor failed (" + driver_error(r) + ")");
      share s;
      if (CUresult r = g.create(&s.green, desc, static_cast<CUdevice>(device),
                                CU_GREEN_CTX_DEFAULT_STREAM))
        refuse(device, count, "a green context failed (" + driver_error(r) + ")");
      s.sms = static_cast<int>(part.sm.smCount);
      out.push_back(s);
    }
    return out;
  }
  refuse(device, count,
         std::to_string(all.sm.smCount) + " SMs give fewer than " + std::to_string(count) +
             " groups of at least " + std::to_string(least));
}

}  // namespace

void adopt_partition(context& ctx, int index, int count) {
  TROUPE_CHECK(count >= 1 && index >= 0 && index < count, "adopt_partition: share out of range");
  // Made once per (device, count) and kept for the process's life: a green context outliving its
  // last stream costs nothing, and destroying one at exit races the driver's own teardown.
  static std::mutex mu;
  static std::map<std::tuple<int, int>, std::vector<share>> made;
  share s;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = made.find({ctx.device, count});
    if (it == made.end())
      it = made.emplace(std::tuple{ctx.device, count}, make_shares(ctx.device, count)).first;
    s = it->second.at(index);
  }
  CUstream stream = nullptr;
  if (CUresult r = api().stream(&stream, s.green, CU_STREAM_NON_BLOCKING, 0))
    refuse(ctx.device, count, "a stream in share " + std::to_string(index) + " failed (" +
                                  driver_error(r) + ")");
  ctx.stream_owner = std::make_shared<stream_handle>(ctx.device, stream);
  ctx.stream = stream;
  ctx.alloc->set_stream(stream);
  ctx.sm_count = s.sms;
}

}  // namespace troupe::kernels::cuda
