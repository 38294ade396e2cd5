// Normalisation micro-benchmark on one GPU: the backend's LayerNorm and RMSNorm, forward and the
// pre-norm block's backward (dx = residual + the norm's input gradient, weight gradients summed),
// at one shape (default GPT-2 124M's: 16384 rows of 768, bf16 activations, bf16 weights, fp32
// weight gradients). A program, not a test: one line per op and one JSON line.
//
// Timing: `reps` back-to-back calls queued on the stream, ended by a synchronisation, after warm-up
// calls; the time per call is the best of `rounds` such runs. GB/s counts the bytes an op must
// move: the forward reads x and writes y, the backward reads dy, x and the residual and writes dx
// (the per-row statistics and the weights are under 1 % of it). "layernorm backward + rsum" also
// sums the residual's columns (a projection's bias gradient, model/layer.cpp); "column sums" is
// that sum as a pass of its own (reads the residual). Also the gradient norm's exact
// sum (exact_sum_add) of `blocks` norm blocks (default: GPT-2 124M's, one per 1024 parameters),
// whose values span a few binades as a step's do.
//
// Usage: gpu_norm_bench [--rows 16384] [--cols 768] [--blocks 121559] [--reps 200] [--rounds 5]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "core/exact_sum.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "bench/gpu_timing.hpp"
#include "kernels/select.hpp"

using namespace troupe;
using core::dtype;
using core::tensor;

namespace {

struct options {
  std::int64_t rows = 16384, cols = 768, blocks = 121559;
  int reps = 200, rounds = 5;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: gpu_norm_bench [--rows 16384] [--cols 768] [--blocks 121559] "
                  "[--reps 200] [--rounds 5]\n");
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "gpu_norm_bench: %s needs a value\n", a.c_str());
      std::exit(2);
    }
    const long v = std::stol(argv[++i]);
    if (a == "--rows") o.rows = v;
    else if (a == "--cols") o.cols = v;
    else if (a == "--blocks") o.blocks = v;
    else if (a == "--reps") o.reps = static_cast<int>(v);
    else if (a == "--rounds") o.rounds = static_cast<int>(v);
    else {
      std::fprintf(stderr, "gpu_norm_bench: unknown option %s (options: --rows --cols --blocks "
                           "--reps --rounds)\n", a.c_str());
      std::exit(2);
    }
  }
  return o;
}

/// Device tensor of N(mean, scale²) values in dtype t.
tensor random_device(kernels::backend& be, const core::shape_t& shape, dtype t, std::uint64_t seed,
                     float mean, float scale) {
  tensor h = tensor::zeros(shape);
  core::rng_stream r(core::stream_key(seed, 5));
  for (std::int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = mean + scale * r.normal();
  tensor d = be.empty(shape, t);
  be.convert(be.from_host(h), d);
  return d;
}

/// Best per-call milliseconds of `f` (bench/gpu_timing.hpp).
template <class F>
double time_ms(kernels::backend& be, const options& o, F&& f) {
  return bench::best_ms_per_call(be, 5, o.rounds, o.reps, std::forward<F>(f));
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    auto be_owner = kernels::make_backend("cuda");
    kernels::backend& be = *be_owner;
    const std::int64_t N = o.rows, C = o.cols;
    tensor x = random_device(be, {N, C}, dtype::bf16, 1, 0.1f, 1.0f);
    tensor dy = random_device(be, {N, C}, dtype::bf16, 2, 0.0f, 1.0f);
    tensor res = random_device(be, {N, C}, dtype::bf16, 3, 0.0f, 1.0f);
    tensor w = random_device(be, {C}, dtype::bf16, 4, 1.0f, 0.1f);
    tensor b = random_device(be, {C}, dtype::bf16, 5, 0.0f, 0.1f);
    tensor y = be.empty({N, C}, dtype::bf16), dx = be.empty({N, C}, dtype::bf16);
    tensor mean = be.empty({N}, dtype::f32), rstd = be.empty({N}, dtype::f32);
    tensor dw = be.empty({C}, dtype::f32), db = be.empty({C}, dtype::f32);
    tensor rsum = be.empty({C}, dtype::f32), none;
    be.zero(dw);
    be.zero(db);
    be.zero(rsum);

    // Norm blocks' sums of squares: runs of 4096 within about 3 binades, runs apart by up to 2^20.
    tensor sums_host = tensor::zeros({o.blocks}, dtype::f64);
    {
      core::rng_stream r(core::stream_key(6, 5));
      double scale = 1e-6;
      for (std::int64_t i = 0; i < o.blocks; ++i) {
        if (i % 4096 == 0) scale = 1e-6 * std::ldexp(1.0, static_cast<int>(r.uniform() * 20) - 10);
        sums_host.data<double>()[i] = scale * (1.0 + 7.0 * r.uniform());
      }
    }
    tensor sums = be.from_host(sums_host);
    tensor acc = be.empty({core::exact_sum_words}, dtype::i64);
    be.zero(acc);
    const double row_bytes = static_cast<double>(N) * C * 2;
    struct result {
      const char* name;
      double ms, bytes;
    };
    be.layernorm_forward(x, w, b, 1e-5f, y, mean, rstd);
    const result rs[] = {
        {"layernorm forward",
         time_ms(be, o, [&] { be.layernorm_forward(x, w, b, 1e-5f, y, mean, rstd); }),
         2 * row_bytes},
        {"layernorm backward",
         time_ms(be, o,
                 [&] {
                   be.layernorm_backward_residual(dy, x, w, mean, rstd, res, dx, dw, db, none);
                 }),
         4 * row_bytes},
        {"layernorm backward + rsum",
         time_ms(be, o,
                 [&] {
                   be.layernorm_backward_residual(dy, x, w, mean, rstd, res, dx, dw, db, rsum);
                 }),
         4 * row_bytes},
        {"column sums", time_ms(be, o, [&] { be.sum_rows(res, rsum); }), row_bytes},
        {"rmsnorm forward", time_ms(be, o, [&] { be.rmsnorm_forward(x, w, 1e-5f, y, rstd); }),
         2 * row_bytes},
        {"rmsnorm backward",
         time_ms(be, o, [&] { be.rmsnorm_backward_residual(dy, x, w, rstd, res, dx, dw); }),
         4 * row_bytes},
        {"exact sum", time_ms(be, o, [&] { be.exact_sum_add(sums, acc); }),
         8.0 * static_cast<double>(o.blocks)},
    };
    std::printf("norms: %lld rows of %lld, bf16\n", static_cast<long long>(N),
                static_cast<long long>(C));
    std::string json = "{\"bench\":\"norm\",\"rows\":" + std::to_string(N) +
                       ",\"cols\":" + std::to_string(C);
    for (const result& r : rs) {
      std::printf("  %-26s %8.2f us  %7.0f GB/s\n", r.name, r.ms * 1e3, r.bytes / r.ms * 1e-6);
      std::string key = r.name;
      key.erase(std::remove(key.begin(), key.end(), '+'), key.end());
      key.erase(std::unique(key.begin(), key.end(),
                            [](char a, char b) { return a == ' ' && b == ' '; }),
                key.end());
      std::replace(key.begin(), key.end(), ' ', '_');
      char num[32];
      std::snprintf(num, sizeof num, "%.5f", r.ms);
      json += ",\"" + key + "_ms\":" + num;
    }
    std::printf("%s}\n", json.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_norm_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
