// Times the CUDA backend's message hash (kernels/cuda/message_hash.cu), the call recording makes
// for every tensor a message carries, on device tensors from 4 MiB to a size of your choice, from
// the buffer's start (the 16-byte aligned path) and from 2 bytes in (a view: the unaligned path).
// Prints GB/s of the tensor's bytes per hash, from wall time over a batch of hashes queued on one
// stream, and a JSON line. With --adamw P, instead the optimizer shard's update of P million fp32
// parameters laid out as a LLaMA-3-style chunk lays them out (tensors at multiples of 1024
// elements, runs of decay and no decay): AdamW alone (adamw_runs), AdamW then the message hash of
// the parameters it wrote (recording's cost before adamw_runs_hashed), and adamw_runs_hashed with
// the hash finished from its blocks (what the shard runs with recording on); milliseconds per
// update, the median of R rounds that time the three in turn. A program, not a test
// (docs/design.md, rule 10): it asserts nothing.
//
//   gpu_message_hash_bench [--mib M] [--reps R] [--json FILE]
//   gpu_message_hash_bench --adamw P [--reps R] [--json FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "kernels/message_hash.hpp"
#include "kernels/select.hpp"

namespace {

using troupe::core::dtype;
using troupe::core::tensor;

/// AdamW over `millions` million parameters three ways (see the header); prints and returns the
/// JSON line.
std::string adamw_bench(troupe::kernels::backend& be, double millions, int reps) {
  const auto n = static_cast<std::int64_t>(millions * 1e6) / 1024 * 1024;
  // One LLaMA-3-style layer's tensors (hidden 2048, 8 of 32 heads for keys and values, SwiGLU
  // 8192), repeated: the norms do not decay, the matrices do.
  const std::int64_t layer[] = {2048, 2048 * 2048, 512 * 2048, 512 * 2048, 2048 * 2048, 2048,
                                8192 * 2048, 8192 * 2048, 2048 * 8192};
  std::vector<troupe::kernels::adamw_run> runs;
  for (std::int64_t at = 0, k = 0; at < n; ++k) {
    const std::int64_t len = std::min(layer[k % 9], n - at);
    runs.push_back({at, at + len, len != 2048});
    at += (len + 1023) / 1024 * 1024;
  }
  tensor p = be.empty({n}, dtype::f32), g = be.empty({n}, dtype::f32);
  tensor m = be.empty({n}, dtype::f32), v = be.empty({n}, dtype::f32);
  tensor low = be.empty({n}, dtype::bf16);
  for (tensor* t : {&p, &g, &m, &v}) be.zero(*t);
  tensor blocks = be.empty({static_cast<std::int64_t>(troupe::kernels::message_hash_blocks_of(p.bytes()))},
                           dtype::i64);
  troupe::kernels::adamw_params ap;
  ap.lr = 1e-4f;
  ap.weight_decay = 0.1f;
  ap.step = 3;
  auto time = [&](auto&& update) {
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    update();
    be.synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  auto alone_f = [&] { be.adamw_runs(p, g, m, v, runs, ap, low); };
  auto then_hash_f = [&] {
    be.adamw_runs(p, g, m, v, runs, ap, low);
    be.message_hash_async(p)->get();
  };
  auto hashed_f = [&] {
    be.adamw_runs_hashed(p, g, m, v, runs, ap, low, blocks);
    be.message_hash_of_blocks_async(blocks, p.bytes())->get();
  };
  // Each form once before any is timed (the first touches of the buffers, the clocks' ramp),
  // then the three forms in turn, R times; each form's median.
  alone_f();
  then_hash_f();
  hashed_f();
  std::vector<double> a, b, c;
  for (int r = 0; r < reps; ++r) {
    a.push_back(time(alone_f));
    b.push_back(time(then_hash_f));
    c.push_back(time(hashed_f));
  }
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  const double alone = median(a), then_hash = median(b), hashed = median(c);
  std::printf("%lld parameters, %zu runs\n", static_cast<long long>(n), runs.size());
  std::printf("%-40s %9.3f ms\n", "adamw_runs", alone);
  std::printf("%-40s %9.3f ms\n", "adamw_runs, then message_hash_async", then_hash);
  std::printf("%-40s %9.3f ms\n", "adamw_runs_hashed, hash of its blocks", hashed);
  char line[256];
  std::snprintf(line, sizeof line,
                "{\"bench\":\"gpu_adamw_hash\",\"params\":%lld,\"runs\":%zu,\"adamw_ms\":%.3f,"
                "\"adamw_then_hash_ms\":%.3f,\"adamw_hashed_ms\":%.3f}",
                static_cast<long long>(n), runs.size(), alone, then_hash, hashed);
  std::printf("%s\n", line);
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mib = 2048;
  int reps = 20;
  double adamw = 0;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc) {
      mib = std::strtoul(argv[++i], nullptr, 10);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (a == "--adamw" && i + 1 < argc) {
      adamw = std::strtod(argv[++i], nullptr);
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gpu_message_hash_bench [--mib M] [--reps R] [--json FILE]\n"
                           "       gpu_message_hash_bench --adamw MILLION_PARAMS [--reps R] [--json FILE]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (mib < 4) mib = 4;
  if (reps < 1) reps = 1;
  auto be = troupe::kernels::make_backend("cuda");
  if (adamw > 0) {
    const std::string line = adamw_bench(*be, adamw, reps);
    if (!json.empty()) std::ofstream(json) << line << "\n";
    return 0;
  }
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
