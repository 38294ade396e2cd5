// GPT-2 training-step benchmark on one GPU: the whole model as one model::chunk on the CUDA backend
// in bf16 (fp32 master weights, gradients and AdamW moments), random tokens, the same shapes and
// FLOP count as the PyTorch peer baseline (shared/bench/torch_gpt2.py), so the two print comparable
// numbers. A program, not a test: it prints a table row and one JSON line.
//
// One step = zero grads, forward + fused cross-entropy, backward, tied-gradient sum, global-norm
// clip (one sumsq_blocks over the flat gradient buffer; the tied copy's blocks left out), AdamW
// over runs of parameters that share a weight-decay flag, and the refresh of the bf16 weights.
// Timing: wall clock around each step, ended by a stream synchronisation; the median of the timed
// steps is reported, after warm-up steps that also fill the allocator's cache.
//
// Usage: gpu_gpt2_bench [--layers 12] [--embd 768] [--heads 12] [--seq 1024] [--batch 16]
//                       [--vocab 50304] [--steps 10] [--warmup 3] [--fp32] [--tag NAME]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/rng.hpp"
#include "kernels/backend.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "model/chunk.hpp"
#include "model/optimizer.hpp"

using namespace troupe;
using core::tensor;

namespace {

struct options {
  int layers = 12, embd = 768, heads = 12, seq = 1024, batch = 16, vocab = 50304;
  int steps = 10, warmup = 3;
  bool fp32 = false;
  std::string tag;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gpu_gpt2_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--layers") o.layers = std::stoi(next());
    else if (a == "--embd") o.embd = std::stoi(next());
    else if (a == "--heads") o.heads = std::stoi(next());
    else if (a == "--seq") o.seq = std::stoi(next());
    else if (a == "--batch") o.batch = std::stoi(next());
    else if (a == "--vocab") o.vocab = std::stoi(next());
    else if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--fp32") o.fp32 = true;
    else if (a == "--tag") o.tag = next();
    else {
      std::fprintf(stderr,
                   "gpu_gpt2_bench: unknown option %s (options: --layers --embd --heads --seq "
                   "--batch --vocab --steps --warmup --fp32 --tag)\n",
                   a.c_str());
      std::exit(2);
    }
  }
  return o;
}

/// Contiguous ranges of the flat buffers whose parameters share a weight-decay flag.
struct decay_run {
  std::int64_t begin = 0, end = 0;
  bool decay = true;
};

