// GPT-2 training-step benchmark on one GPU: the whole model as one model::chunk on the CUDA backend
// in bf16 (fp32 master weights, gradients and AdamW moments), random tokens, the same shapes and
// FLOP count as the PyTorch baseline (bench/torch_gpt2.py), so the two print comparable
// numbers. A program, not a test: it prints a table row and one JSON line.
//
// One step = zero grads, forward + fused cross-entropy, backward, tied-gradient sum, then the
// global-norm clip and AdamW as the trainer runs them without loss scaling
// (model::clip_and_update_on_device: the sumsq blocks of every parameter but the tied copy, their
// exact sum and the clip factor on the device, one adamw_runs call over the flat buffers reading
// the factor there and writing the bf16 weights), and last the loss and norm read. As in the
// trainer (runtime.cuda_graph), the second step is recorded as a CUDA graph and every later step
// replays it; --no-graph launches every op from the host.
// Timing: wall clock around each step, ended by a stream synchronisation; the median of the timed
// steps is reported, after warm-up steps that also fill the allocator's cache.
//
// Usage: gpu_gpt2_bench [--layers 12] [--embd 768] [--heads 12] [--seq 1024] [--batch 16]
//                       [--vocab 50304] [--arch gpt2|llama] [--kv-heads N] [--ffn N]
//                       [--rope-theta X] [--steps 10] [--warmup 3] [--fp32] [--profile]
//                       [--phases] [--gemm-tune FILE] [--gemm-log] [--no-gelu-epilogue]
//                       [--no-clip] [--no-graph] [--keep-gelu N] [--tag NAME]
// --arch llama trains the LLaMA architecture instead (RMSNorm, RoPE with base --rope-theta,
// grouped-query attention with --kv-heads key/value heads, SwiGLU of width --ffn, untied head),
// as `troupe train --single-rank` does for such a config (bench/configs/llama3_1b_1gpu.toml).
// --no-clip does the work of the PyTorch baseline, which does not clip (torch_gpt2.py: forward,
// backward, fused AdamW): no global norm. The default step is the one troupe trains with (the clip
// at 1.0).
// --profile adds one step run through a backend wrapper that times each op (synchronising after
// every op) and prints the per-op breakdown (both that step and the --phases one launch their ops
// from the host, not from the graph). --phases adds one step with CUDA events between its
// phases (forward, backward, tie, norm + clip + AdamW, the reads) and prints, per phase, the host's time to
// queue it next to the GPU's time from its start event to its end event: a phase whose GPU time
// exceeds its kernels' sum is waiting for the host. --gemm-tune FILE is runtime.gemm_tune_file:
// each GEMM's algorithm is the fastest of cuBLASLt's top candidates, measured during the warm-up
// steps (or read from FILE when an earlier run measured it; kernels/cuda/gemm_tuning.hpp).
// --gemm-log prints every GEMM plan as it is made (shape, dtypes, alignments, the algorithm's
// configuration). --no-gelu-epilogue runs the MLP's GELU as separate kernels instead of on the GEMM
// epilogue, to measure one against the other (kernels/cuda/linear.cu). --keep-gelu N is
// recompute.keep_gelu: the last N layers keep their GELU output instead of recomputing it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "core/config.hpp"
#include "core/rng.hpp"
#include "kernels/backend.hpp"
#include "kernels/select.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "model/chunk.hpp"
#include "model/optimizer.hpp"

using namespace troupe;
using core::tensor;

