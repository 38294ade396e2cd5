// Times the message hash's CPU twin (kernels/message_hash.hpp) on one core under both definitions
// (XXH3 leaves, which recording writes now; XXH64 leaves, the logs of format 2) at tensor sizes
// from one block to beyond the caches, and prints GB/s of the thread's CPU time (so a loaded
// machine slows the wall clock, not the figure) with a JSON line.
//
//   message_hash_bench [--mib M] [--seconds S] [--json FILE]
//
// M (default 64) is the largest size in MiB; S (default 0.5) the CPU time per measurement.
// recording's cost on the CPU is the bytes it hashes per step divided by the large-size figure
// (docs/PERFORMANCE.md). A program, not a test (docs/design.md, rule 10): it asserts nothing.
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "kernels/message_hash.hpp"

namespace {

using troupe::kernels::message_hash_def;

volatile std::uint64_t keep = 0;

double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// GB/s of hashing `n` bytes of `data` again and again for at least `seconds` of CPU time (in
/// rounds of about 16 MiB, so that reading the clock costs nothing that counts).
double rate(const unsigned char* data, std::size_t n, message_hash_def def, double seconds,
            std::uint64_t& sink) {
  const long per_round = std::max<long>(1, static_cast<long>((16u << 20) / std::max<std::size_t>(n, 1)));
  long reps = 0;
  const double t0 = thread_seconds();
  double t = t0;
  while (t - t0 < seconds) {
    for (long i = 0; i < per_round; ++i) sink ^= troupe::kernels::message_hash(data, n, def);
    reps += per_round;
    t = thread_seconds();
  }
  return static_cast<double>(n) * static_cast<double>(reps) / (t - t0) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mib = 64;
  double seconds = 0.5;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc) {
      mib = std::strtoul(argv[++i], nullptr, 10);
    } else if (a == "--seconds" && i + 1 < argc) {
      seconds = std::strtod(argv[++i], nullptr);
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: message_hash_bench [--mib M] [--seconds S] [--json FILE]\n");
      return 2;
    }
  }
  if (mib < 1) mib = 1;
  std::vector<unsigned char> data(mib << 20);
  troupe::core::rng_stream r(troupe::core::stream_key(5, 0x4a5));
  for (std::size_t i = 0; i + 8 <= data.size(); i += 8) {
    const std::uint64_t v = r.next_u64();
    std::memcpy(data.data() + i, &v, 8);
  }
  std::vector<std::size_t> sizes = {4096, 64 << 10, 1 << 20, 8 << 20};
  if ((mib << 20) > sizes.back()) sizes.push_back(mib << 20);
  std::uint64_t sink = 0;
  std::printf("%12s %14s %14s %8s\n", "bytes", "xxh3 GB/s", "xxh64 GB/s", "ratio");
  std::string rows;
  for (std::size_t n : sizes) {
    if (n > data.size()) continue;
    const double a = rate(data.data(), n, message_hash_def::xxh3, seconds, sink);
    const double b = rate(data.data(), n, message_hash_def::xxh64, seconds, sink);
    std::printf("%12zu %14.2f %14.2f %8.2f\n", n, a, b, a / b);
    char row[160];
    std::snprintf(row, sizeof row, "%s{\"bytes\":%zu,\"xxh3_gbps\":%.3f,\"xxh64_gbps\":%.3f}",
                  rows.empty() ? "" : ",", n, a, b);
    rows += row;
  }
  const std::string line = "{\"bench\":\"message_hash\",\"rows\":[" + rows + "]}";
  std::printf("%s\n", line.c_str());
  if (!json.empty()) std::ofstream(json) << line << "\n";
  keep = sink;  // the hashes are used, so they are computed
  return 0;
}