std::vector<decay_run> decay_runs(std::vector<model::param_info> ps) {
  std::sort(ps.begin(), ps.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::vector<decay_run> runs;
  for (const auto& p : ps) {
    if (!runs.empty() && runs.back().decay == p.decay)
      runs.back().end = p.offset + p.numel;
    else
      runs.push_back({p.offset, p.offset + p.numel, p.decay});
  }
  return runs;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    auto be_owner = kernels::make_backend("cuda");
    kernels::backend& be = *be_owner;
    auto* cuda_be = dynamic_cast<kernels::cuda::cuda_backend*>(&be);

    core::model_config cfg;
    cfg.arch = core::arch_kind::gpt2;
    cfg.num_layers = o.layers;
    cfg.hidden_size = o.embd;
    cfg.num_heads = o.heads;
    cfg.seq_length = o.seq;
    cfg.vocab_size = o.vocab;
    cfg.tie_embeddings = true;
    const auto precision = o.fp32 ? core::precision_kind::fp32 : core::precision_kind::bf16;
    model::chunk c(cfg, model::partition(cfg, 1).at(0), be, precision);
    c.init(1234);
    c.params_updated();
    model::optimizer_state state = model::make_optimizer_state(be, c);
    core::optimizer_config opt;
    opt.lr = 6e-4;
    opt.weight_decay = 0.1;

    const std::int64_t rows = static_cast<std::int64_t>(o.batch) * o.seq;
    tensor tokens = tensor::zeros({rows}, core::dtype::i32);
    tensor targets = tensor::zeros({rows}, core::dtype::i32);
    core::rng_stream r(core::stream_key(42, 0));
    for (std::int64_t i = 0; i < rows; ++i) {
      tokens.data<std::int32_t>()[i] = static_cast<std::int32_t>(r.below(o.vocab));
      targets.data<std::int32_t>()[i] = static_cast<std::int32_t>(r.below(o.vocab));
    }

    const std::vector<decay_run> runs = decay_runs(c.params());
    const model::param_info* tied = nullptr;
    for (const auto& p : c.params())
      if (p.tied) tied = &p;
    tensor& flat_p = c.flat_params();
    tensor& flat_g = c.flat_grads();
    const std::int64_t n = flat_g.numel();
    tensor blocks = be.empty({(n + kernels::norm_block - 1) / kernels::norm_block}, core::dtype::f64);

    double last_loss = 0, last_norm = 0;
    auto step = [&](int index) {
      c.zero_grads();
      c.forward(0, tokens, targets, 1.0f / static_cast<float>(rows));
      c.backward(0, tensor{});
      last_loss = c.loss_sum(0) / static_cast<double>(rows);
      if (tied) {
        tensor g_head = c.grad(tied->name);
        for (const auto& p : c.params())
          if (!p.tied && p.shape == tied->shape && p.name.find("wte") != std::string::npos) {
            tensor g_wte = c.grad(p.name);
            model::tie_gradients(be, g_wte, g_head);
          }
      }
      be.sumsq_blocks(flat_g, blocks);
      const tensor host = be.to_host(blocks);
      double total = 0;
      for (std::int64_t b = 0; b < host.numel(); ++b) {
        const std::int64_t first = b * kernels::norm_block;
        if (tied && first >= tied->offset && first < tied->offset + tied->numel) continue;
        total += host.data<double>()[b];
      }
      last_norm = std::sqrt(total);
      const float clip = model::clip_scale(last_norm, 1.0);
      kernels::adamw_params ap;
      ap.lr = static_cast<float>(opt.lr);
      ap.beta1 = static_cast<float>(opt.beta1);
      ap.beta2 = static_cast<float>(opt.beta2);
      ap.eps = static_cast<float>(opt.eps);
      ap.grad_scale = clip;
      ap.step = index + 1;
      tensor none;
      for (const decay_run& run : runs) {
        ap.weight_decay = run.decay ? static_cast<float>(opt.weight_decay) : 0.0f;
        const std::int64_t len = run.end - run.begin;
        tensor p = flat_p.slice(run.begin, {len}), g = flat_g.slice(run.begin, {len});
        tensor m = state.exp_avg.slice(run.begin, {len}), v = state.exp_avg_sq.slice(run.begin, {len});
        be.adamw(p, g, m, v, ap, none);
      }
      c.params_updated();
      be.synchronize();
    };

    for (int i = 0; i < o.warmup; ++i) step(i);
    if (cuda_be) cuda_be->reset_peak_memory();
    const auto mallocs_before = cuda_be ? cuda_be->memory().device_mallocs : 0;
    std::vector<double> times;
    for (int i = 0; i < o.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      step(o.warmup + i);
      const auto t1 = std::chrono::steady_clock::now();
      times.push_back(std::chrono::duration<double>(t1 - t0).count());
      std::printf("step %d: %.2f ms loss %.4f grad norm %.3f\n", i, times.back() * 1e3, last_loss,
                  last_norm);
    }
    std::sort(times.begin(), times.end());
    const double med = times[times.size() / 2];
    const std::int64_t params = core::parameter_count(cfg);
    const double flops_tok = 6.0 * params + 12.0 * o.layers * o.embd * o.seq;
    const double tok_s = rows / med;
    const double tflops = flops_tok * rows / med / 1e12;
    kernels::cuda::memory_stats ms;
    if (cuda_be) ms = cuda_be->memory();
    const double gib = 1024.0 * 1024.0 * 1024.0;
    std::printf(
        "%-10s params %lld  B %d T %d L %d C %d  step %.2f ms  %.0f tok/s  %.1f TFLOP/s  peak %.2f "
        "GiB in use, %.2f GiB reserved  cudaMalloc in timed steps: %llu\n",
        o.tag.c_str(), static_cast<long long>(params), o.batch, o.seq, o.layers, o.embd, med * 1e3,
        tok_s, tflops, ms.peak_in_use / gib, ms.peak_reserved / gib,
        static_cast<unsigned long long>(ms.device_mallocs - mallocs_before));
    std::printf(
        "{\"tag\": \"%s\", \"engine\": \"troupe\", \"precision\": \"%s\", \"params\": %lld, \"B\": %d, "
        "\"T\": %d, \"L\": %d, \"C\": %d, \"step_ms\": %.2f, \"tok_s\": %.0f, \"tflops\": %.1f, "
        "\"peak_gib\": %.2f, \"reserved_gib\": %.2f, \"timed_mallocs\": %llu, \"loss\": %.4f}\n",
        o.tag.c_str(), o.fp32 ? "fp32" : "bf16", static_cast<long long>(params), o.batch, o.seq,
        o.layers, o.embd, med * 1e3, tok_s, tflops, ms.peak_in_use / gib, ms.peak_reserved / gib,
        static_cast<unsigned long long>(ms.device_mallocs - mallocs_before), last_loss);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_gpt2_bench: %s\n", e.what());
    return 1;
  }
}