namespace {

struct options {
  int layers = 12, embd = 768, heads = 12, seq = 1024, batch = 16, vocab = 50304;
  bool llama = false;
  int kv_heads = 0, ffn = 0;
  double rope_theta = 10000.0;
  int steps = 10, warmup = 3;
  bool fp32 = false;
  bool profile = false;
  bool phases = false;
  bool no_clip = false;
  bool no_graph = false;
  bool gemm_log = false;
  bool no_gelu_epilogue = false;
  int keep_gelu = 0;
  std::string tag, gemm_tune;
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
    else if (a == "--arch") {
      const std::string v = next();
      if (v != "gpt2" && v != "llama") {
        std::fprintf(stderr, "gpu_gpt2_bench: --arch %s: expected gpt2 or llama\n", v.c_str());
        std::exit(2);
      }
      o.llama = v == "llama";
    }
    else if (a == "--kv-heads") o.kv_heads = std::stoi(next());
    else if (a == "--ffn") o.ffn = std::stoi(next());
    else if (a == "--rope-theta") o.rope_theta = std::stod(next());
    else if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--fp32") o.fp32 = true;
    else if (a == "--profile") o.profile = true;
    else if (a == "--phases") o.phases = true;
    else if (a == "--gemm-tune") o.gemm_tune = next();
    else if (a == "--gemm-log") o.gemm_log = true;
    else if (a == "--no-gelu-epilogue") o.no_gelu_epilogue = true;
    else if (a == "--no-clip") o.no_clip = true;
    else if (a == "--no-graph") o.no_graph = true;
    else if (a == "--keep-gelu") o.keep_gelu = std::stoi(next());
    else if (a == "--tag") o.tag = next();
    else {
      std::fprintf(stderr,
                   "gpu_gpt2_bench: unknown option %s (options: --layers --embd --heads --seq "
                   "--batch --vocab --arch --kv-heads --ffn --rope-theta --steps --warmup --fp32 "
                   "--profile --phases --gemm-tune --gemm-log --no-gelu-epilogue --no-clip "
                   "--no-graph --keep-gelu --tag)\n",
                   a.c_str());
      std::exit(2);
    }
  }
  return o;
}

/// Forwards every op to another backend and adds up the wall time of each op kind, synchronising
/// after each call: a per-op breakdown of one step (the sync per op adds launch latency, so the
/// sum exceeds the unprofiled step time).
class profiling_backend final : public kernels::backend {
 public:
  explicit profiling_backend(kernels::backend& inner) : in_(inner) {}
  core::device dev() const override { return in_.dev(); }
  std::string name() const override { return in_.name(); }

