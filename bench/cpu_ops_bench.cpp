// Times every CPU op at the tiny demo's shapes (GPT-2: 4 layers, C = 128, 4 heads, T = 64,
// 16 sequences = 1024 rows per micro-batch, vocabulary 50257; LLaMA ops at the same width), prints
// a table and an estimate of one micro-batch's forward + backward, and checks the determinism
// claims the backend rests on (OpenBLAS's own threads change bits; our blocked GEMM does not).
//
//   cpu_ops_bench [--threads N] [--reps R] [--json FILE]
//
// A program, not a test (docs/design.md, rule 10): it asserts nothing about time.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "kernels/backend.hpp"
#include "kernels/select.hpp"

namespace {

using troupe::core::dtype;
using troupe::core::tensor;
using troupe::kernels::backend;

constexpr int B = 16, T = 64, C = 128, H = 4, D = 32, V = 50257, L = 4, F = 4 * C;
constexpr int N = B * T;

tensor randn(const troupe::core::shape_t& shape, std::uint64_t seed, float scale = 1.0f) {
  tensor t = tensor::zeros(shape, dtype::f32);
  troupe::core::rng_stream r(troupe::core::stream_key(seed, 99));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = scale * r.normal();
  return t;
}

tensor tokens(std::int64_t n, std::int64_t vocab, std::uint64_t seed) {
  tensor t = tensor::zeros({n}, dtype::i32);
  troupe::core::rng_stream r(troupe::core::stream_key(seed, 98));
  for (std::int64_t i = 0; i < n; ++i)
    t.data<std::int32_t>()[i] = static_cast<std::int32_t>(r.below(vocab));
  return t;
}

struct row {
  std::string op, shape;
  double ms = 0;
  double work = 0;  // flops, or bytes when `bytes` is set
  bool bytes = false;
  int per_microbatch = 0;  // calls in one micro-batch of the GPT-2 demo (forward + backward)
};

// Median wall time of `reps` calls after one warm-up; `reset` (untimed) runs before each call.
double time_ms(int reps, const std::function<void()>& fn, const std::function<void()>& reset = {}) {
  std::vector<double> t;
  for (int i = 0; i <= reps; ++i) {
    if (reset) reset();
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    if (i) t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Whether OpenBLAS's own threading changes the bits of C = A·Bᵀ (+ C) at a model shape.
bool openblas_threads_change_bits(int m, int n, int k) {
  tensor a = randn({m, k}, 1), b = randn({n, k}, 2), c0 = randn({m, n}, 3);
  tensor c1 = c0.clone(), c2 = c0.clone();
  openblas_set_num_threads(1);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data<float>(), k,
              b.data<float>(), k, 1.0f, c1.data<float>(), n);
  openblas_set_num_threads(2);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data<float>(), k,
              b.data<float>(), k, 1.0f, c2.data<float>(), n);
  openblas_set_num_threads(1);
  return std::memcmp(c1.raw(), c2.raw(), c1.bytes()) != 0;
}

// Whether the backend's linear_forward gives different bits with 1 and 2 threads.
bool backend_threads_change_bits(backend& be, int m, int n, int k) {
  tensor x = randn({m, k}, 4), w = randn({n, k}, 5, 0.1f);
  tensor y1 = be.empty({m, n}, dtype::f32), y2 = be.empty({m, n}, dtype::f32);
  troupe::kernels::set_cpu_threads(1);
  be.linear_forward(x, w, tensor(), y1);
  troupe::kernels::set_cpu_threads(2);
  be.linear_forward(x, w, tensor(), y2);
  return std::memcmp(y1.raw(), y2.raw(), y1.bytes()) != 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, reps = 5;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc)
      threads = std::stoi(argv[++i]);
    else if (a == "--reps" && i + 1 < argc)
      reps = std::stoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc)
      json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: cpu_ops_bench [--threads N] [--reps R] [--json FILE]\n");
      return 2;
    }
  }
  auto be = troupe::kernels::make_backend("cpu");

  std::printf("determinism (C[m,n] += A[m,k]·B[n,k]ᵀ, 1 vs 2 threads):\n");
  const int shapes[][3] = {{N, V, C}, {256, 3 * C, C}, {N, 3 * C, C}, {N, F, C}};
  for (const auto& s : shapes) {
    const bool raw = openblas_threads_change_bits(s[0], s[1], s[2]);
    const bool ours = backend_threads_change_bits(*be, s[0], s[1], s[2]);
    std::printf("  [%d,%d]x[%d,%d]^T  OpenBLAS threads: %s   backend linear_forward: %s\n", s[0],
                s[2], s[1], s[2], raw ? "bits differ" : "same bits",
                ours ? "bits differ" : "same bits");
  }
  troupe::kernels::set_cpu_threads(threads);

  std::vector<row> rows;
  auto add = [&](std::string op, std::string shape, double ms, double work, bool bytes,
                 int per_mb) {
    rows.push_back({std::move(op), std::move(shape), ms, work, bytes, per_mb});
  };
  tensor none;

  // Linear layers: {name, in, out, calls per micro-batch}.
  struct lin {
    const char* name;
    int in, out, count;
  };
  for (const lin& l : {lin{"qkv", C, 3 * C, L}, lin{"attn proj", C, C, L}, lin{"fc", C, F, L},
                       lin{"fc proj", F, C, L}, lin{"lm head", C, V, 1}}) {
    tensor x = randn({N, l.in}, 10), w = randn({l.out, l.in}, 11, 0.02f), b = randn({l.out}, 12);
    tensor y = be->empty({N, l.out}, dtype::f32), dy = randn({N, l.out}, 13, 0.01f);
    tensor dx = be->empty({N, l.in}, dtype::f32), dw = be->empty({l.out, l.in}, dtype::f32);
    tensor db = be->empty({l.out}, dtype::f32);
    const bool bias = std::string(l.name) != "lm head";
    const double flops = 2.0 * N * l.in * l.out;
    char shape[64];
    std::snprintf(shape, sizeof shape, "[%d,%d]x[%d,%d]^T", N, l.in, l.out, l.in);
    add(std::string(l.name) + " forward", shape,
        time_ms(reps, [&] { be->linear_forward(x, w, bias ? b : none, y); }), flops, false,
        l.count);
    add(std::string(l.name) + " backward_input", shape,
        time_ms(reps, [&] { be->linear_backward_input(dy, w, dx); }), flops, false, l.count);
    add(std::string(l.name) + " backward_weight", shape,
        time_ms(reps, [&] { be->linear_backward_weight(dy, x, dw, bias ? db : none); }), flops,
        false, l.count);
  }

  {
    tensor tok = tokens(N, V, 20), wte = randn({V, C}, 21), wpe = randn({T, C}, 22);
    tensor out = be->empty({N, C}, dtype::f32), dwte = be->empty({V, C}, dtype::f32),
           dwpe = be->empty({T, C}, dtype::f32);
    const double bytes = 3.0 * N * C * 4;
    add("embedding forward", "[1024] -> [1024,128]",
        time_ms(reps, [&] { be->embedding_forward(tok, wte, wpe, T, out); }), bytes, true, 1);
    add("embedding backward", "[1024,128]",
        time_ms(reps, [&] { be->embedding_backward(out, tok, T, dwte, dwpe); }), bytes, true, 1);
  }
  {
    tensor x = randn({N, C}, 30), w = randn({C}, 31), b = randn({C}, 32),
           y = be->empty({N, C}, dtype::f32);
    tensor mean = be->empty({N}, dtype::f32), rstd = be->empty({N}, dtype::f32),
           dx = be->empty({N, C}, dtype::f32);
    tensor dw = be->empty({C}, dtype::f32), db = be->empty({C}, dtype::f32);
    const double bytes = 2.0 * N * C * 4;
    add("layernorm forward", "[1024,128]",
        time_ms(reps, [&] { be->layernorm_forward(x, w, b, 1e-5f, y, mean, rstd); }), bytes, true,
        2 * L + 1);
    add("layernorm backward", "[1024,128]",
        time_ms(reps, [&] { be->layernorm_backward(y, x, w, mean, rstd, dx, dw, db); }),
        1.5 * bytes, true, 2 * L + 1);
    add("rmsnorm forward", "[1024,128]",
        time_ms(reps, [&] { be->rmsnorm_forward(x, w, 1e-5f, y, rstd); }), bytes, true, 0);
    add("rmsnorm backward", "[1024,128]",
        time_ms(reps, [&] { be->rmsnorm_backward(y, x, w, rstd, dx, dw); }), 1.5 * bytes, true, 0);
    add("residual add", "[1024,128]", time_ms(reps, [&] { be->add(x, y, dx); }), 3.0 * N * C * 4,
        true, 2 * L);
    add("accumulate", "[1024,128]", time_ms(reps, [&] { be->accumulate(x, dx); }), 3.0 * N * C * 4,
        true, 2 * L);
  }
  {
    tensor x = randn({N, F}, 40), y = be->empty({N, F}, dtype::f32),
           dx = be->empty({N, F}, dtype::f32);
    tensor up = randn({N, F}, 41), du = be->empty({N, F}, dtype::f32);
    const double bytes = 2.0 * N * F * 4;
    add("gelu forward", "[1024,512]", time_ms(reps, [&] { be->gelu_forward(x, y); }), bytes, true,
        L);
    add("gelu backward", "[1024,512]", time_ms(reps, [&] { be->gelu_backward(y, x, dx); }),
        1.5 * bytes, true, L);
    add("swiglu forward", "[1024,512]", time_ms(reps, [&] { be->swiglu_forward(x, up, y); }),
        1.5 * bytes, true, 0);
    add("swiglu backward", "[1024,512]",
        time_ms(reps, [&] { be->swiglu_backward(y, x, up, dx, du); }), 3.0 * bytes, true, 0);
  }
  {
    tensor qkv = randn({N, 3 * C}, 50), y = be->empty({N, 3 * C}, dtype::f32),
           dx = be->empty({N, 3 * C}, dtype::f32);
    const double bytes = 2.0 * N * 3 * C * 4;
    add("rope forward (q,k)", "[1024,384] 8 of 12 heads",
        time_ms(reps, [&] { be->rope_forward(qkv, T, 3 * H, 2 * H, D, troupe::kernels::rope_spec{}, y); }), bytes, true,
        0);
    add("rope backward (q,k)", "[1024,384] 8 of 12 heads",
        time_ms(reps, [&] { be->rope_backward(y, T, 3 * H, 2 * H, D, troupe::kernels::rope_spec{}, dx); }), 1.5 * bytes,
        true, 0);
    const troupe::kernels::attention_dims d{B, T, H, H, D};
    tensor out = be->empty({N, C}, dtype::f32), lse = be->empty({B, H, T}, dtype::f32),
           dout = randn({N, C}, 51);
    const double flops = 4.0 * B * H * (T * (T + 1) / 2.0) * D;  // QKᵀ and PV, causal half
    add("attention forward", "B16 T64 H4 D32",
        time_ms(reps, [&] { be->attention_forward(qkv, d, out, lse); }), flops, false, L);
    add("attention backward", "B16 T64 H4 D32",
        time_ms(reps, [&] { be->attention_backward(dout, qkv, out, lse, d, dx); }), 2.5 * flops,
        false, L);
  }
  tensor logits = randn({N, V}, 60, 2.0f), targets = tokens(N, V, 61),
         losses = be->empty({N}, dtype::f32);
  {
    tensor work = logits.clone();
    add("cross_entropy (+grad)", "[1024,50257]",
        time_ms(
            reps, [&] { be->cross_entropy(work, targets, losses, 1.0f / N); },
            [&] { std::memcpy(work.raw(), logits.raw(), logits.bytes()); }),
        2.0 * N * V * 4, true, 1);
  }
  // Per optimizer step (not per micro-batch): the tiny model's ~7.2 M parameters in one buffer.
  const std::int64_t params =
      static_cast<std::int64_t>(V) * C + T * C + L * (12LL * C * C + 13LL * C) + 2 * C;
  {
    tensor p = randn({params}, 70, 0.02f), g = randn({params}, 71, 1e-3f),
           m = be->empty({params}, dtype::f32);
    const std::int64_t nblocks =
        (params + troupe::kernels::norm_block - 1) / troupe::kernels::norm_block;
    tensor v = be->empty({params}, dtype::f32), blocks = be->empty({nblocks}, dtype::f64);
    troupe::kernels::adamw_params hp;
    hp.lr = 1e-3f;
    hp.weight_decay = 0.1f;
    char shape[32];
    std::snprintf(shape, sizeof shape, "[%lld]", static_cast<long long>(params));
    add("adamw (per step)", shape, time_ms(reps, [&] { be->adamw(p, g, m, v, hp, none); }),
        7.0 * params * 4, true, 0);
    add("sumsq_blocks (per step)", shape, time_ms(reps, [&] { be->sumsq_blocks(g, blocks); }),
        1.0 * params * 4, true, 0);
  }
  // The head and loss over 8 row chunks of 128: the chunk's logits (26 MB) stay in the L3 cache
  // between the forward GEMM, the loss and the two backward GEMMs.
  double head_whole = 0, head_chunked = 0;
  {
    tensor x = randn({N, C}, 80), w = randn({V, C}, 81, 0.02f), dx = be->empty({N, C}, dtype::f32);
    tensor dw = be->empty({V, C}, dtype::f32), full = be->empty({N, V}, dtype::f32);
    head_whole = time_ms(reps, [&] {
      be->linear_forward(x, w, none, full);
      be->cross_entropy(full, targets, losses, 1.0f / N);
      be->linear_backward_input(full, w, dx);
      be->linear_backward_weight(full, x, dw, none);
    });
    const int chunk = 128;
    tensor part = be->empty({chunk, V}, dtype::f32);
    head_chunked = time_ms(reps, [&] {
      for (int r = 0; r < N; r += chunk) {
        tensor xr = x.rows(r, r + chunk), dxr = dx.rows(r, r + chunk);
        tensor tr = targets.rows(r, r + chunk), lr = losses.rows(r, r + chunk);
        be->linear_forward(xr, w, none, part);
        be->cross_entropy(part, tr, lr, 1.0f / N);
        be->linear_backward_input(part, w, dxr);
        be->linear_backward_weight(part, xr, dw, none);
      }
    });
  }

  // For comparison only: the head's forward GEMM in one call with OpenBLAS's own threads, which
  // the backend does not use because its bits depend on the thread count.
  double native_ms = 0;
  {
    tensor x = randn({N, C}, 90), w = randn({V, C}, 91, 0.02f), y = be->empty({N, V}, dtype::f32);
    openblas_set_num_threads(threads);
    native_ms = time_ms(reps, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, C, 1.0f, x.data<float>(), C,
                  w.data<float>(), C, 0.0f, y.data<float>(), V);
    });
    openblas_set_num_threads(1);
  }

  std::printf("\nCPU ops, %d thread(s), median of %d (ms)\n", threads, reps);
  std::printf("%-28s %-28s %10s %12s %6s\n", "op", "shape", "ms", "rate", "x/mb");
  double mb_ms = 0;
  for (const row& r : rows) {
    const double rate = r.work / (r.ms * 1e-3) / 1e9;
    std::printf("%-28s %-28s %10.3f %8.2f %s %6d\n", r.op.c_str(), r.shape.c_str(), r.ms, rate,
                r.bytes ? "GB/s" : "GF/s", r.per_microbatch);
    mb_ms += r.ms * r.per_microbatch;
  }
  std::printf(
      "\nGPT-2 tiny, one micro-batch (1024 tokens) forward + backward, sum of the ops: %.1f ms"
      " = %.0f tokens/s\n",
      mb_ms, N / (mb_ms * 1e-3));
  std::printf(
      "lm head + cross_entropy + both backward GEMMs: whole %.1f ms, in 8 row chunks %.1f ms\n",
      head_whole, head_chunked);
  std::printf(
      "lm head forward as one sgemm on %d OpenBLAS threads (not used: bits vary): %.1f ms\n",
      threads, native_ms);

  if (!json_path.empty()) {
    std::ofstream js(json_path);
    js << "{\"threads\": " << threads << ", \"reps\": " << reps << ", \"ops\": [";
    for (std::size_t i = 0; i < rows.size(); ++i)
      js << (i ? ", " : "") << "{\"op\": \"" << rows[i].op << "\", \"shape\": \"" << rows[i].shape
         << "\", \"ms\": " << rows[i].ms << ", \"per_microbatch\": " << rows[i].per_microbatch
         << "}";
    js << "], \"microbatch_ms\": " << mb_ms << ", \"head_whole_ms\": " << head_whole
       << ", \"head_chunked_ms\": " << head_chunked
       << ", \"head_forward_openblas_threads_ms\": " << native_ms << "}\n";
  }
  return 0;
}
