#include "plan/calibrate.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "actors/shard_engine.hpp"
#include "kernels/offload.hpp"
#include "kernels/select.hpp"
#include "model/chunk.hpp"
#include "transport/transport.hpp"

namespace troupe::plan {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Seconds per call of `once`, after warming up for `warm` seconds (a GPU idle before it runs at
// a lower clock for a while), timed over at least `repeats` calls and `span` seconds.
template <class F>
double time_per_call(F&& once, kernels::backend& be, int repeats, double warm = 0.5,
                     double span = 0.5) {
  auto t0 = std::chrono::steady_clock::now();
  int n = 0;
  do {
    once();
    be.synchronize();
    ++n;
  } while (seconds_since(t0) < warm);
  t0 = std::chrono::steady_clock::now();
  n = 0;
  do {
    once();
    ++n;
    if (n >= repeats) be.synchronize();
  } while (n < repeats || seconds_since(t0) < span);
  be.synchronize();
  return seconds_since(t0) / n;
}
}  // namespace

core::result<calibration> calibrate(const core::config& cfg, int repeats) {
  std::unique_ptr<kernels::backend> be;
  try {
    be = kernels::make_backend(cfg.runtime.device);
  } catch (const std::exception& e) {
    return core::config_error(cfg, "runtime.device", e.what());
  }
  calibration cal = default_calibration(cfg.runtime.device, cfg.precision.compute);
  cal.source = "measured";
  const std::int64_t rows =
      static_cast<std::int64_t>(cfg.parallel.micro_batch_size) * cfg.model.seq_length;

  // Forward + backward of one micro-batch through a chunk of `layers` layers on backend `b`: with
  // the embedding and the head (`ends`; tokens in, the loss out), or without (an activation in, its
  // gradient back, as a middle pipeline stage runs).
  struct chunk_run {
    model::chunk c;
    core::tensor in, tgt, dy;
    float scale;
    void once() {
      c.forward(0, in, tgt, scale);
      c.backward(0, dy);
      c.release(0);
    }
  };
  auto make_run = [&](int layers, kernels::backend& b, bool ends) {
    model::chunk c(cfg.model, model::chunk_spec{0, layers, ends, ends}, b, cfg.precision.compute);
    c.init(cfg.train.seed);
    const float scale = 1.0f / static_cast<float>(rows);
    if (!ends) {
      const std::int64_t C = cfg.model.hidden_size;
      core::tensor x = core::tensor::zeros({rows, C}, core::dtype::f32);
      for (std::int64_t i = 0; i < rows * C; ++i)
        x.data<float>()[i] = static_cast<float>((i * 7919) % 2001 - 1000) * 1e-3f;
      const core::dtype t = c.flat_low().defined() ? c.flat_low().type() : core::dtype::f32;
      core::tensor a = b.from_host(x), in = b.empty({rows, C}, t), dy = b.empty({rows, C}, t);
      for (core::tensor* d : {&in, &dy}) {
        if (t == core::dtype::f32) b.copy(a, *d);
        else b.convert(a, *d);
      }
      return std::make_unique<chunk_run>(chunk_run{std::move(c), in, {}, dy, scale});
    }
    core::tensor tokens = core::tensor::zeros({rows}, core::dtype::i32);
    core::tensor targets = core::tensor::zeros({rows}, core::dtype::i32);
    for (std::int64_t i = 0; i < rows; ++i) {
      tokens.data<std::int32_t>()[i] = static_cast<std::int32_t>((i * 7919) % cfg.model.vocab_size);
      targets.data<std::int32_t>()[i] = static_cast<std::int32_t>((i * 104729) % cfg.model.vocab_size);
    }
    return std::make_unique<chunk_run>(
        chunk_run{std::move(c), b.from_host(tokens), b.from_host(targets), {}, scale});
  };
  auto chunk_seconds = [&](int layers) {
    auto r = make_run(layers, *be, true);
    return time_per_call([&] { r->once(); }, *be, repeats);
  };
  // Two chunk depths separate the time per layer from what every micro-batch pays once (the
  // embedding, the head and the cross-entropy, which run at another rate than the layers); the
  // rate is then the config's whole model's FLOPs over its time, so that a deep model is not
  // priced at the rate of a shallow chunk dominated by its head.
  {
    const int L = cfg.model.num_layers;
    const int a = std::min(L, 1), b = std::min(L, 3);
    const double t_a = chunk_seconds(a);
    cal.chunk_seconds.emplace_back(a, t_a);
    double per_layer = 0, fixed = t_a;
    if (b > a) {
      const double t_b = chunk_seconds(b);
      cal.chunk_seconds.emplace_back(b, t_b);
      per_layer = (t_b - t_a) / (b - a);
      fixed = t_a - a * per_layer;
    }
    double whole = L * per_layer + fixed;
    int layers = L;
    if (per_layer <= 0 || fixed <= 0) whole = t_a, layers = a;  // too noisy to separate
    const double flops = 3 * forward_flops(cfg.model, layers, true, rows);
    const double overhead = 3.0 * forward_ops_per_layer(cfg.model) * layers * cal.op_overhead_s;
    cal.flops_per_s = flops / std::max(whole - overhead, whole / 2);
  }
  // Two workers on one device, as `troupe train` runs them: a chunk of layers (no embedding or
  // head: most of a pipeline's work) on two backends (each its own stream), driven by two threads
  // at once, against one thread alone.
  if (cal.device != "cpu") {
    const int layers = std::min(cfg.model.num_layers, 4);
    std::unique_ptr<kernels::backend> be2 = kernels::make_backend(cfg.runtime.device);
    auto r1 = make_run(layers, *be, false), r2 = make_run(layers, *be2, false);
    // Calls of `r` on `b` until `seconds` passed since t0, each waited for (as a stage waits on its
    // inputs): the same protocol alone and side by side, so only the sharing differs.
    auto drive = [](chunk_run& r, kernels::backend& b, std::chrono::steady_clock::time_point t0,
                    double seconds) {
      int n = 0;
      do {
        r.once();
        b.synchronize();
        ++n;
      } while (seconds_since(t0) < seconds);
      return n;
    };
    // Calls per second of r1 alone, or of r1 and r2 at once (r2 on a second thread).
    auto rate = [&](double seconds, bool pair) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!pair) return drive(*r1, *be, t0, seconds) / seconds_since(t0);
      int n2 = 0;
      std::exception_ptr failed;  // the other thread's error (out of memory, say), thrown here
      std::thread other([&] {
        try {
          n2 = drive(*r2, *be2, t0, seconds);
        } catch (...) {
          failed = std::current_exception();
        }
      });
      int n1 = 0;
      try {
        n1 = drive(*r1, *be, t0, seconds);
      } catch (...) {
        other.join();
        throw;
      }
      other.join();
      if (failed) std::rethrow_exception(failed);
      return (n1 + n2) / seconds_since(t0);
    };
    rate(0.5, true);  // warm-up (and each backend's allocator filled)
    const double alone = rate(0.5, false), together = rate(0.5, true);
    cal.concurrent_speedup = std::clamp(together / alone, 0.5, 4.0);
  }
  // AdamW over 16M elements: 28 bytes each.
  {
    const std::int64_t n = std::int64_t{1} << 24;
    core::tensor p = be->empty({n}, core::dtype::f32), g = be->empty({n}, core::dtype::f32),
                 m = be->empty({n}, core::dtype::f32), v = be->empty({n}, core::dtype::f32), low;
    for (core::tensor* t : {&p, &g, &m, &v}) be->zero(*t);
    kernels::adamw_params ap;
    ap.lr = 1e-4f;
    const double t_adamw = time_per_call([&] { be->adamw(p, g, m, v, ap, low); }, *be, repeats);
    cal.memory_bytes_per_s = 28.0 * static_cast<double>(n) / t_adamw;
    if (cal.device == "cpu") {
      // A copy of 64 MiB: the rate a tensor moves between two CPU stages.
      core::tensor dst = be->empty({n}, core::dtype::f32);
      const double t_copy = time_per_call([&] { be->copy(p, dst); }, *be, repeats, 0.1, 0.2);
      cal.link_bytes_per_s = 4.0 * static_cast<double>(n) / t_copy;
    }
    // Between GPUs the link is not the device's own memory: its default stays (no second device
    // to time here).
  }
  // optimizer.offload, through the optimizer shard itself (actors/shard_engine.hpp) with one
  // replica: a gradient delivered, reduced (with its norm) and applied, which sends it to the host
  // in pieces through the ring of page-locked buffers, updates each piece as it lands and copies
  // it back into the parameters (converted to the compute type there). The host rate is 28 B per
  // element over that whole tail, so it holds what the update waits on as well as the update; the
  // link rate is one piece down and back alone.
  {
    auto host = kernels::make_backend("cpu");
    const std::int64_t piece = actors::offload_piece;
    const std::int64_t n = piece * (cal.device == "cpu" ? 2 : 8);
    core::config oc = cfg;
    oc.optimizer.offload = true;
    oc.optimizer.zero_stage = 0;
    oc.parallel.data_parallel = oc.parallel.pipeline_stage = oc.parallel.model_parallel = 1;
    oc.runtime.forensics = "off";  // no hashes of the summed gradient
    const actors::job_layout one;  // one replica, one stage
    core::tensor params = be->empty({n}, core::dtype::f32), grad = be->empty({n}, core::dtype::f32);
    be->zero(params);
    be->zero(grad);
    core::tensor low;
    if (cfg.precision.compute != core::precision_kind::fp32) {
      low = be->empty({n}, cfg.precision.compute == core::precision_kind::bf16 ? core::dtype::bf16
                                                                                : core::dtype::f16);
      be->convert(params, low);
    }
    be->record_ready(params);
    model::param_info info{"calibration", {n}, 0, n};
    actors::shard_engine shard(oc, one, 0, 0, *be, {actors::shard_chunk{0, {info}, params, low}},
                               host.get());
    std::int64_t step = 0;
    const double t_tail = time_per_call(
        [&] {
          be->record_ready(grad);
          shard.deliver(0, transport::tag{step, static_cast<std::uint32_t>(
                                                    actors::tensor_kind::grad_slice), 0, -1, 0},
                        grad);
          shard.reduce(step);
          shard.take_norm_parts();
          shard.apply(step, 1.0f, 1e-4);
          shard.take_outgoing();
          ++step;
        },
        *be, repeats, 0.2, 0.5);
    cal.host_adamw_bytes_per_s = 28.0 * static_cast<double>(n) / t_tail;
    core::tensor staged = kernels::pinned_host(*be, *host, {piece}, core::dtype::f32);
    core::tensor first = params.slice(0, {piece});
    const double t_link = time_per_call(
        [&] {
          kernels::copy_to_host_async(*be, grad.slice(0, {piece}), staged);
          kernels::copy_to_device_async(*be, staged, first);
        },
        *be, repeats, 0.2, 0.3);
    cal.offload_link_bytes_per_s = 8.0 * static_cast<double>(piece) / t_link;
  }
  return cal;
}

}  // namespace troupe::plan
