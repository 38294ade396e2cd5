#include "plan/calibrate.hpp"

#include <algorithm>
#include <chrono>

#include "kernels/select.hpp"
#include "model/chunk.hpp"

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

  // Forward + backward of one micro-batch through a chunk of `layers` layers with the embedding
  // and the head.
  auto chunk_seconds = [&](int layers) {
    model::chunk c(cfg.model, model::chunk_spec{0, layers, true, true}, *be, cfg.precision.compute);
    c.init(cfg.train.seed);
    core::tensor tokens = core::tensor::zeros({rows}, core::dtype::i32);
    core::tensor targets = core::tensor::zeros({rows}, core::dtype::i32);
    for (std::int64_t i = 0; i < rows; ++i) {
      tokens.data<std::int32_t>()[i] = static_cast<std::int32_t>((i * 7919) % cfg.model.vocab_size);
      targets.data<std::int32_t>()[i] = static_cast<std::int32_t>((i * 104729) % cfg.model.vocab_size);
    }
    core::tensor tok = be->from_host(tokens), tgt = be->from_host(targets);
    auto once = [&] {
      c.forward(0, tok, tgt, 1.0f / static_cast<float>(rows));
      c.backward(0, {});
      c.release(0);
    };
    return time_per_call(once, *be, repeats);
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
    // A copy of 64 MiB: the rate a tensor moves between two CPU stages. Between GPUs the link is
    // not the device's own memory: the default stays (no second device to time here).
    if (cal.device != "cpu") return cal;
    core::tensor dst = be->empty({n}, core::dtype::f32);
    const double t_copy = time_per_call([&] { be->copy(p, dst); }, *be, repeats, 0.1, 0.2);
    cal.link_bytes_per_s = 4.0 * static_cast<double>(n) / t_copy;
  }
  return cal;
}

}  // namespace troupe::plan
