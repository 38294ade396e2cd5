// The CUDA dropout op against its CPU twin: the same mask bit for bit (both evaluate
// core/philox.hpp's integer arithmetic) and the same values (one fp32 multiply, rounded to the
// tensor's dtype). Skips where no GPU is visible.
#include <doctest/doctest.h>

#include "tests/kernels/cuda_test_util.hpp"

namespace troupe::kernels::cuda_test {

TEST_CASE("cuda dropout draws the CPU's mask and values bit for bit (fp32, bf16, fp16)") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  // 3 sequences of T·C = 7·37 elements (no multiple of 4 or of a vector width), the first at a
  // global index past 2³² so both words of the sequence counter are used.
  const std::int64_t per = 7 * 37;
  const tensor x = random_host({3 * 7, 37}, 21);
  for (float p : {0.1f, 0.5f}) {
    const dropout_spec s{p, 0x0123456789abcdefull, (std::int64_t{1} << 32) + 3};
    for (dtype t : {dtype::f32, dtype::bf16, dtype::f16}) {
      CAPTURE(p);
      CAPTURE(core::dtype_name(t));
      const tensor xr = rounded(x, t);  // what both backends see
      tensor want = tensor::zeros(x.shape(), dtype::f32);
      cpu->dropout(xr, s, per, want);
      tensor dx = upload(*gpu, xr, t);
      tensor dy = poisoned(*gpu, x.shape(), t);
      gpu->dropout(dx, s, per, dy);
      CHECK(same_bits(gpu->to_host(dy), host_as(want, t)));
      // In place, as the layers call it on a residual branch.
      gpu->dropout(dx, s, per, dx);
      CHECK(same_bits(gpu->to_host(dx), host_as(want, t)));
    }
  }
}

TEST_CASE("cuda attention refuses dropout of the probabilities, naming the config key") {
  if (!gpu_or_skip()) return;
  auto gpu = make_backend("cuda");
  attention_dims d{1, 4, 2, 2, 8};
  d.dropout = {0.1f, 1, 0};
  tensor qkv = upload(*gpu, random_host({4, 6 * 8}, 3), dtype::f32);
  tensor out = gpu->empty({4, 16}, dtype::f32), lse = gpu->empty({1, 2, 4}, dtype::f32);
  std::string msg;
  try {
    gpu->attention_forward(qkv, d, out, lse);
  } catch (const core::failure& e) {
    msg = e.what();
  }
  CHECK(msg.find("model.attention_dropout") != std::string::npos);
}

}  // namespace troupe::kernels::cuda_test
