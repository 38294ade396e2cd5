// Times the CUDA backend's message hash (kernels/cuda/message_hash.cu), the call recording makes
// for every tensor a message carries, on device tensors from 4 MiB to a size of your choice, from
// the buffer's start (the 16-byte aligned path) and from 2 bytes in (a view: the unaligned path).
// Prints GB/s of the tensor's bytes per hash, from wall time over a batch of hashes queued on one
// stream, and a JSON line. A program, not a test (docs/design.md, rule 10): it asserts nothing.
//
//   gpu_message_hash_bench [--mib M] [--reps R] [--json FILE]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "kernels/select.hpp"

int main(int argc, char** argv) {
  std::size_t mib = 2048;
  int reps = 20;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc) {
      mib = std::strtoul(argv[++i], nullptr, 10);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gpu_message_hash_bench [--mib M] [--reps R] [--json FILE]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (mib < 4) mib = 4;
  if (reps < 1) reps = 1;
  using troupe::core::dtype;
  using troupe::core::tensor;
  auto be = troupe::kernels::make_backend("cuda");
  const auto elements = static_cast<std::int64_t>((mib << 20) / 2);
  // The bytes' values do not change the hash's work, so the buffer is left as allocated.
  const tensor buf = be->empty({elements}, dtype::u16);
  std::printf("%12s %16s %16s\n", "bytes", "aligned GB/s", "unaligned GB/s");
  std::string rows;
  for (std::size_t n = 4u << 20; n <= (mib << 20); n *= 4) {
    double rate[2] = {0, 0};
    for (int skip = 0; skip < 2; ++skip) {
      const tensor x = buf.slice(skip, {static_cast<std::int64_t>(n / 2) - skip});
      be->message_hash_async(x)->get();  // warm up
      std::vector<std::shared_ptr<troupe::kernels::pending_value>> pending;
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) pending.push_back(be->message_hash_async(x));
      for (auto& p : pending) p->get();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rate[skip] = static_cast<double>(x.bytes()) * reps / s / 1e9;
    }
    std::printf("%12zu %16.1f %16.1f\n", n, rate[0], rate[1]);
    char row[160];
    std::snprintf(row, sizeof row, "%s{\"bytes\":%zu,\"aligned_gbps\":%.1f,\"unaligned_gbps\":%.1f}",
                  rows.empty() ? "" : ",", n, rate[0], rate[1]);
    rows += row;
  }
  const std::string line = "{\"bench\":\"gpu_message_hash\",\"rows\":[" + rows + "]}";
  std::printf("%s\n", line.c_str());
  if (!json.empty()) std::ofstream(json) << line << "\n";
  return 0;
}
