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
  const int layers = std::min(cfg.model.num_layers, 2);
  const std::int64_t rows =
      static_cast<std::int64_t>(cfg.parallel.micro_batch_size) * cfg.model.seq_length;

  // A chunk forward + backward of one micro-batch.
  {
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
    once();
    be->synchronize();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) once();
    be->synchronize();
    const double t = seconds_since(t0) / repeats;
    const double flops = 3 * forward_flops(cfg.model, layers, true, rows);
    const double overhead = 3.0 * forward_ops_per_layer(cfg.model) * layers * cal.op_overhead_s;
    cal.flops_per_s = flops / std::max(t - overhead, t / 2);
  }
  // AdamW over 16M elements: 28 bytes each.
  {
    const std::int64_t n = std::int64_t{1} << 24;
    core::tensor p = be->empty({n}, core::dtype::f32), g = be->empty({n}, core::dtype::f32),
                 m = be->empty({n}, core::dtype::f32), v = be->empty({n}, core::dtype::f32), low;
    for (core::tensor* t : {&p, &g, &m, &v}) be->zero(*t);
    kernels::adamw_params ap;
    ap.lr = 1e-4f;
    be->adamw(p, g, m, v, ap, low);
    be->synchronize();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) be->adamw(p, g, m, v, ap, low);
    be->synchronize();
    cal.memory_bytes_per_s = 28.0 * static_cast<double>(n) / (seconds_since(t0) / repeats);
    // A copy of 64 MiB: the rate a tensor moves between two CPU stages. Between GPUs the link is
    // not the device's own memory: the default stays (no second device to time here).
    if (cal.device != "cpu") return cal;
    core::tensor dst = be->empty({n}, core::dtype::f32);
    be->copy(p, dst);
    be->synchronize();
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) be->copy(p, dst);
    be->synchronize();
    cal.link_bytes_per_s = 4.0 * static_cast<double>(n) / (seconds_since(t0) / repeats);
  }
  return cal;
}

}  // namespace troupe::plan
