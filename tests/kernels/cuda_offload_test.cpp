// What optimizer offload (optimizer.offload, actors/shard_engine.hpp) rests on: the CPU backend's
// AdamW, vectorised and on several threads, gives the CUDA AdamW's bits on the same inputs over
// several steps (so a shard may update on either side of the bus), and kernels/offload.hpp's
// page-locked buffers, asynchronous device-to-host copies and fences deliver a device buffer's
// bytes. Skips without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/offload.hpp"
#include "kernels/select.hpp"
#include "tests/kernels/cuda_test_util.hpp"

namespace troupe::kernels::cuda_test {

TEST_CASE("cuda adamw and the CPU adamw give the same bits on the same inputs, on 1 and 4 threads") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  // Two million elements and an odd tail; runs of both decay flags, one starting off a multiple of
  // four (the CUDA kernel's scalar path), one gap left untouched.
  const std::int64_t n = (std::int64_t{1} << 21) + 333;
  const std::vector<adamw_run> runs{{0, 1000003, true}, {1000003, 1500000, false},
                                    {1500010, n, true}};
  tensor p0 = random_host({n}, 11), m0 = random_host({n}, 12, 0.01f), v0 = random_host({n}, 13);
  for (std::int64_t i = 0; i < n; ++i) {
    v0.data<float>()[i] = 1e-4f * v0.data<float>()[i] * v0.data<float>()[i];
    // magnitudes over many binades, where rounding differences would show
    p0.data<float>()[i] *= std::ldexp(1.0f, static_cast<int>(i % 17) - 8);
  }
  for (int threads : {1, 4}) {
    INFO("CPU threads " << threads);
    set_cpu_threads(threads);
    tensor hp = p0.clone(), hm = m0.clone(), hv = v0.clone(), none;
    tensor dp = gpu->from_host(p0), dm = gpu->from_host(m0), dv = gpu->from_host(v0), dnone;
    for (int step = 1; step <= 5; ++step) {
      INFO("step " << step);
      tensor g = random_host({n}, 100 + step, step == 3 ? 40.0f : 1.0f);
      adamw_params ap;
      ap.lr = 6e-4f * static_cast<float>(step) / 5.0f;
      ap.beta1 = 0.9f;
      ap.beta2 = 0.95f;
      ap.eps = 1e-8f;
      ap.weight_decay = 0.1f;
      ap.grad_scale = step == 3 ? 0.0137f : 1.0f / 3.0f;  // a clip and a loss-scale undo
      ap.step = step;
      cpu->adamw_runs(hp, g, hm, hv, runs, ap, none);
      tensor dg = gpu->from_host(g);
      gpu->adamw_runs(dp, dg, dm, dv, runs, ap, dnone);
      CHECK(same_bits(gpu->to_host(dp), hp));
      CHECK(same_bits(gpu->to_host(dm), hm));
      CHECK(same_bits(gpu->to_host(dv), hv));
    }
    // the arithmetic did move the weights (the comparison above is not of untouched buffers)
    CHECK_FALSE(same_bits(hp, p0));
  }
  set_cpu_threads(0);
}

TEST_CASE("cuda offload copies: pinned buffers, asynchronous copies each way and fences") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  const std::int64_t n = (std::int64_t{1} << 22) + 7;
  tensor src = random_host({n}, 5);
  tensor dev = gpu->from_host(src);
  tensor pinned = pinned_host(*gpu, *cpu, {n}, core::dtype::f32);
  REQUIRE(pinned.dev().is_cpu());
  std::int64_t nonzero = 0;
  for (std::int64_t i = 0; i < n; ++i) nonzero += pinned.data<float>()[i] != 0.0f ? 1 : 0;
  CHECK(nonzero == 0);
  // Two halves, each with its own fence, as the shard copies pieces.
  tensor lo = pinned.slice(0, {n / 2}), hi = pinned.slice(n / 2, {n - n / 2});
  copy_to_host_async(*gpu, dev.slice(0, {n / 2}), lo);
  auto first = make_fence(*gpu);
  copy_to_host_async(*gpu, dev.slice(n / 2, {n - n / 2}), hi);
  auto second = make_fence(*gpu);
  first->wait();
  CHECK(std::memcmp(lo.raw(), src.raw(), lo.bytes()) == 0);
  second->wait();
  CHECK(same_bits(pinned, src));
  // Back to the device, asynchronously, from the pinned buffer: the same bits.
  tensor back = gpu->empty({n}, core::dtype::f32);
  gpu->zero(back);
  tensor back_lo = back.slice(0, {n / 2}), back_hi = back.slice(n / 2, {n - n / 2});
  copy_to_device_async(*gpu, lo, back_lo);
  copy_to_device_async(*gpu, hi, back_hi);
  CHECK(same_bits(gpu->to_host(back), src));
  // The CPU backend's versions are plain copies with fences already passed.
  tensor plain = pinned_host(*cpu, *cpu, {n}, core::dtype::f32);
  copy_to_host_async(*cpu, src, plain);
  make_fence(*cpu)->wait();
  CHECK(same_bits(plain, src));
}

}  // namespace troupe::kernels::cuda_test
