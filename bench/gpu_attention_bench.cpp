// Attention micro-benchmark on one GPU: the backend's causal attention forward and backward at one
// shape (default GPT-2 124M: B=16, T=1024, H=Hkv=12, D=64, bf16), each timed on its own. A program,
// not a test: it prints one line per op and one JSON line.
//
// Timing: `reps` back-to-back calls queued on the stream, ended by a synchronisation, after warm-up
// calls; the reported time per call is the best of `rounds` such runs (launch gaps are hidden by the
// queue, so this is the kernels' time). TFLOP/s counts the causal half of the score matrix: forward
// 2 matmuls, backward 5 (the FLOPs an exact flash backward needs, not what these kernels spend).
//
// Usage: gpu_attention_bench [--batch 16] [--seq 1024] [--heads 12] [--kv-heads 12] [--dim 64]
//                            [--reps 50] [--rounds 5]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

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
  int batch = 16, seq = 1024, heads = 12, kv_heads = 12, dim = 64, reps = 50, rounds = 5;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "gpu_attention_bench: %s needs a value\n", a.c_str());
      std::exit(2);
    }
    const int v = std::stoi(argv[++i]);
    if (a == "--batch") o.batch = v;
    else if (a == "--seq") o.seq = v;
    else if (a == "--heads") o.heads = v;
    else if (a == "--kv-heads") o.kv_heads = v;
    else if (a == "--dim") o.dim = v;
    else if (a == "--reps") o.reps = v;
    else if (a == "--rounds") o.rounds = v;
    else {
      std::fprintf(stderr,
                   "gpu_attention_bench: unknown option %s (options: --batch --seq --heads "
                   "--kv-heads --dim --reps --rounds)\n",
                   a.c_str());
      std::exit(2);
    }
  }
  return o;
}

/// Device bf16 tensor of N(0, scale²) values.
tensor random_device(kernels::backend& be, const core::shape_t& shape, std::uint64_t seed,
                     float scale) {
  tensor h = tensor::zeros(shape, dtype::bf16);
  core::rng_stream r(core::stream_key(seed, 3));
  auto* p = h.data<std::uint16_t>();
  for (std::int64_t i = 0; i < h.numel(); ++i) p[i] = core::f32_to_bf16(scale * r.normal());
  return be.from_host(h);
}

/// Best per-call milliseconds of `f` (bench/gpu_timing.hpp).
template <class F>
double time_ms(kernels::backend& be, const options& o, F&& f) {
  return bench::best_ms_per_call(be, 3, o.rounds, o.reps, std::forward<F>(f));
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    auto be_owner = kernels::make_backend("cuda");
    kernels::backend& be = *be_owner;
    const kernels::attention_dims d{o.batch, o.seq, o.heads, o.kv_heads, o.dim};
    const std::int64_t rows = static_cast<std::int64_t>(o.batch) * o.seq;
    const std::int64_t width = static_cast<std::int64_t>(o.heads + 2 * o.kv_heads) * o.dim;
    tensor qkv = random_device(be, {rows, width}, 1, 1.0f);
    tensor dout = random_device(be, {rows, static_cast<std::int64_t>(o.heads) * o.dim}, 2, 1.0f);
    tensor out = be.empty({rows, static_cast<std::int64_t>(o.heads) * o.dim}, dtype::bf16);
    tensor lse = be.empty({o.batch, o.heads, o.seq}, dtype::f32);
    tensor dqkv = be.empty({rows, width}, dtype::bf16);
    be.zero(dqkv);

    const double fwd = time_ms(be, o, [&] { be.attention_forward(qkv, d, out, lse); });
    // The model's backward writes dqkv (attention_backward_write); the accumulating form adds to
    // what dqkv holds (the backend's += contract), so dqkv's values grow across calls, which does
    // not affect timing.
    tensor none, dsum = be.empty({width}, dtype::f32);
    const double bwd =
        time_ms(be, o, [&] { be.attention_backward_write(dout, qkv, out, lse, d, dqkv, none); });
    // With the qkv bias gradient (GPT-2's c_attn.bias) summed from the written dqkv.
    const double bwd_sum =
        time_ms(be, o, [&] { be.attention_backward_write(dout, qkv, out, lse, d, dqkv, dsum); });
    const double bwd_acc =
        time_ms(be, o, [&] { be.attention_backward(dout, qkv, out, lse, d, dqkv); });
    // Causal: half of T² scores, 2·D FLOPs per score and matmul.
    const double flop_mm = static_cast<double>(o.batch) * o.heads * o.seq * o.seq / 2.0 * 2.0 * o.dim;
    std::printf("attention B=%d T=%d H=%d Hkv=%d D=%d bf16\n", o.batch, o.seq, o.heads, o.kv_heads,
                o.dim);
    std::printf("  forward  %8.4f ms  %6.1f TFLOP/s\n", fwd, 2 * flop_mm / fwd * 1e-9);
    std::printf("  backward %8.4f ms  %6.1f TFLOP/s  (%.2fx forward; writes dqkv)\n", bwd,
                5 * flop_mm / bwd * 1e-9, bwd / fwd);
    std::printf("  backward %8.4f ms  %6.1f TFLOP/s  (writes dqkv and its column sums)\n",
                bwd_sum, 5 * flop_mm / bwd_sum * 1e-9);
    std::printf("  backward %8.4f ms  %6.1f TFLOP/s  (adds into dqkv)\n", bwd_acc,
                5 * flop_mm / bwd_acc * 1e-9);
    std::printf("{\"bench\":\"attention\",\"B\":%d,\"T\":%d,\"H\":%d,\"Hkv\":%d,\"D\":%d,"
                "\"forward_ms\":%.5f,\"backward_ms\":%.5f,\"backward_sum_ms\":%.5f,"
                "\"backward_accumulate_ms\":%.5f}\n",
                o.batch, o.seq, o.heads, o.kv_heads, o.dim, fwd, bwd, bwd_sum, bwd_acc);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_attention_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
