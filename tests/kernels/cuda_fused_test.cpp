// The CUDA backend's fused linear ops (cuBLASLt epilogues, beta = 0 GEMMs) against the CPU
// backend's default compositions, in fp32 and bf16. Outputs start NaN-poisoned (they are written,
// never accumulated), and each op runs twice with identical bits. Two widths: 136 (a multiple of
// 8, where bf16 takes the GELU epilogues) and 60 (not one: the unfused fallback). All cases skip
// with a message where no GPU is visible.
#include <doctest/doctest.h>

#include <algorithm>

#include "core/error.hpp"
#include "tests/kernels/cuda_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cuda_test {
namespace {

const dtype float_types[] = {dtype::f32, dtype::bf16};

}  // namespace

TEST_CASE("cuda fused linear forwards (residual, GELU epilogue) match the CPU") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  const std::int64_t N = 200, IC = 96;
  for (std::int64_t OC : {136, 60}) {
    for (dtype t : float_types) {
      INFO("dtype " << core::dtype_name(t) << ", OC " << OC);
      const double rtol = rtol_for(t);
      tensor x = rounded(random_host({N, IC}, 21), t);
      tensor w = rounded(random_host({OC, IC}, 22, 0.2f), t);
      tensor b = rounded(random_host({OC}, 23), t);
      tensor r = rounded(random_host({N, OC}, 24), t);
      tensor gx = upload(*gpu, x, t), gw = upload(*gpu, w, t), gb = upload(*gpu, b, t);
      tensor gr = upload(*gpu, r, t);

      tensor y_ref = tensor::zeros({N, OC});
      cpu->linear_forward_residual(x, w, b, r, y_ref);
      tensor gy = written_twice(*gpu, {N, OC}, t, [&](tensor& y) {
        gpu->linear_forward_residual(gx, gw, gb, gr, y);
      }, "residual forward deterministic");
      check_close(gy, y_ref, rtol, "y = x*w^T + b + r");

      tensor y2_ref = tensor::zeros({N, OC});
      cpu->linear_forward_residual(x, w, tensor{}, r, y2_ref);
      tensor gy2 = poisoned(*gpu, {N, OC}, t);
      gpu->linear_forward_residual(gx, gw, tensor{}, gr, gy2);
      check_close(download(*gpu, gy2), y2_ref, rtol, "y = x*w^T + r");

      // A bias of another dtype than y's is added by the separate bias kernel after the GEMM.
      tensor gb32 = upload(*gpu, b, dtype::f32);
      tensor gy3 = poisoned(*gpu, {N, OC}, t);
      gpu->linear_forward_residual(gx, gw, gb32, gr, gy3);
      check_close(download(*gpu, gy3), y_ref, rtol, "y = x*w^T + fp32 b + r");

      tensor pre_ref = tensor::zeros({N, OC}), act_ref = tensor::zeros({N, OC});
      cpu->linear_gelu_forward(x, w, b, pre_ref, act_ref);
      tensor gpre = poisoned(*gpu, {N, OC}, t);
      tensor gact = written_twice(*gpu, {N, OC}, t, [&](tensor& y) {
        gpu->linear_gelu_forward(gx, gw, gb, gpre, y);
      }, "gelu forward deterministic");
      check_close(download(*gpu, gpre), pre_ref, rtol, "pre = x*w^T + b");
      check_close(gact, act_ref, rtol, "y = gelu(pre)");

      tensor pre2_ref = tensor::zeros({N, OC}), act2_ref = tensor::zeros({N, OC});
      cpu->linear_gelu_forward(x, w, tensor{}, pre2_ref, act2_ref);
      tensor gpre2 = poisoned(*gpu, {N, OC}, t), gact2 = poisoned(*gpu, {N, OC}, t);
      gpu->linear_gelu_forward(gx, gw, tensor{}, gpre2, gact2);
      check_close(download(*gpu, gpre2), pre2_ref, rtol, "pre = x*w^T");
      check_close(download(*gpu, gact2), act2_ref, rtol, "y = gelu(x*w^T)");
    }
  }
}