  tensor empty(const core::shape_t& s, core::dtype t) override { return in_.empty(s, t); }
  void zero(tensor& x) override { timed("zero", [&] { in_.zero(x); }); }
  void copy(const tensor& a, tensor& b) override { timed("copy", [&] { in_.copy(a, b); }); }
  void convert(const tensor& a, tensor& b) override { timed("convert", [&] { in_.convert(a, b); }); }
  void synchronize() override { in_.synchronize(); }
  void linear_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y) override {
    timed("linear_forward", [&] { in_.linear_forward(x, w, b, y); });
  }
  void linear_backward_input(const tensor& dy, const tensor& w, tensor& dx) override {
    timed("linear_backward_input", [&] { in_.linear_backward_input(dy, w, dx); });
  }
  void linear_backward_weight(const tensor& dy, const tensor& x, tensor& dw, tensor& db) override {
    timed("linear_backward_weight", [&] { in_.linear_backward_weight(dy, x, dw, db); });
  }
  void linear_backward_weight_write(const tensor& dy, const tensor& x, tensor& dw,
                                    tensor& db) override {
    timed("linear_backward_weight_write", [&] { in_.linear_backward_weight_write(dy, x, dw, db); });
  }
  void linear_forward_residual(const tensor& x, const tensor& w, const tensor& b, const tensor& r,
                               tensor& y) override {
    timed("linear_forward_residual", [&] { in_.linear_forward_residual(x, w, b, r, y); });
  }
  void linear_gelu_forward(const tensor& x, const tensor& w, const tensor& b, tensor& pre,
                           tensor& y) override {
    timed("linear_gelu_forward", [&] { in_.linear_gelu_forward(x, w, b, pre, y); });
  }
  void linear_backward_input_write(const tensor& dy, const tensor& w, tensor& dx) override {
    timed("linear_backward_input_write", [&] { in_.linear_backward_input_write(dy, w, dx); });
  }
  void linear_backward_input_gelu(const tensor& dy, const tensor& w, const tensor& pre,
                                  tensor& dx) override {
    timed("linear_backward_input_gelu", [&] { in_.linear_backward_input_gelu(dy, w, pre, dx); });
  }
  void embedding_forward(const tensor& t, const tensor& wte, const tensor& wpe, int seq,
                         tensor& out) override {
    timed("embedding_forward", [&] { in_.embedding_forward(t, wte, wpe, seq, out); });
  }
  void embedding_backward(const tensor& d, const tensor& t, int seq, tensor& dwte,
                          tensor& dwpe) override {
    timed("embedding_backward", [&] { in_.embedding_backward(d, t, seq, dwte, dwpe); });
  }
  void layernorm_forward(const tensor& x, const tensor& w, const tensor& b, float eps, tensor& y,
                         tensor& m, tensor& r) override {
    timed("layernorm_forward", [&] { in_.layernorm_forward(x, w, b, eps, y, m, r); });
  }
  void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& m,
                          const tensor& r, tensor& dx, tensor& dw, tensor& db) override {
    timed("layernorm_backward", [&] { in_.layernorm_backward(dy, x, w, m, r, dx, dw, db); });
  }
  void layernorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                   const tensor& m, const tensor& r, const tensor& res, tensor& dx,
                                   tensor& dw, tensor& db, tensor& rsum) override {
    timed("layernorm_backward",
          [&] { in_.layernorm_backward_residual(dy, x, w, m, r, res, dx, dw, db, rsum); });
  }
  void rmsnorm_forward(const tensor& x, const tensor& w, float eps, tensor& y, tensor& r) override {
    timed("rmsnorm_forward", [&] { in_.rmsnorm_forward(x, w, eps, y, r); });
  }
  void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& r,
                        tensor& dx, tensor& dw) override {
    timed("rmsnorm_backward", [&] { in_.rmsnorm_backward(dy, x, w, r, dx, dw); });
  }
  void rmsnorm_backward_residual(const tensor& dy, const tensor& x, const tensor& w,
                                 const tensor& r, const tensor& res, tensor& dx,
                                 tensor& dw) override {
    timed("rmsnorm_backward", [&] { in_.rmsnorm_backward_residual(dy, x, w, r, res, dx, dw); });
  }
  void gelu_forward(const tensor& x, tensor& y) override {
    timed("gelu_forward", [&] { in_.gelu_forward(x, y); });
  }
  void gelu_backward(const tensor& dy, const tensor& x, tensor& dx) override {
    timed("gelu_backward", [&] { in_.gelu_backward(dy, x, dx); });
  }
  void swiglu_forward(const tensor& g, const tensor& u, tensor& y) override {
    timed("swiglu_forward", [&] { in_.swiglu_forward(g, u, y); });
  }
  void swiglu_backward(const tensor& dy, const tensor& g, const tensor& u, tensor& dg,
                       tensor& du) override {
    timed("swiglu_backward", [&] { in_.swiglu_backward(dy, g, u, dg, du); });
  }
  void add(const tensor& a, const tensor& b, tensor& y) override {
    timed("add", [&] { in_.add(a, b, y); });
  }
  void accumulate(const tensor& x, tensor& y) override {
    timed("accumulate", [&] { in_.accumulate(x, y); });
  }
  void sum_rows(const tensor& x, tensor& out) override {
    timed("sum_rows", [&] { in_.sum_rows(x, out); });
  }
  void scale(tensor& x, float s) override { timed("scale", [&] { in_.scale(x, s); }); }
  void dropout(const tensor& x, const kernels::dropout_spec& s, std::int64_t e, tensor& y) override {
    timed("dropout", [&] { in_.dropout(x, s, e, y); });
  }
  void rope_forward(const tensor& x, int seq, int ht, int rh, int hd, const kernels::rope_spec& th,
                    tensor& y) override {
    timed("rope_forward", [&] { in_.rope_forward(x, seq, ht, rh, hd, th, y); });
  }
  void rope_backward(const tensor& dy, int seq, int ht, int rh, int hd, const kernels::rope_spec& th,
                     tensor& dx) override {
    timed("rope_backward", [&] { in_.rope_backward(dy, seq, ht, rh, hd, th, dx); });
  }
  void attention_forward(const tensor& qkv, const kernels::attention_dims& d, tensor& out,
                         tensor& lse) override {
    timed("attention_forward", [&] { in_.attention_forward(qkv, d, out, lse); });
  }
  void attention_backward(const tensor& dout, const tensor& qkv, const tensor& out,
                          const tensor& lse, const kernels::attention_dims& d,
                          tensor& dqkv) override {
    timed("attention_backward", [&] { in_.attention_backward(dout, qkv, out, lse, d, dqkv); });
  }
  void attention_backward_write(const tensor& dout, const tensor& qkv, const tensor& out,
                                const tensor& lse, const kernels::attention_dims& d,
                                tensor& dqkv, tensor& dsum) override {
    timed("attention_backward",
          [&] { in_.attention_backward_write(dout, qkv, out, lse, d, dqkv, dsum); });
  }
  void cross_entropy(tensor& logits, const tensor& t, tensor& l, float gs) override {
    timed("cross_entropy", [&] { in_.cross_entropy(logits, t, l, gs); });
  }
  void sumsq_blocks(const tensor& x, tensor& out) override {
    timed("sumsq_blocks", [&] { in_.sumsq_blocks(x, out); });
  }
  void sumsq_blocks_list(const std::vector<tensor>& xs, tensor& out) override {
    timed("sumsq_blocks", [&] { in_.sumsq_blocks_list(xs, out); });
  }
  void exact_sum_add(const tensor& values, tensor& acc) override {
    timed("exact_sum_add", [&] { in_.exact_sum_add(values, acc); });
  }
  void clip_factor(const tensor& sumsq, const tensor& guard, double grad_clip,
                   tensor& out) override {
    timed("clip_factor", [&] { in_.clip_factor(sumsq, guard, grad_clip, out); });
  }
  std::uint64_t graph_begin() override { return in_.graph_begin(); }
  void graph_end() override { in_.graph_end(); }
  void graph_replay(std::uint64_t id) override { in_.graph_replay(id); }
  void graph_reset() override { in_.graph_reset(); }
  std::uint64_t graph_current() const override { return in_.graph_current(); }
  void adamw(tensor& p, const tensor& g, tensor& m, tensor& v, const kernels::adamw_params& ap,
             tensor& low) override {
    timed("adamw", [&] { in_.adamw(p, g, m, v, ap, low); });
  }
  void adamw_runs(tensor& p, const tensor& g, tensor& m, tensor& v,
                  const std::vector<kernels::adamw_run>& runs, const kernels::adamw_params& ap,
                  tensor& low) override {
    timed("adamw_runs", [&] { in_.adamw_runs(p, g, m, v, runs, ap, low); });
  }
  bool has_nonfinite(const tensor& x) override { return in_.has_nonfinite(x); }

  /// Prints "op  calls  ms" rows, largest first, and clears the counters.
  void report() {
    std::vector<std::pair<std::string, std::pair<int, double>>> rows(ops_.begin(), ops_.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
    double total = 0;
    for (const auto& r : rows) total += r.second.second;
    std::printf("profile (one step, synchronised after every op): %.2f ms in ops\n", total * 1e3);
    for (const auto& r : rows)
      std::printf("  %-24s %5d calls %9.3f ms\n", r.first.c_str(), r.second.first,
                  r.second.second * 1e3);
    ops_.clear();
  }

  /// Timing on or off (off: plain forwarding, no synchronisation).
  void enable(bool on) { on_ = on; }

 private:
  template <class F>
  void timed(const char* op, F&& f) {
    if (!on_) {
      f();
      return;
    }
    in_.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    in_.synchronize();
    auto& slot = ops_[op];
    ++slot.first;
    slot.second += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  kernels::backend& in_;
  bool on_ = false;
  std::map<std::string, std::pair<int, double>> ops_;
};

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    kernels::set_gemm_tune_file(o.gemm_tune);
    kernels::cuda::set_gemm_log(o.gemm_log);
    kernels::cuda::set_gelu_epilogue(!o.no_gelu_epilogue);
    auto be_owner = kernels::make_backend("cuda");
    auto* cuda_be = dynamic_cast<kernels::cuda::cuda_backend*>(be_owner.get());
    profiling_backend prof(*be_owner);
    // The model and optimizer always go through the wrapper; it times only when asked to.
    kernels::backend& be = prof;

    core::model_config cfg;
    cfg.arch = o.llama ? core::arch_kind::llama : core::arch_kind::gpt2;
    cfg.num_layers = o.layers;
    cfg.hidden_size = o.embd;
    cfg.num_heads = o.heads;
    cfg.seq_length = o.seq;
    cfg.vocab_size = o.vocab;
    cfg.tie_embeddings = !o.llama;
    if (o.llama) {
      cfg.num_kv_heads = o.kv_heads;
      cfg.ffn_hidden_size = o.ffn;
      cfg.rope_theta = o.rope_theta;
    }
    const auto precision = o.fp32 ? core::precision_kind::fp32 : core::precision_kind::bf16;
    model::chunk c(cfg, model::partition(cfg, 1).at(0), be, precision);
    if (o.keep_gelu > 0) {
      core::config run_cfg;
      run_cfg.model = cfg;
      run_cfg.recompute.keep_gelu = o.keep_gelu;
      c.set_recompute(core::recompute_mode::none, {}, core::keep_gelu_layers(run_cfg));
    }
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

    std::vector<model::param_slot> slots = model::slots_of(c, state);
    // The tied head reads the embedding (chunk::shares_head): the sum of the two gradients
    // goes into the embedding's.
    const bool tied = c.shares_head();
    model::device_clip clip_buffers = model::make_device_clip(be);
    core::train_config train_cfg;
    train_cfg.grad_clip = 1.0;

    double last_loss = 0, last_norm = 0;
    // Phase marks of the --phases step: a CUDA event and the host clock at each boundary.
    constexpr int n_marks = 6;
    const char* const phase_names[n_marks - 1] = {"zero + forward", "backward", "tie",
                                                   "norm, clip, adamw", "norm + loss read"};
    cudaEvent_t marks[n_marks] = {};
    std::chrono::steady_clock::time_point host_marks[n_marks];
    bool marking = false;
    auto mark = [&](int i) {
      if (!marking || !cuda_be) return;
      host_marks[i] = std::chrono::steady_clock::now();
      cudaEventRecord(marks[i], cuda_be->stream());
    };
    // The inputs on the device before the step, as the trainer has them (no host copy to record).
    const tensor dev_tokens = be.from_host(tokens);
    const tensor dev_targets = be.from_host(targets);
    tensor loss_rows;
    bool graph_ready = false, eager = false;
    std::uint64_t graph_id = 0;
    // The trainer's queue_device_step for one micro-batch (model/trainer.cpp), split at the marks.
    auto queue = [&]() {
      mark(0);
      c.zero_grads();
      if (!o.no_clip) model::begin_device_step(be, clip_buffers);
      c.forward(0, dev_tokens, dev_targets, 1.0f / static_cast<float>(rows));
      loss_rows = c.loss_rows(0);
      if (!o.no_clip) model::guard_losses(be, loss_rows, clip_buffers);
      mark(1);
      c.backward(0, tensor{});
      mark(2);
      if (tied) {
        tensor g_head = c.grad("lm_head.weight"), g_wte = c.grad("wte.weight");
        model::tie_gradients(be, g_wte, g_head, false);
      }
      mark(3);
      if (o.no_clip)  // the baseline's step: AdamW straight after the backward
        model::adamw_update_t(be, slots, opt, 0.0, 1.0f, 1, tensor{}, clip_buffers.schedule);
      else
        model::clip_and_update_on_device(be, slots, opt, train_cfg, clip_buffers);
      mark(4);
    };
    auto step = [&](int index) {
      model::set_adamw_schedule(be, opt, opt.lr, index + 1, clip_buffers);
      if (graph_ready && !eager) {
        be.graph_replay(graph_id);
      } else if (!o.no_graph && !eager && index >= 1 && (graph_id = be.graph_begin()) != 0) {
        // Recorded at the second step, as the trainer does.
        queue();
        be.graph_end();
        graph_ready = true;
        be.graph_replay(graph_id);
      } else {
        queue();
      }
      last_norm = o.no_clip ? std::nan("") : model::read_device_clip(be, clip_buffers).grad_norm;
      last_loss = model::sum_loss_rows(be, loss_rows) / static_cast<double>(rows);
      mark(5);
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
      if (o.no_clip)
        std::printf("step %d: %.2f ms loss %.4f (no clip)\n", i, times.back() * 1e3, last_loss);
      else
        std::printf("step %d: %.2f ms loss %.4f grad norm %.3f\n", i, times.back() * 1e3,
                    last_loss, last_norm);
    }
    kernels::cuda::memory_stats ms;
    if (cuda_be) ms = cuda_be->memory();
    // The profile and the phases time launched ops, not a replay; the recording's memory goes back
    // to the cache first, or their step would allocate its own.
    eager = true;
    if (graph_ready) be.graph_reset();
    if (o.profile) {
      prof.enable(true);
      step(o.warmup + o.steps);
      prof.enable(false);
      prof.report();
    }
    if (o.phases && cuda_be) {
      for (auto& e : marks) cudaEventCreate(&e);
      marking = true;
      const auto t0 = std::chrono::steady_clock::now();
      step(o.warmup + o.steps + 1);
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      marking = false;
      std::printf("phases (one step, %.2f ms wall): host = time to queue, GPU = start to end event\n",
                  wall * 1e3);
      for (int i = 0; i + 1 < n_marks; ++i) {
        float gpu_ms = 0;
        cudaEventElapsedTime(&gpu_ms, marks[i], marks[i + 1]);
        const double host_ms =
            std::chrono::duration<double>(host_marks[i + 1] - host_marks[i]).count() * 1e3;
        std::printf("  %-16s host %8.3f ms  GPU %8.3f ms\n", phase_names[i], host_ms, gpu_ms);
      }
      for (auto& e : marks) cudaEventDestroy(e);
    }
    std::sort(times.begin(), times.end());
    const double med = times[times.size() / 2];
    const std::int64_t params = core::parameter_count(cfg);
    const double flops_tok = 6.0 * params + 12.0 * o.layers * o.embd * o.seq;
    const double tok_s = rows / med;
    const double tflops = flops_tok * rows / med / 1e12;
    const double gib = 1024.0 * 1024.0 * 1024.0;
    std::printf(
        "%-10s params %lld  B %d T %d L %d C %d  step %.2f ms  %.0f tok/s  %.1f TFLOP/s  peak %.2f "
        "GiB in use, %.2f GiB reserved  cudaMalloc in timed steps: %llu\n",
        o.tag.c_str(), static_cast<long long>(params), o.batch, o.seq, o.layers, o.embd, med * 1e3,
        tok_s, tflops, ms.peak_in_use / gib, ms.peak_reserved / gib,
        static_cast<unsigned long long>(ms.device_mallocs - mallocs_before));
    std::printf(
        "{\"tag\": \"%s\", \"engine\": \"troupe\", \"arch\": \"%s\", \"precision\": \"%s\", "
        "\"params\": %lld, \"B\": %d, "
        "\"T\": %d, \"L\": %d, \"C\": %d, \"step_ms\": %.2f, \"tok_s\": %.0f, \"tflops\": %.1f, "
        "\"peak_gib\": %.2f, \"reserved_gib\": %.2f, \"timed_mallocs\": %llu, \"clip\": %s, "
        "\"graph\": %s, \"keep_gelu\": %d, "
        "\"loss\": %.4f}\n",
        o.tag.c_str(), o.llama ? "llama" : "gpt2", o.fp32 ? "fp32" : "bf16",
        static_cast<long long>(params), o.batch, o.seq,
        o.layers, o.embd, med * 1e3, tok_s, tflops, ms.peak_in_use / gib, ms.peak_reserved / gib,
        static_cast<unsigned long long>(ms.device_mallocs - mallocs_before),
        o.no_clip ? "false" : "true", graph_ready ? "true" : "false", o.keep_gelu, last_loss);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_gpt2_bench: %s\n", e.what());
    return 1;
  }
}