TEST_CASE("cuda fused linear input gradients (written, DGELU epilogue) match the CPU") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  const std::int64_t N = 200, OC = 96;
  for (std::int64_t IC : {136, 60}) {
    for (dtype t : float_types) {
      INFO("dtype " << core::dtype_name(t) << ", IC " << IC);
      const double rtol = rtol_for(t);
      tensor dy = rounded(random_host({N, OC}, 31), t);
      tensor w = rounded(random_host({OC, IC}, 32, 0.2f), t);
      tensor pre = rounded(random_host({N, IC}, 33, 2.0f), t);
      tensor gdy = upload(*gpu, dy, t), gw = upload(*gpu, w, t), gpre = upload(*gpu, pre, t);

      tensor dx_ref = tensor::zeros({N, IC});
      cpu->linear_backward_input_write(dy, w, dx_ref);
      tensor gdx = written_twice(*gpu, {N, IC}, t, [&](tensor& dx) {
        gpu->linear_backward_input_write(gdy, gw, dx);
      }, "written input gradient deterministic");
      check_close(gdx, dx_ref, rtol, "dx = dy*w");

      tensor dfc_ref = tensor::zeros({N, IC});
      cpu->linear_backward_input_gelu(dy, w, pre, dfc_ref);
      tensor gdfc = written_twice(*gpu, {N, IC}, t, [&](tensor& dx) {
        gpu->linear_backward_input_gelu(gdy, gw, gpre, dx);
      }, "gelu input gradient deterministic");
      check_close(gdfc, dfc_ref, rtol, "dx = (dy*w) gelu'(pre)");
    }
  }
}

TEST_CASE("cuda weight gradients written (beta 0) give the bits of zeroing and adding") {
  // linear_backward_weight_write: the first weight gradient of a step into an unzeroed buffer
  // (model/chunk.cpp, zero_grads). dw through a beta-0 GEMM, db through column sums that store
  // instead of adding; against the CPU, and bit for bit against zeros + linear_backward_weight.
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  const std::int64_t N = 200, IC = 96;
  for (std::int64_t OC : {136, 60}) {
    for (dtype t : float_types) {
      for (bool bias : {true, false}) {
        // Without a bias the head's case too: dy rows padded to a multiple of 64 (logits_width).
        const std::int64_t W = bias ? OC : (OC + 63) / 64 * 64;
        INFO("dtype " << core::dtype_name(t) << ", OC " << OC << ", width " << W);
        tensor dy = rounded(random_host({N, OC}, 51), t);
        tensor padded = tensor::zeros({N, W});  // the padding's gradient is zero
        for (std::int64_t r = 0; r < N; ++r)
          std::copy_n(dy.data<float>() + r * OC, OC, padded.data<float>() + r * W);
        tensor x = rounded(random_host({N, IC}, 52), t);
        tensor gdy = upload(*gpu, padded, t), gx = upload(*gpu, x, t);
        tensor dw_ref = tensor::zeros({OC, IC}), db_ref = tensor::zeros({OC});
        tensor no_db;
        cpu->linear_backward_weight(dy, x, dw_ref, bias ? db_ref : no_db);

        tensor zw = upload(*gpu, tensor::zeros({OC, IC}), dtype::f32);
        tensor zb = bias ? upload(*gpu, tensor::zeros({OC}), dtype::f32) : tensor{};
        gpu->linear_backward_weight(gdy, gx, zw, zb);
        tensor ww = poisoned(*gpu, {OC, IC}, dtype::f32);
        tensor wb = bias ? poisoned(*gpu, {OC}, dtype::f32) : tensor{};
        gpu->linear_backward_weight_write(gdy, gx, ww, wb);
        const double rtol = rtol_for(t);
        check_close(download(*gpu, ww), dw_ref, rtol, "dw = dy^T x");
        CHECK_MESSAGE(same_bits(gpu->to_host(ww), gpu->to_host(zw)), "dw: written vs added");
        if (bias) {
          check_close(download(*gpu, wb), db_ref, rtol, "db = sum dy");
          CHECK_MESSAGE(same_bits(gpu->to_host(wb), gpu->to_host(zb)), "db: written vs added");
        }
      }
    }
  }
}

TEST_CASE("cuda fused linear ops refuse outputs that alias their inputs") {
  if (!gpu_or_skip()) return;
  auto gpu = make_backend("cuda");
  tensor x = upload(*gpu, random_host({8, 16}, 41), dtype::bf16);
  tensor w = upload(*gpu, random_host({16, 16}, 42), dtype::bf16);
  tensor r = upload(*gpu, random_host({8, 16}, 43), dtype::bf16);
  CHECK_THROWS_WITH_AS(gpu->linear_forward_residual(x, w, tensor{}, r, r),
                       doctest::Contains("y must not alias r"), core::failure);
  CHECK_THROWS_WITH_AS(gpu->linear_gelu_forward(x, w, tensor{}, r, r),
                       doctest::Contains("y must not alias pre"), core::failure);
  CHECK_THROWS_WITH_AS(gpu->linear_backward_input_gelu(x, w, r, r),
                       doctest::Contains("dx must not alias pre"), core::failure);
}

}  // namespace troupe::kernels::cuda_test
