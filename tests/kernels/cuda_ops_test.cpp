// Every op of the CUDA backend against the CPU reference (fp32 and bf16), plus run-to-run
// determinism. All cases skip with a message where no GPU is visible (CI, the build machine).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "tests/kernels/cuda_test_util.hpp"
#ifdef TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_allocator.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/select.hpp"
#endif

namespace troupe::kernels::cuda_test {
namespace {

struct backends {
  std::unique_ptr<backend> cpu = make_backend("cpu");
  std::unique_ptr<backend> gpu = make_backend("cuda");
};

const dtype float_types[] = {dtype::f32, dtype::bf16};

}  // namespace

TEST_CASE("cuda allocator reuses freed blocks instead of calling cudaMalloc again") {
  if (!gpu_or_skip()) return;
#ifdef TROUPE_HAVE_CUDA
  auto gpu = make_backend("cuda");
  auto* be = dynamic_cast<cuda::cuda_backend*>(gpu.get());
  REQUIRE(be != nullptr);
  { tensor warm = gpu->empty({1024, 1024}, dtype::f32); }
  const auto before = be->memory();
  for (int step = 0; step < 5; ++step) {
    tensor a = gpu->empty({1024, 1024}, dtype::f32);
    tensor b = gpu->empty({1000, 3}, dtype::bf16);
  }
  tensor b0 = gpu->empty({1000, 3}, dtype::bf16);
  const auto after = be->memory();
  CHECK(after.device_mallocs == before.device_mallocs + 1);  // only the first small block
  CHECK(after.peak_in_use >= before.in_use + (std::size_t{4} << 20));
  CHECK(after.device_frees == before.device_frees);
#endif
}

TEST_CASE("cuda copy round-trips host data and convert rounds like the host conversion") {
  if (!gpu_or_skip()) return;
  auto gpu = make_backend("cuda");
  tensor h = random_host({257, 33}, 1, 3.0f);
  tensor d = gpu->from_host(h);
  tensor d2 = gpu->empty(h.shape(), dtype::f32);
  gpu->copy(d, d2);
  CHECK(same_bits(gpu->to_host(d2), h));
  for (dtype t : {dtype::bf16, dtype::f16}) {
    tensor low = poisoned(*gpu, h.shape(), t);
    gpu->convert(d, low);
    CHECK(same_bits(gpu->to_host(low), host_as(h, t)));
    tensor back = poisoned(*gpu, h.shape(), dtype::f32);
    gpu->convert(low, back);
    CHECK(same_bits(gpu->to_host(back), rounded(h, t)));
  }
}

TEST_CASE("cuda linear forward and backward match the CPU in fp32 and bf16") {
  if (!gpu_or_skip()) return;
  backends be;
  const std::int64_t N = 200, IC = 96, OC = 136;
  for (dtype t : float_types) {
    INFO("dtype " << core::dtype_name(t));
    const double rtol = rtol_for(t);
    tensor x = rounded(random_host({N, IC}, 2), t), w = rounded(random_host({OC, IC}, 3, 0.1f), t);
    tensor b = rounded(random_host({OC}, 4), t);
    tensor dy = rounded(random_host({N, OC}, 5), t);
    tensor dx0 = rounded(random_host({N, IC}, 6), t);
    tensor dw0 = random_host({OC, IC}, 7), db0 = random_host({OC}, 8);  // fp32 gradient buffers

    tensor y_ref = tensor::zeros({N, OC});
    be.cpu->linear_forward(x, w, b, y_ref);
    tensor gx = upload(*be.gpu, x, t), gw = upload(*be.gpu, w, t), gb = upload(*be.gpu, b, t);
    tensor gy = poisoned(*be.gpu, {N, OC}, t);
    be.gpu->linear_forward(gx, gw, gb, gy);
    check_close(download(*be.gpu, gy), y_ref, rtol, "y = x·wᵀ + b");

    tensor y2_ref = tensor::zeros({N, OC});
    be.cpu->linear_forward(x, w, tensor{}, y2_ref);
    tensor gy2 = poisoned(*be.gpu, {N, OC}, t);
    be.gpu->linear_forward(gx, gw, tensor{}, gy2);
    check_close(download(*be.gpu, gy2), y2_ref, rtol, "y = x·wᵀ");

    // A bias whose dtype differs from y's takes the separate bias kernel.
    tensor gy3 = poisoned(*be.gpu, {N, OC}, t);
    tensor gb32 = upload(*be.gpu, b, dtype::f32);
    be.gpu->linear_forward(gx, gw, gb32, gy3);
    check_close(download(*be.gpu, gy3), y_ref, rtol, "y = x·wᵀ + fp32 b");

    tensor dx_ref = dx0.clone();
    be.cpu->linear_backward_input(dy, w, dx_ref);
    tensor gdy = upload(*be.gpu, dy, t);
    tensor gdx = run_twice(*be.gpu, dx0, t, [&](tensor& dx) { be.gpu->linear_backward_input(gdy, gw, dx); },
                           "dx deterministic");
    check_close(gdx, dx_ref, rtol, "dx += dy·w");

    tensor dw_ref = dw0.clone(), db_ref = db0.clone();
    be.cpu->linear_backward_weight(dy, x, dw_ref, db_ref);
    tensor gdw = upload(*be.gpu, dw0, dtype::f32), gdb = upload(*be.gpu, db0, dtype::f32);
    be.gpu->linear_backward_weight(gdy, gx, gdw, gdb);
    check_close(download(*be.gpu, gdw), dw_ref, rtol, "fp32 dw += dyᵀ·x");
    check_close(download(*be.gpu, gdb), db_ref, rtol, "fp32 db += Σ dy");
  }
}

TEST_CASE("cuda bias gradient: the 16-byte column-sum kernel gives the generic kernel's bits") {
  if (!gpu_or_skip()) return;
  backends be;
  // N spans several row chunks (32 rows each) and a ragged last one.
  const std::int64_t N = 1000, IC = 64, OC = 136;
  for (dtype t : float_types) {
    INFO("dtype " << core::dtype_name(t));
    tensor dy = rounded(random_host({N, OC}, 21), t), x = rounded(random_host({N, IC}, 22), t);
    tensor db0 = random_host({OC}, 23);
    tensor gx = upload(*be.gpu, x, t);
    // The same dy twice: 16-byte aligned (vectorised kernel) and one element off (generic kernel).
    tensor aligned = upload(*be.gpu, dy, t);
    tensor padded = upload(*be.gpu, rounded(random_host({N * OC + 1}, 24), t), t);
    tensor shifted = padded.slice(1, {N, OC});
    be.gpu->copy(aligned, shifted);
    tensor gdw1 = upload(*be.gpu, tensor::zeros({OC, IC}), dtype::f32);
    tensor gdw2 = upload(*be.gpu, tensor::zeros({OC, IC}), dtype::f32);
    tensor gdb1 = upload(*be.gpu, db0, dtype::f32), gdb2 = upload(*be.gpu, db0, dtype::f32);
    be.gpu->linear_backward_weight(aligned, gx, gdw1, gdb1);
    be.gpu->linear_backward_weight(shifted, gx, gdw2, gdb2);
    CHECK(same_bits(be.gpu->to_host(gdb1), be.gpu->to_host(gdb2)));
    tensor db_ref = db0.clone(), dw_ref = tensor::zeros({OC, IC});
    be.cpu->linear_backward_weight(dy, x, dw_ref, db_ref);
    check_close(download(*be.gpu, gdb1), db_ref, rtol_for(t), "db += Σ dy");
  }
}

TEST_CASE("cuda rmsnorm weight gradient: the 16-byte column-sum kernel gives the generic bits") {
  if (!gpu_or_skip()) return;
  backends be;
  // N spans several row chunks (32 rows each) and a ragged last one.
  const std::int64_t N = 1000, C = 136;
  for (dtype t : float_types) {
    INFO("dtype " << core::dtype_name(t));
    tensor x = rounded(random_host({N, C}, 51), t), dy = rounded(random_host({N, C}, 52), t);
    tensor w = random_host({C}, 53), dw0 = random_host({C}, 54);
    tensor gw = upload(*be.gpu, w, dtype::f32);
    tensor rstd = poisoned(*be.gpu, {N}, dtype::f32), y = poisoned(*be.gpu, {N, C}, t);
    tensor gx = upload(*be.gpu, x, t), gdy = upload(*be.gpu, dy, t);
    be.gpu->rmsnorm_forward(gx, gw, 1e-6f, y, rstd);
    // The same x and dy one element off their 16-byte alignment: the generic kernel.
    tensor px = upload(*be.gpu, tensor::zeros({N * C + 1}), t).slice(1, {N, C});
    tensor pdy = upload(*be.gpu, tensor::zeros({N * C + 1}), t).slice(1, {N, C});
    be.gpu->copy(gx, px);
    be.gpu->copy(gdy, pdy);
    tensor dx1 = poisoned(*be.gpu, {N, C}, t), dx2 = poisoned(*be.gpu, {N, C}, t);
    tensor dw1 = upload(*be.gpu, dw0, dtype::f32), dw2 = upload(*be.gpu, dw0, dtype::f32);
    tensor res = upload(*be.gpu, tensor::zeros({N, C}), t);
    be.gpu->rmsnorm_backward_residual(gdy, gx, gw, rstd, res, dx1, dw1);
    be.gpu->rmsnorm_backward_residual(pdy, px, gw, rstd, res, dx2, dw2);
    CHECK(same_bits(be.gpu->to_host(dw1), be.gpu->to_host(dw2)));
  }
}

TEST_CASE("cuda embedding forward and backward match the CPU, repeated tokens included") {
  if (!gpu_or_skip()) return;
  backends be;
  const std::int64_t B = 3, T = 40, V = 50, C = 72;
  tensor tok = random_tokens(B * T, V, 9);  // 120 draws from 50 tokens: many repeats
  for (dtype t : float_types) {
    INFO("dtype " << core::dtype_name(t));
    const double rtol = rtol_for(t);
    tensor wte = rounded(random_host({V, C}, 10), t), wpe = rounded(random_host({T, C}, 11), t);
    tensor out_ref = tensor::zeros({B * T, C});
    be.cpu->embedding_forward(tok, wte, wpe, static_cast<int>(T), out_ref);
    tensor gtok = be.gpu->from_host(tok);
    tensor gwte = upload(*be.gpu, wte, t), gwpe = upload(*be.gpu, wpe, t);
    tensor gout = poisoned(*be.gpu, {B * T, C}, t);
    be.gpu->embedding_forward(gtok, gwte, gwpe, static_cast<int>(T), gout);
    check_close(download(*be.gpu, gout), out_ref, rtol, "embedding forward");

    tensor dout = rounded(random_host({B * T, C}, 12), t);
    tensor dwte0 = random_host({V, C}, 13), dwpe0 = random_host({T, C}, 14);
    tensor dwte_ref = dwte0.clone(), dwpe_ref = dwpe0.clone();
    be.cpu->embedding_backward(dout, tok, static_cast<int>(T), dwte_ref, dwpe_ref);
    tensor gdout = upload(*be.gpu, dout, t);
    tensor gdwpe = upload(*be.gpu, dwpe0, dtype::f32);
    tensor gdwte = run_twice(
        *be.gpu, dwte0, dtype::f32,
        [&](tensor& dwte) {
          tensor scratch_dwpe = upload(*be.gpu, dwpe0, dtype::f32);
          be.gpu->embedding_backward(gdout, gtok, static_cast<int>(T), dwte, scratch_dwpe);
        },
        "dwte deterministic");
    check_close(gdwte, dwte_ref, rtol, "dwte");
    tensor gdwte2 = upload(*be.gpu, dwte0, dtype::f32);
    be.gpu->embedding_backward(gdout, gtok, static_cast<int>(T), gdwte2, gdwpe);
    check_close(download(*be.gpu, gdwpe), dwpe_ref, rtol, "dwpe");
  }
}

TEST_CASE("cuda layernorm and rmsnorm match the CPU forward and backward") {
  if (!gpu_or_skip()) return;
  backends be;
  for (std::int64_t C : {768, 100}) {  // 16-byte packs, and the scalar path
    const std::int64_t N = 150;
    for (dtype t : float_types) {
      INFO("dtype " << core::dtype_name(t) << ", C " << C);
      const double rtol = rtol_for(t);
      tensor x = rounded(random_host({N, C}, 20, 2.0f), t);
      for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 0.5f;
      x = rounded(x, t);
      tensor w = rounded(random_host({C}, 21), t), b = rounded(random_host({C}, 22), t);
      tensor dy = rounded(random_host({N, C}, 23), t);
      tensor dx0 = rounded(random_host({N, C}, 24), t);
      tensor dw0 = random_host({C}, 25), db0 = random_host({C}, 26);
      tensor gx = upload(*be.gpu, x, t), gw = upload(*be.gpu, w, t), gb = upload(*be.gpu, b, t);
      tensor gdy = upload(*be.gpu, dy, t);

      tensor y_ref = tensor::zeros({N, C}), mean_ref = tensor::zeros({N}), rstd_ref = tensor::zeros({N});
      be.cpu->layernorm_forward(x, w, b, 1e-5f, y_ref, mean_ref, rstd_ref);
      tensor gy = poisoned(*be.gpu, {N, C}, t), gmean = poisoned(*be.gpu, {N}, dtype::f32),
             grstd = poisoned(*be.gpu, {N}, dtype::f32);
      be.gpu->layernorm_forward(gx, gw, gb, 1e-5f, gy, gmean, grstd);
      check_close(download(*be.gpu, gy), y_ref, rtol, "layernorm y");
      check_close(download(*be.gpu, gmean), mean_ref, fp32_rtol, "layernorm mean (fp32 stats)");
      check_close(download(*be.gpu, grstd), rstd_ref, fp32_rtol, "layernorm rstd (fp32 stats)");

      tensor dx_ref = dx0.clone(), dw_ref = dw0.clone(), db_ref = db0.clone();
      be.cpu->layernorm_backward(dy, x, w, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref);
      tensor gdw = upload(*be.gpu, dw0, dtype::f32), gdb = upload(*be.gpu, db0, dtype::f32);
      tensor gdx = run_twice(
          *be.gpu, dx0, t,
          [&](tensor& dx) {
            gdw = upload(*be.gpu, dw0, dtype::f32);
            gdb = upload(*be.gpu, db0, dtype::f32);
            be.gpu->layernorm_backward(gdy, gx, gw, gmean, grstd, dx, gdw, gdb);
          },
          "layernorm dx deterministic");
      check_close(gdx, dx_ref, rtol, "layernorm dx");
      check_close(download(*be.gpu, gdw), dw_ref, rtol, "layernorm fp32 dw");
      check_close(download(*be.gpu, gdb), db_ref, rtol, "layernorm fp32 db");

      tensor ry_ref = tensor::zeros({N, C}), rrstd_ref = tensor::zeros({N});
      be.cpu->rmsnorm_forward(x, w, 1e-6f, ry_ref, rrstd_ref);
      tensor gry = poisoned(*be.gpu, {N, C}, t), grrstd = poisoned(*be.gpu, {N}, dtype::f32);
      be.gpu->rmsnorm_forward(gx, gw, 1e-6f, gry, grrstd);
      check_close(download(*be.gpu, gry), ry_ref, rtol, "rmsnorm y");
      check_close(download(*be.gpu, grrstd), rrstd_ref, fp32_rtol, "rmsnorm rstd");
      tensor rdx_ref = dx0.clone(), rdw_ref = dw0.clone();
      be.cpu->rmsnorm_backward(dy, x, w, rrstd_ref, rdx_ref, rdw_ref);
      tensor grdx = upload(*be.gpu, dx0, t), grdw = upload(*be.gpu, dw0, dtype::f32);
      be.gpu->rmsnorm_backward(gdy, gx, gw, grrstd, grdx, grdw);
      check_close(download(*be.gpu, grdx), rdx_ref, rtol, "rmsnorm dx");
      check_close(download(*be.gpu, grdw), rdw_ref, rtol, "rmsnorm fp32 dw");
      // The residual read from its own buffer and dx written (NaN before): the same bits as
      // accumulating onto a dx that held the residual.
      tensor gres = upload(*be.gpu, dx0, t), gwdx = poisoned(*be.gpu, {N, C}, t);
      tensor gwdw = upload(*be.gpu, dw0, dtype::f32);
      be.gpu->rmsnorm_backward_residual(gdy, gx, gw, grrstd, gres, gwdx, gwdw);
      CHECK(same_bits(be.gpu->to_host(gwdx), be.gpu->to_host(grdx)));
      CHECK(same_bits(be.gpu->to_host(gwdw), be.gpu->to_host(grdw)));
      CHECK_THROWS(be.gpu->rmsnorm_backward_residual(gdy, gx, gw, grrstd, gres, gres, gwdw));
    }
  }
}

TEST_CASE("cuda pointwise ops (gelu, swiglu, add, accumulate, scale) match the CPU") {
  if (!gpu_or_skip()) return;
  backends be;
  for (std::int64_t n : {4096, 1001}) {  // packs, and the scalar tail path
    for (dtype t : float_types) {
      INFO("dtype " << core::dtype_name(t) << ", n " << n);
      const double rtol = rtol_for(t);
      tensor x = rounded(random_host({n}, 30, 2.0f), t), u = rounded(random_host({n}, 31), t);
      tensor dy = rounded(random_host({n}, 32), t), d0 = rounded(random_host({n}, 33), t);
      tensor d1 = rounded(random_host({n}, 34), t);
      tensor gx = upload(*be.gpu, x, t), gu = upload(*be.gpu, u, t), gdy = upload(*be.gpu, dy, t);

      tensor y_ref = tensor::zeros({n});
      be.cpu->gelu_forward(x, y_ref);
      tensor gy = poisoned(*be.gpu, {n}, t);
      be.gpu->gelu_forward(gx, gy);
      check_close(download(*be.gpu, gy), y_ref, rtol, "gelu");
      tensor dx_ref = d0.clone();
      be.cpu->gelu_backward(dy, x, dx_ref);
      tensor gdx = upload(*be.gpu, d0, t);
      be.gpu->gelu_backward(gdy, gx, gdx);
      check_close(download(*be.gpu, gdx), dx_ref, rtol, "gelu backward");

      tensor s_ref = tensor::zeros({n});
      be.cpu->swiglu_forward(x, u, s_ref);
      tensor gs = poisoned(*be.gpu, {n}, t);
      be.gpu->swiglu_forward(gx, gu, gs);
      check_close(download(*be.gpu, gs), s_ref, rtol, "swiglu");
      tensor dg_ref = d0.clone(), du_ref = d1.clone();
      be.cpu->swiglu_backward(dy, x, u, dg_ref, du_ref);
      tensor gdg = poisoned(*be.gpu, {n}, t), gdu = poisoned(*be.gpu, {n}, t);  // written
      be.gpu->swiglu_backward(gdy, gx, gu, gdg, gdu);
      check_close(download(*be.gpu, gdg), dg_ref, rtol, "swiglu dgate");
      check_close(download(*be.gpu, gdu), du_ref, rtol, "swiglu dup");

      tensor a_ref = tensor::zeros({n});
      be.cpu->add(x, u, a_ref);
      tensor ga = poisoned(*be.gpu, {n}, t);
      be.gpu->add(gx, gu, ga);
      check_close(download(*be.gpu, ga), a_ref, rtol, "add");
      tensor acc_ref = d0.clone();
      be.cpu->accumulate(x, acc_ref);
      be.cpu->scale(acc_ref, 0.37f);
      tensor gacc = upload(*be.gpu, d0, t);
      be.gpu->accumulate(gx, gacc);
      be.gpu->scale(gacc, 0.37f);
      check_close(download(*be.gpu, gacc), acc_ref, rtol, "accumulate then scale");
    }
  }
  // An fp32 buffer accumulating a bf16 one (mixed dtypes) takes the scalar path.
  tensor x = rounded(random_host({777}, 35), dtype::bf16), y0 = random_host({777}, 36);
  tensor y_ref = y0.clone();
  be.cpu->accumulate(x, y_ref);
  tensor gy = upload(*be.gpu, y0, dtype::f32);
  be.gpu->accumulate(upload(*be.gpu, x, dtype::bf16), gy);
  check_close(download(*be.gpu, gy), y_ref, fp32_rtol, "fp32 += bf16");
}

TEST_CASE("cuda rope matches the CPU, rotating only the first rot_heads heads") {
  if (!gpu_or_skip()) return;
  backends be;
  const int B = 2, T = 300, heads_total = 5, rot = 3, D = 16;
  const std::int64_t N = B * T, W = heads_total * D;
  for (dtype t : float_types) {
    INFO("dtype " << core::dtype_name(t));
    const double rtol = rtol_for(t);
    tensor x = rounded(random_host({N, W}, 40), t), dy = rounded(random_host({N, W}, 41), t);
    tensor dx0 = rounded(random_host({N, W}, 42), t);
    tensor y_ref = tensor::zeros({N, W});
    be.cpu->rope_forward(x, T, heads_total, rot, D, rope_spec{10000.0f}, y_ref);
    tensor gx = upload(*be.gpu, x, t), gy = poisoned(*be.gpu, {N, W}, t);
    be.gpu->rope_forward(gx, T, heads_total, rot, D, rope_spec{10000.0f}, gy);
    check_close(download(*be.gpu, gy), y_ref, rtol, "rope forward");
    be.gpu->rope_forward(gx, T, heads_total, rot, D, rope_spec{10000.0f}, gx);  // in place
    check_close(download(*be.gpu, gx), y_ref, rtol, "rope forward in place");
    tensor dx_ref = dx0.clone();
    be.cpu->rope_backward(dy, T, heads_total, rot, D, rope_spec{10000.0f}, dx_ref);
    tensor gdx = poisoned(*be.gpu, {N, W}, t);  // written
    be.gpu->rope_backward(upload(*be.gpu, dy, t), T, heads_total, rot, D, rope_spec{10000.0f}, gdx);
    check_close(download(*be.gpu, gdx), dx_ref, rtol, "rope backward");
    tensor gdy = upload(*be.gpu, dy, t);
    be.gpu->rope_backward(gdy, T, heads_total, rot, D, rope_spec{10000.0f}, gdy);  // in place
    CHECK(same_bits(be.gpu->to_host(gdy), be.gpu->to_host(gdx)));
    // One element off 16-byte alignment takes the scalar kernel: the same bits as the 16-byte one.
    tensor sx = upload(*be.gpu, tensor::zeros({N * W + 1}), t).slice(1, {N, W});
    tensor sy = upload(*be.gpu, tensor::zeros({N * W + 1}), t).slice(1, {N, W});
    be.gpu->copy(upload(*be.gpu, x, t), sx);
    be.gpu->rope_forward(sx, T, heads_total, rot, D, rope_spec{10000.0f}, sy);
    CHECK(same_bits(be.gpu->to_host(sy), be.gpu->to_host(gy)));
    be.gpu->copy(upload(*be.gpu, dy, t), sx);
    be.gpu->rope_backward(sx, T, heads_total, rot, D, rope_spec{10000.0f}, sy);
    CHECK(same_bits(be.gpu->to_host(sy), be.gpu->to_host(gdx)));
  }
}

TEST_CASE("cuda rope with llama3 scaling matches the CPU twin") {
  if (!gpu_or_skip()) return;
  backends be;
  // original_max_positions 64 with theta 500000, D = 64 puts pairs in all three frequency bands.
  const int B = 2, T = 200, heads_total = 6, rot = 4, D = 64;
  const std::int64_t N = B * T, W = heads_total * D;
  const rope_spec r{500000.0, 8.0, 1.0, 4.0, 64.0};
  tensor x = random_host({N, W}, 43), dy = random_host({N, W}, 44), dx0 = random_host({N, W}, 45);
  tensor y_ref = tensor::zeros({N, W});
  be.cpu->rope_forward(x, T, heads_total, rot, D, r, y_ref);
  tensor gy = poisoned(*be.gpu, {N, W}, dtype::f32);
  be.gpu->rope_forward(upload(*be.gpu, x, dtype::f32), T, heads_total, rot, D, r, gy);
  check_close(download(*be.gpu, gy), y_ref, fp32_rtol, "llama3 rope forward");
  tensor unscaled = tensor::zeros({N, W});
  be.cpu->rope_forward(x, T, heads_total, rot, D, rope_spec{500000.0}, unscaled);
  CHECK_FALSE(same_bits(unscaled, y_ref));
  tensor dx_ref = dx0.clone();
  be.cpu->rope_backward(dy, T, heads_total, rot, D, r, dx_ref);
  tensor gdx = upload(*be.gpu, dx0, dtype::f32);
  be.gpu->rope_backward(upload(*be.gpu, dy, dtype::f32), T, heads_total, rot, D, r, gdx);
  check_close(download(*be.gpu, gdx), dx_ref, fp32_rtol, "llama3 rope backward");
}

namespace {

/// `loose` widens the gradient tolerance for long sequences (P and dS are rounded to 16 bits before
/// their matmuls, and a gradient sums T of them). `docs` (host int32 [B*T], optional): packed
/// documents, attention_dims::doc_start of the CPU twin, uploaded for the GPU.
void check_attention(backends& be, dtype t, const attention_dims& dims, const std::string& what,
                     double loose = 1.0, const tensor& docs = {}) {
  INFO(what << " dtype " << std::string(core::dtype_name(t)) << " B=" << dims.batch << " T="
            << dims.seq << " H=" << dims.heads << " Hkv=" << dims.kv_heads
            << " D=" << dims.head_dim << (docs.defined() ? " packed documents" : ""));
  attention_dims d = dims, dg = dims;  // the CPU's and the GPU's
  if (docs.defined()) {
    d.doc_start = docs;
    dg.doc_start = be.gpu->from_host(docs);
  }
  const double rtol = rtol_for(t);
  const std::int64_t N = static_cast<std::int64_t>(d.batch) * d.seq;
  const std::int64_t W = static_cast<std::int64_t>(d.heads + 2 * d.kv_heads) * d.head_dim;
  const std::int64_t OW = static_cast<std::int64_t>(d.heads) * d.head_dim;
  tensor qkv = rounded(random_host({N, W}, 50, 1.5f), t);
  tensor out_ref = tensor::zeros({N, OW}), lse_ref = tensor::zeros({d.batch, d.heads, d.seq});
  be.cpu->attention_forward(qkv, d, out_ref, lse_ref);
  tensor gqkv = upload(*be.gpu, qkv, t);
  tensor gout = poisoned(*be.gpu, {N, OW}, t);
  tensor glse = poisoned(*be.gpu, {d.batch, d.heads, d.seq}, dtype::f32);
  be.gpu->attention_forward(gqkv, dg, gout, glse);
  check_close(download(*be.gpu, gout), out_ref, rtol, "attention out");
  check_close(download(*be.gpu, glse), lse_ref, t == dtype::f32 ? fp32_rtol : 1e-3, "attention lse");

  // The backward gets the same `out` on both sides (the GPU's, rounded as stored).
  tensor out_used = download(*be.gpu, gout);
  tensor lse_used = download(*be.gpu, glse);
  tensor dout = rounded(random_host({N, OW}, 51), t);
  tensor dqkv0 = rounded(random_host({N, W}, 52), t);
  tensor dqkv_ref = dqkv0.clone();
  be.cpu->attention_backward(dout, qkv, out_used, lse_used, d, dqkv_ref);
  tensor gdout = upload(*be.gpu, dout, t);
  tensor gdqkv = run_twice(
      *be.gpu, dqkv0, t,
      [&](tensor& dqkv) { be.gpu->attention_backward(gdout, gqkv, gout, glse, dg, dqkv); },
      "attention backward deterministic");
  check_close(gdqkv, dqkv_ref, rtol * loose, "attention dqkv");

  // The written variant ignores what dqkv held (NaN here) and equals, value for value, the same
  // kernels' gradient added to zeros (checked against the CPU above, through the O(1) values it
  // is added to). Against the CPU alone the bf16 tensor-core gradient is off by up to ~3% of its
  // rms in a few elements of these shapes (measured on the H200): P and dS are rounded to bf16
  // before their matmuls, as in FlashAttention.
  tensor gz = upload(*be.gpu, tensor::zeros({N, W}), t);
  be.gpu->attention_backward(gdout, gqkv, gout, glse, dg, gz);
  const tensor added = download(*be.gpu, gz);
  tensor gw1 = poisoned(*be.gpu, {N, W}, t), gw2 = poisoned(*be.gpu, {N, W}, t), none;
  be.gpu->attention_backward_write(gdout, gqkv, gout, glse, dg, gw1, none);
  be.gpu->attention_backward_write(gdout, gqkv, gout, glse, dg, gw2, none);
  CHECK(same_bits(be.gpu->to_host(gw1), be.gpu->to_host(gw2)));
  // With the column sums of the written dqkv (GPT-2's qkv bias gradient, written over NaN): the
  // same dqkv bits, sums that match the CPU's sum of that dqkv, the same bits on repeat.
  tensor gw3 = poisoned(*be.gpu, {N, W}, t), gs1 = poisoned(*be.gpu, {W}, dtype::f32);
  tensor gw4 = poisoned(*be.gpu, {N, W}, t), gs2 = poisoned(*be.gpu, {W}, dtype::f32);
  be.gpu->attention_backward_write(gdout, gqkv, gout, glse, dg, gw3, gs1);
  be.gpu->attention_backward_write(gdout, gqkv, gout, glse, dg, gw4, gs2);
  CHECK(same_bits(be.gpu->to_host(gw3), be.gpu->to_host(gw1)));
  CHECK(same_bits(be.gpu->to_host(gs1), be.gpu->to_host(gs2)));
  const tensor sum_ref = column_sums_f64(download(*be.gpu, gw1), tensor::zeros({W}));
  check_close(be.gpu->to_host(gs1), sum_ref, fp32_rtol, "attention dqkv column sums");
  const tensor written = download(*be.gpu, gw1);
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < written.numel(); ++i)
    if (!(written.data<float>()[i] == added.data<float>()[i])) ++differ;  // NaN counts as differing
  INFO("attention dqkv written vs added to zeros: " << differ << " of " << written.numel()
                                                    << " elements differ");
  CHECK(differ == 0);
}

/// Document starts of B rows of T tokens (host int32 [B*T]): documents of random lengths 1 ..
/// max_len, back to back from token 0 of each row.
tensor random_docs(int B, int T, int max_len, std::uint64_t seed) {
  tensor docs = tensor::zeros({static_cast<std::int64_t>(B) * T}, dtype::i32);
  core::rng_stream r(core::stream_key(seed, 13));
  auto* p = docs.data<std::int32_t>();
  for (int b = 0; b < B; ++b)
    for (int start = 0; start < T;) {
      const int len = 1 + static_cast<int>(r.below(static_cast<std::uint64_t>(max_len)));
      for (int t = start; t < std::min(T, start + len); ++t) p[b * T + t] = start;
      start += len;
    }
  return docs;
}

}  // namespace

TEST_CASE("cuda attention over packed documents matches the CPU (row and tensor-core paths)") {
  if (!gpu_or_skip()) return;
  backends be;
  // Query t sees keys doc_start(t) .. t only. Documents up to max_len tokens long: short ones put
  // several boundaries in one tile, long ones make whole key tiles that a block skips (before the
  // first start of its rows) and query tiles a dK/dV block skips. Every head size of both kernel
  // families, grouped-query attention, T not a multiple of the tiles. `loose` doubles the bf16
  // tolerance where the gradient sums more bf16-rounded terms (long rows, D = 128, a key head
  // shared by 4 query heads: 1 element of 255,744 was at 1.1 times the plain tolerance on the
  // H200).
  struct shape {
    dtype t;
    attention_dims d;
    int max_len;
    double loose;
    const char* what;
  };
  const shape shapes[] = {
      {dtype::f32, {2, 70, 4, 2, 64}, 20, 1.0, "fp32 row path D=64, GQA 2:1"},
      {dtype::f32, {2, 150, 2, 1, 32}, 60, 1.0, "fp32 row path D=32, GQA 2:1"},
      {dtype::f32, {1, 90, 3, 3, 128}, 40, 1.0, "fp32 row path D=128"},
      {dtype::f32, {1, 33, 3, 3, 24}, 8, 1.0, "fp32 row path, odd D"},
      {dtype::bf16, {2, 200, 4, 2, 32}, 70, 1.0, "bf16 tensor cores D=32, GQA 2:1"},
      {dtype::bf16, {2, 130, 4, 2, 64}, 12, 1.0, "bf16 tensor cores D=64, short documents"},
      {dtype::bf16, {2, 333, 4, 1, 64}, 150, 2.0, "bf16 tensor cores D=64, GQA 4:1, long documents"},
      {dtype::bf16, {2, 17, 2, 2, 64}, 6, 1.0, "bf16 tensor cores, T < tile"},
      {dtype::bf16, {1, 1000, 4, 2, 64}, 300, 2.0, "bf16 tensor cores, T = 1000, GQA 2:1"},
      {dtype::bf16, {2, 260, 4, 2, 128}, 100, 2.0, "bf16 tensor cores D=128, GQA 2:1"},
      {dtype::f16, {1, 150, 2, 1, 64}, 50, 1.0, "fp16 tensor cores D=64, GQA 2:1"},
      {dtype::bf16, {2, 50, 2, 2, 40}, 15, 1.0, "bf16 row path D=40"},
  };
  std::uint64_t seed = 100;
  for (const shape& c : shapes) {
    const tensor docs = random_docs(c.d.batch, c.d.seq, c.max_len, ++seed);
    check_attention(be, c.t, c.d, c.what, c.loose, docs);
  }
  // One document per row (every start 0) is plain causal attention: the same bits as without.
  const attention_dims d{2, 130, 4, 2, 64};
  const std::int64_t N = 2 * 130, W = (4 + 2 * 2) * 64, OW = 4 * 64;
  for (dtype t : float_types) {
    INFO("one document per row, dtype " << core::dtype_name(t));
    tensor gqkv = upload(*be.gpu, random_host({N, W}, 60), t);
    attention_dims dz = d;
    dz.doc_start = be.gpu->from_host(tensor::zeros({N}, dtype::i32));
    tensor o1 = poisoned(*be.gpu, {N, OW}, t), o2 = poisoned(*be.gpu, {N, OW}, t);
    tensor l1 = poisoned(*be.gpu, {2, 4, 130}, dtype::f32);
    tensor l2 = poisoned(*be.gpu, {2, 4, 130}, dtype::f32);
    be.gpu->attention_forward(gqkv, d, o1, l1);
    be.gpu->attention_forward(gqkv, dz, o2, l2);
    CHECK(same_bits(be.gpu->to_host(o1), be.gpu->to_host(o2)));
    CHECK(same_bits(be.gpu->to_host(l1), be.gpu->to_host(l2)));
    tensor gdout = upload(*be.gpu, random_host({N, OW}, 61), t);
    tensor g1 = upload(*be.gpu, tensor::zeros({N, W}), t);
    tensor g2 = upload(*be.gpu, tensor::zeros({N, W}), t);
    be.gpu->attention_backward(gdout, gqkv, o1, l1, d, g1);
    be.gpu->attention_backward(gdout, gqkv, o1, l1, dz, g2);
    CHECK(same_bits(be.gpu->to_host(g1), be.gpu->to_host(g2)));
  }
  // Document starts on the host are refused with the operand named.
  attention_dims dh = d;
  dh.doc_start = tensor::zeros({N}, dtype::i32);
  tensor gqkv = upload(*be.gpu, random_host({N, W}, 62), dtype::f32);
  tensor o = poisoned(*be.gpu, {N, OW}, dtype::f32);
  tensor l = poisoned(*be.gpu, {2, 4, 130}, dtype::f32);
  CHECK_THROWS_WITH(be.gpu->attention_forward(gqkv, dh, o, l),
                    doctest::Contains("doc_start must be on the GPU"));
}

TEST_CASE("cuda embedding and rope backward at per-token positions match the CPU") {
  if (!gpu_or_skip()) return;
  backends be;
  // Positions restarting at each packed document (position = t - doc_start(t)), as model/chunk.cpp
  // gives them: many rows share a position, so dwpe sums rows of several documents.
  const int B = 3, T = 90, V = 40, C = 48, heads_total = 5, rot = 3, D = 16;
  const std::int64_t N = B * T, W = heads_total * D;
  const tensor docs = random_docs(B, T, 25, 70);
  tensor pos = tensor::zeros({N}, dtype::i32);
  for (std::int64_t r = 0; r < N; ++r)
    pos.data<std::int32_t>()[r] = static_cast<std::int32_t>(r % T - docs.data<std::int32_t>()[r]);
  const tensor tok = random_tokens(N, V, 71);
  const tensor gpos = be.gpu->from_host(pos), gtok = be.gpu->from_host(tok);
  for (dtype t : float_types) {
    INFO("dtype " << core::dtype_name(t));
    const double rtol = rtol_for(t);
    tensor dout = rounded(random_host({N, C}, 72), t);
    tensor dwte0 = random_host({V, C}, 73), dwpe0 = random_host({T, C}, 74);
    tensor dwte_ref = dwte0.clone(), dwpe_ref = dwpe0.clone();
    be.cpu->embedding_backward_at(dout, tok, pos, dwte_ref, dwpe_ref);
    tensor gdout = upload(*be.gpu, dout, t);
    tensor gdwpe = run_twice(
        *be.gpu, dwpe0, dtype::f32,
        [&](tensor& dwpe) {
          tensor scratch_dwte = upload(*be.gpu, dwte0, dtype::f32);
          be.gpu->embedding_backward_at(gdout, gtok, gpos, scratch_dwte, dwpe);
        },
        "dwpe at positions deterministic");
    check_close(gdwpe, dwpe_ref, rtol, "dwpe at positions");
    tensor gdwte = upload(*be.gpu, dwte0, dtype::f32), gdwpe2 = upload(*be.gpu, dwpe0, dtype::f32);
    be.gpu->embedding_backward_at(gdout, gtok, gpos, gdwte, gdwpe2);
    check_close(download(*be.gpu, gdwte), dwte_ref, rtol, "dwte at positions");
    // Positions r % T would put other rows into each position's gradient: the test can tell.
    tensor dwpe_rows = dwpe0.clone(), dwte_rows = dwte0.clone();
    be.cpu->embedding_backward(dout, tok, T, dwte_rows, dwpe_rows);
    CHECK_FALSE(same_bits(dwpe_rows, dwpe_ref));

    tensor dy = rounded(random_host({N, W}, 75), t), dx0 = rounded(random_host({N, W}, 76), t);
    const rope_spec rope{10000.0f};
    tensor dx_ref = dx0.clone();
    be.cpu->rope_backward_at(dy, pos, heads_total, rot, D, rope, dx_ref);
    tensor gdx = upload(*be.gpu, dx0, t);
    be.gpu->rope_backward_at(upload(*be.gpu, dy, t), gpos, heads_total, rot, D, rope, gdx);
    check_close(download(*be.gpu, gdx), dx_ref, rtol, "rope backward at positions");
    tensor dx_rows = dx0.clone();
    be.cpu->rope_backward(dy, T, heads_total, rot, D, rope, dx_rows);
    CHECK_FALSE(same_bits(dx_rows, dx_ref));
  }
}

TEST_CASE("cuda attention forward and backward match the CPU (row and tensor-core paths)") {
  if (!gpu_or_skip()) return;
  backends be;
  // T not a multiple of the 64-row tiles; grouped-query attention; both kernel families.
  check_attention(be, dtype::f32, {2, 70, 4, 2, 64}, "fp32 row path");
  check_attention(be, dtype::f32, {1, 33, 3, 3, 24}, "fp32 row path, odd D");
  check_attention(be, dtype::bf16, {2, 130, 4, 2, 64}, "bf16 tensor cores D=64");
  check_attention(be, dtype::bf16, {1, 200, 2, 1, 32}, "bf16 tensor cores D=32");
  // Several unmasked tiles before the diagonal, four query heads per kv head, T ≡ 1 mod 64.
  check_attention(be, dtype::bf16, {1, 321, 4, 1, 64}, "bf16 tensor cores, long T, GQA 4:1");
  // T shorter than one tile: every tile is a diagonal tile with rows past T.
  check_attention(be, dtype::bf16, {2, 17, 2, 2, 32}, "bf16 tensor cores, T < tile");
  check_attention(be, dtype::f16, {1, 150, 2, 2, 64}, "fp16 tensor cores D=64");
  // The fused backward's ordered dQ sums: eight key blocks per head, a ragged last block and GQA;
  // then 256 blocks of GPT-2's length at once (about one per slot of the H200), run twice. At
  // T = 1024 the bf16 gradient's worst element of 6.3M was 1.14x the 1% tolerance (H200, both the
  // fused and the split backward): 2% there.
  check_attention(be, dtype::bf16, {1, 1000, 4, 2, 64}, "bf16 tensor cores, T = 1000, GQA 2:1", 2.0);
  check_attention(be, dtype::bf16, {4, 1024, 8, 8, 64}, "bf16 tensor cores, GPT-2 length", 2.0);
  check_attention(be, dtype::bf16, {1, 96, 2, 2, 128}, "bf16 tensor cores D=128");
  check_attention(be, dtype::bf16, {2, 333, 4, 2, 128}, "bf16 tensor cores D=128, GQA 2:1, T past tiles", 2.0);
  check_attention(be, dtype::f16, {1, 130, 2, 1, 128}, "fp16 tensor cores D=128, GQA 2:1");
  check_attention(be, dtype::bf16, {2, 50, 2, 2, 40}, "bf16 row path D=40");
}

TEST_CASE("cuda attention: the Hopper kernels and the mma.sync kernels both match the CPU; "
          "TROUPE_CUDA_ATTENTION picks between them") {
  if (!gpu_or_skip()) return;
  // On an H100/H200 attention at head size 64 runs sm90/attention_fwd.cu and attention_bwd.cu by
  // default (the cases above test them there; the backward's with packed documents stays on
  // mma.sync); TROUPE_CUDA_ATTENTION=mma keeps the mma.sync kernels, tested here too, and "tma" and
  // "cp-async" fix how the Hopper forward loads its tiles (by shape otherwise).
  struct env_guard {
    explicit env_guard(const char* v) { ::setenv("TROUPE_CUDA_ATTENTION", v, 1); }
    ~env_guard() { ::unsetenv("TROUPE_CUDA_ATTENTION"); }
  };
  struct shape {
    dtype t;
    attention_dims d;
    int max_len;   // 0: no documents
    double loose;  // as check_attention's: long rows sum more bf16-rounded terms
    const char* what;
  };
  const shape shapes[] = {
      {dtype::bf16, {2, 130, 4, 2, 64}, 0, 1.0, "bf16 D=64, GQA 2:1, T past the tiles"},
      {dtype::bf16, {2, 17, 2, 2, 64}, 0, 1.0, "bf16, T < one tile"},
      {dtype::bf16, {1, 1000, 4, 1, 64}, 0, 2.0, "bf16, T = 1000, GQA 4:1"},
      {dtype::f16, {1, 300, 3, 3, 64}, 0, 1.0, "fp16 D=64"},
      {dtype::bf16, {2, 333, 4, 2, 64}, 150, 2.0, "bf16, long documents, GQA 2:1"},
      {dtype::bf16, {2, 260, 2, 2, 64}, 9, 1.0, "bf16, short documents"},
  };
  std::map<std::string, std::vector<tensor>> outs;  // mode: out per shape; mode + "_lse": lse
  for (const char* mode : {"mma", "auto", "tma", "cp-async"}) {
    env_guard env(mode);
    backends be;
    std::uint64_t seed = 300;
    for (const shape& c : shapes) {
      INFO("TROUPE_CUDA_ATTENTION=" << mode << ": " << c.what);
      const tensor docs = c.max_len ? random_docs(c.d.batch, c.d.seq, c.max_len, ++seed) : tensor{};
      check_attention(be, c.t, c.d, c.what, c.loose, docs);
      // The forward gives the same bits twice.
      attention_dims dg = c.d;
      if (docs.defined()) dg.doc_start = be.gpu->from_host(docs);
      const std::int64_t N = static_cast<std::int64_t>(c.d.batch) * c.d.seq;
      const std::int64_t W = static_cast<std::int64_t>(c.d.heads + 2 * c.d.kv_heads) * 64;
      tensor gqkv = upload(*be.gpu, rounded(random_host({N, W}, 310, 1.5f), c.t), c.t);
      std::vector<tensor> got;
      for (int rep = 0; rep < 2; ++rep) {
        tensor o = poisoned(*be.gpu, {N, c.d.heads * 64}, c.t);
        tensor l = poisoned(*be.gpu, {c.d.batch, c.d.heads, c.d.seq}, dtype::f32);
        be.gpu->attention_forward(gqkv, dg, o, l);
        got.push_back(be.gpu->to_host(o));
        got.push_back(be.gpu->to_host(l));
      }
      CHECK(same_bits(got[0], got[2]));
      CHECK(same_bits(got[1], got[3]));
      outs[mode].push_back(got[0]);
      outs[std::string(mode) + "_lse"].push_back(got[1]);
    }
  }
  // The Hopper forward's two ways of loading tiles run the same maths: the same bits, and "auto"
  // picks one of them. ("tma" never falls back to cp.async: where the TMA cannot run it throws.)
  for (std::size_t i = 0; i < outs["tma"].size(); ++i) {
    INFO(shapes[i].what);
    CHECK(same_bits(outs["tma"][i], outs["cp-async"][i]));
    CHECK(same_bits(outs["tma_lse"][i], outs["cp-async_lse"][i]));
    CHECK(same_bits(outs["tma"][i], outs["auto"][i]));
  }
  // The two forwards agree closely with each other (they differ in how the exponentials round).
  for (std::size_t i = 0; i < outs["mma"].size(); ++i) {
    INFO(shapes[i].what);
    check_close(host_f32(outs["auto"][i]), host_f32(outs["mma"][i]), rtol_for(shapes[i].t),
                "Hopper forward against the mma.sync forward");
  }
  // A value that is not a choice is refused, naming the variable.
  {
    env_guard env("wgmma");
    CHECK_THROWS_WITH(make_backend("cuda"), doctest::Contains("TROUPE_CUDA_ATTENTION=wgmma"));
  }
}

TEST_CASE("cuda cross-entropy matches the CPU, ignored rows included") {
  if (!gpu_or_skip()) return;
  backends be;
  // Small rows; GPT-2's padded vocabulary (16-bit rows in shared memory, 16-byte packs); GPT-2's
  // own vocabulary, odd (element-wise copies); fp32 rows take the two-read kernel.
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{37, 1000}, {6, 50304}, {5, 50257}};
  for (const auto& shape : shapes) {
    const std::int64_t N = shape.first, V = shape.second;  // plain names: INFO captures them
    for (dtype t : float_types) {
      INFO("dtype " << std::string(core::dtype_name(t)) << " N=" << N << " V=" << V);
      tensor tgt = random_tokens(N, V, 60);
      tgt.data<std::int32_t>()[3] = -1;
      if (N > 20) tgt.data<std::int32_t>()[20] = -100;
      const double rtol = rtol_for(t);
      tensor logits = rounded(random_host({N, V}, 61, 3.0f), t);
      tensor lref = logits.clone(), loss_ref = tensor::zeros({N});
      be.cpu->cross_entropy(lref, tgt, loss_ref, 0.25f);
      tensor gtgt = be.gpu->from_host(tgt);
      tensor glog = upload(*be.gpu, logits, t);
      tensor gloss = poisoned(*be.gpu, {N}, dtype::f32);
      be.gpu->cross_entropy(glog, gtgt, gloss, 0.25f);
      check_close(download(*be.gpu, gloss), loss_ref, t == dtype::f32 ? fp32_rtol : 1e-3, "losses (fp32)");
      check_close(download(*be.gpu, glog), lref, rtol, "dlogits");
      tensor glog2 = upload(*be.gpu, logits, t);
      tensor gloss2 = poisoned(*be.gpu, {N}, dtype::f32);
      be.gpu->cross_entropy(glog2, gtgt, gloss2, 0.0f);
      check_close(download(*be.gpu, gloss2), loss_ref, t == dtype::f32 ? fp32_rtol : 1e-3, "losses without gradient");
      CHECK(same_bits(be.gpu->to_host(glog2), host_as(logits, t)));  // logits untouched
    }
  }
}

TEST_CASE("cuda LM head over padded logits rows (logits_width) matches the CPU's unpadded ops, the padding never read") {
  if (!gpu_or_skip()) return;
  backends be;
  // Rows of V classes padded to W = logits_width(V): a tiny odd vocabulary (only the few-rows GEMM
  // runs), one past a multiple of 64, and GPT-2's 50,257 (an aligned GEMM and a 17-row one).
  const std::int64_t N = 40, IC = 64;
  for (std::int64_t V : {std::int64_t{37}, std::int64_t{129}, std::int64_t{50257}}) {
    const std::int64_t W = be.gpu->logits_width(V);
    CHECK(W % 64 == 0);
    CHECK(W >= V);
    CHECK(W < V + 64);
    CHECK(be.cpu->logits_width(V) == V);
    // [N, V] into [N, W] with `pad` in the extra columns, and back.
    auto widen = [&](const tensor& h, float pad) {
      tensor out = tensor::zeros({N, W});
      for (std::int64_t r = 0; r < N; ++r)
        for (std::int64_t c = 0; c < W; ++c)
          out.data<float>()[r * W + c] = c < V ? h.data<float>()[r * V + c] : pad;
      return out;
    };
    auto narrow = [&](const tensor& h) {
      tensor out = tensor::zeros({N, V});
      for (std::int64_t r = 0; r < N; ++r)
        std::memcpy(out.data<float>() + r * V, h.data<float>() + r * W, sizeof(float) * V);
      return out;
    };
    auto padding_is = [&](const tensor& h, float want) {
      std::int64_t bad = 0;
      for (std::int64_t r = 0; r < N; ++r)
        for (std::int64_t c = V; c < W; ++c) bad += h.data<float>()[r * W + c] == want ? 0 : 1;
      return bad == 0;
    };
    for (dtype t : float_types) {
      INFO("dtype " << std::string(core::dtype_name(t)) << " V=" << V << " W=" << W);
      const double rtol = rtol_for(t);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      tensor x = rounded(random_host({N, IC}, 70), t), w = rounded(random_host({V, IC}, 71, 0.1f), t);
      tensor gx = upload(*be.gpu, x, t), gw = upload(*be.gpu, w, t);
      // Forward: the first V columns as the CPU's, the padding −∞.
      tensor y_ref = tensor::zeros({N, V});
      be.cpu->linear_forward(x, w, tensor{}, y_ref);
      tensor gy = poisoned(*be.gpu, {N, W}, t);
      be.gpu->linear_forward(gx, gw, tensor{}, gy);
      const tensor y = download(*be.gpu, gy);
      check_close(narrow(y), y_ref, rtol, "logits = x·wᵀ");
      CHECK(padding_is(y, -std::numeric_limits<float>::infinity()));
      // The cross-entropy over the padded rows: the losses and gradient of the unpadded rows, a
      // zero gradient in the padding.
      tensor tgt = random_tokens(N, V, 72);
      tgt.data<std::int32_t>()[0] = static_cast<std::int32_t>(V - 1);
      tensor y_cpu = rounded(y_ref, t), loss_ref = tensor::zeros({N});
      be.cpu->cross_entropy(y_cpu, tgt, loss_ref, 0.5f);
      tensor gl = upload(*be.gpu, widen(rounded(y_ref, t), -std::numeric_limits<float>::infinity()), t);
      tensor gloss = poisoned(*be.gpu, {N}, dtype::f32);
      be.gpu->cross_entropy(gl, be.gpu->from_host(tgt), gloss, 0.5f);
      check_close(download(*be.gpu, gloss), loss_ref, t == dtype::f32 ? fp32_rtol : 1e-3, "losses");
      const tensor dl = download(*be.gpu, gl);
      check_close(narrow(dl), y_cpu, rtol, "dlogits");
      CHECK(padding_is(dl, 0.0f));
      // The backward reads the first V columns only: NaN in the padding changes nothing.
      tensor dy = rounded(random_host({N, V}, 73), t);
      tensor gdy = upload(*be.gpu, widen(dy, nan), t);
      tensor dx0 = rounded(random_host({N, IC}, 74), t);
      tensor dx_ref = dx0.clone();
      be.cpu->linear_backward_input(dy, w, dx_ref);
      tensor gdx = run_twice(*be.gpu, dx0, t, [&](tensor& dx) { be.gpu->linear_backward_input(gdy, gw, dx); },
                             "dx deterministic");
      check_close(gdx, dx_ref, rtol, "dx += dy·w");
      tensor dw0 = random_host({V, IC}, 75), dw_ref = dw0.clone(), none;
      be.cpu->linear_backward_weight(dy, x, dw_ref, none);
      tensor gdw = upload(*be.gpu, dw0, dtype::f32), gnone;
      be.gpu->linear_backward_weight(gdy, gx, gdw, gnone);
      check_close(download(*be.gpu, gdw), dw_ref, rtol, "fp32 dw += dyᵀ·x");
    }
  }
}

TEST_CASE("cuda sumsq_blocks_list gives each tensor's sumsq_blocks bits, over several launches") {
  if (!gpu_or_skip()) return;
  backends be;
  // 300 tensors (three launches of at most 128): partial blocks, empty ones, views at offsets that
  // are not 16-byte aligned (the scalar path) and whole blocks (the float4 path).
  std::vector<std::pair<std::int64_t, std::int64_t>> parts;  // (offset, length)
  std::int64_t at = 0, total = 0;
  for (int i = 0; i < 300; ++i) {
    const std::int64_t len = i % 7 == 3 ? 0 : (i % 5 == 0 ? 2 * norm_block : 100 + 37 * i);
    const std::int64_t off = i % 3 == 1 ? at + 1 : at;
    parts.emplace_back(off, len);
    at = off + len;
    total += (len + norm_block - 1) / norm_block;
  }
  tensor gx = be.gpu->from_host(random_host({at}, 75));
  std::vector<tensor> xs;
  for (const auto& [off, len] : parts) xs.push_back(gx.slice(off, {len}));
  tensor out = be.gpu->empty({total}, dtype::f64);
  be.gpu->sumsq_blocks_list(xs, out);
  const tensor got = be.gpu->to_host(out);
  tensor cpu_out = be.cpu->empty({total}, dtype::f64);
  std::vector<tensor> host_xs;
  const tensor hx = be.gpu->to_host(gx);
  std::int64_t b = 0;
  for (const tensor& x : xs) {
    const std::int64_t nb = (x.numel() + norm_block - 1) / norm_block;
    if (nb == 0) continue;
    tensor one = be.gpu->empty({nb}, dtype::f64);
    be.gpu->sumsq_blocks(x, one);
    const tensor h = be.gpu->to_host(one);
    CAPTURE(b);
    CHECK(std::memcmp(got.data<double>() + b, h.data<double>(), nb * sizeof(double)) == 0);
    b += nb;
  }
  CHECK(b == total);
  // Against the CPU backend's default (one sumsq_blocks per tensor), to rounding.
  for (const tensor& x : xs)
    host_xs.push_back(hx.slice((static_cast<const char*>(x.raw()) - static_cast<const char*>(gx.raw())) /
                                   static_cast<std::int64_t>(sizeof(float)),
                               {x.numel()}));
  be.cpu->sumsq_blocks_list(host_xs, cpu_out);
  for (std::int64_t i = 0; i < total; ++i)
    CHECK(got.data<double>()[i] == doctest::Approx(cpu_out.data<double>()[i]).epsilon(1e-12));
}

TEST_CASE("cuda sumsq_blocks, adamw and has_nonfinite match the CPU") {
  if (!gpu_or_skip()) return;
  backends be;
  const std::int64_t n = 5 * norm_block + 77;
  tensor x = random_host({n}, 70);
  tensor ss_ref = tensor::zeros({6}, dtype::f64);
  be.cpu->sumsq_blocks(x, ss_ref);
  tensor gss = be.gpu->empty({6}, dtype::f64);
  be.gpu->sumsq_blocks(be.gpu->from_host(x), gss);
  tensor hss = be.gpu->to_host(gss);
  for (int i = 0; i < 6; ++i)
    CHECK(hss.data<double>()[i] == doctest::Approx(ss_ref.data<double>()[i]).epsilon(1e-12));

  tensor p = random_host({n}, 71), g = random_host({n}, 72), m = random_host({n}, 73, 0.1f);
  tensor v = random_host({n}, 74, 0.1f);
  for (std::int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
  adamw_params ap;
  ap.lr = 1e-3f;
  ap.weight_decay = 0.1f;
  ap.grad_scale = 0.5f;
  ap.step = 3;
  tensor p_ref = p.clone(), m_ref = m.clone(), v_ref = v.clone(), low_ref = tensor::zeros({n}, dtype::bf16);
  be.cpu->adamw(p_ref, g, m_ref, v_ref, ap, low_ref);
  tensor gp = be.gpu->from_host(p), gm = be.gpu->from_host(m), gv = be.gpu->from_host(v);
  tensor glow = poisoned(*be.gpu, {n}, dtype::bf16);
  be.gpu->adamw(gp, be.gpu->from_host(g), gm, gv, ap, glow);
  check_close(be.gpu->to_host(gp), p_ref, fp32_rtol, "adamw param");
  check_close(be.gpu->to_host(gm), m_ref, fp32_rtol, "adamw m");
  check_close(be.gpu->to_host(gv), v_ref, fp32_rtol, "adamw v");
  check_close(download(*be.gpu, glow), host_f32(low_ref), bf16_rtol, "adamw bf16 copy");

  for (dtype t : float_types) {
    tensor clean = upload(*be.gpu, x, t);
    CHECK_FALSE(be.gpu->has_nonfinite(clean));
    tensor bad = x.clone();
    bad.data<float>()[n - 1] = std::numeric_limits<float>::infinity();
    CHECK(be.gpu->has_nonfinite(upload(*be.gpu, bad, t)));
    bad.data<float>()[n - 1] = 0;
    bad.data<float>()[1234] = std::numeric_limits<float>::quiet_NaN();
    CHECK(be.gpu->has_nonfinite(upload(*be.gpu, bad, t)));
  }
}


TEST_CASE("time marks: the CPU's are the host clock; the GPU's time the stream's work, after it") {
  auto cpu = make_backend("cpu");
  const auto before = std::chrono::steady_clock::now();
  auto c0 = cpu->mark_time();
  auto c1 = cpu->mark_time();
  const auto ct = cpu->mark_times({c0, c1});
  REQUIRE(ct.size() == 2);
  CHECK(ct[0] >= before);
  CHECK(ct[1] >= ct[0]);
  if (!gpu_or_skip()) return;
#ifdef TROUPE_HAVE_CUDA
  auto gpu = make_backend("cuda");
  auto* be = dynamic_cast<cuda::cuda_backend*>(gpu.get());
  REQUIRE(be != nullptr);
  CHECK_THROWS_AS(gpu->mark_times({c0}), core::failure);  // another backend's mark
  const auto queued = std::chrono::steady_clock::now();
  auto m0 = gpu->mark_time();
  cuda::debug_spin(be->stream(), 20'000'000);  // 20 ms of device work
  auto m1 = gpu->mark_time();
  // Queueing returns at once; the marks say when the device ran it.
  CHECK(std::chrono::steady_clock::now() - queued < std::chrono::milliseconds(15));
  const auto t = gpu->mark_times({m0, m1});
  const double ms = std::chrono::duration<double, std::milli>(t[1] - t[0]).count();
  CHECK(ms >= 19.9);
  CHECK(ms < 40);
  CHECK(t[0] >= queued - std::chrono::milliseconds(1));  // anchored to the host clock
  CHECK(t[1] <= std::chrono::steady_clock::now());
  // Dropped marks' events are reused: a later pair, taken from the pool, times its own work.
  m0.reset();
  m1.reset();
  auto n0 = gpu->mark_time();
  cuda::debug_spin(be->stream(), 5'000'000);
  auto n1 = gpu->mark_time();
  auto n2 = gpu->mark_time();  // right after n1, no work between
  const auto u = gpu->mark_times({n0, n1, n2});
  const double ms2 = std::chrono::duration<double, std::milli>(u[1] - u[0]).count();
  CHECK(ms2 >= 4.9);
  CHECK(ms2 < 25);
  CHECK(u[0] >= t[1]);
  CHECK(u[2] >= u[1]);
  CHECK(std::chrono::duration<double, std::milli>(u[2] - u[1]).count() < 2);
#endif
}

TEST_CASE("cuda allocator: a block another stream still reads stays out of reuse until that stream "
          "passes its event, however often the cache is polled") {
  if (!gpu_or_skip()) return;
#ifdef TROUPE_HAVE_CUDA
  cuda::device_allocator alloc(0);
  cudaStream_t other = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess);
  const std::size_t bytes = std::size_t{4} << 20;
  // The other stream "reads" the block for 300 ms; its event marks the end of that.
  void* p = alloc.allocate(bytes);
  cuda::debug_spin(other, 300'000'000);
  cudaEvent_t done = alloc.take_event();
  REQUIRE(cudaEventRecord(done, other) == cudaSuccess);
  alloc.release_after(p, {done});
  // Every allocation polls the pending blocks; none may hand p out while the stream works.
  std::vector<void*> got;
  for (int i = 0; i < 6; ++i) {
    got.push_back(alloc.allocate(bytes));
    CHECK(got.back() != p);
  }
  CHECK(cudaEventQuery(done) == cudaErrorNotReady);  // the checks above ran while it worked
  cudaGetLastError();
  REQUIRE(cudaStreamSynchronize(other) == cudaSuccess);
  // Once it has passed the event, the block serves again.
  for (void* q : got) alloc.release(q);
  bool back = false;
  for (int i = 0; i < 7; ++i) back = back || alloc.allocate(bytes) == p;
  CHECK(back);
  cudaStreamDestroy(other);
#endif
}

TEST_CASE("cuda allocator: a pending block of the class serves the next allocation at once, its "
          "new user's stream waiting on the device for the streams that still read it") {
  if (!gpu_or_skip()) return;
#ifdef TROUPE_HAVE_CUDA
  cuda::device_allocator alloc(0);
  cudaStream_t mine = nullptr, other = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess);
  alloc.set_stream(mine);
  const std::size_t bytes = std::size_t{4} << 20;
  void* p = alloc.allocate(bytes);
  REQUIRE(cudaMemset(p, 0x11, bytes) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const auto before = alloc.stats();
  // The other stream reads the block after 300 ms of work, then releases it with its event.
  void* copy = nullptr;
  REQUIRE(cudaMalloc(&copy, bytes) == cudaSuccess);
  cuda::debug_spin(other, 300'000'000);
  REQUIRE(cudaMemcpyAsync(copy, p, bytes, cudaMemcpyDeviceToDevice, other) == cudaSuccess);
  cudaEvent_t done = alloc.take_event();
  REQUIRE(cudaEventRecord(done, other) == cudaSuccess);
  alloc.release_after(p, {done});
  CHECK(alloc.stats().in_use == before.in_use - bytes);  // cached, not in use
  // The next allocation of the class takes it without a cudaMalloc and without the host waiting,
  // and what its user writes on `mine` lands only after the other stream's read.
  void* q = alloc.allocate(bytes);
  CHECK(q == p);
  CHECK(alloc.stats().device_mallocs == before.device_mallocs);
  CHECK(cudaEventQuery(done) == cudaErrorNotReady);  // the host did not wait
  cudaGetLastError();
  REQUIRE(cudaMemsetAsync(q, 0x22, bytes, mine) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<unsigned char> host(bytes);
  REQUIRE(cudaMemcpy(host.data(), copy, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::count(host.begin(), host.end(), 0x11) == static_cast<long>(bytes));
  REQUIRE(cudaMemcpy(host.data(), q, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::count(host.begin(), host.end(), 0x22) == static_cast<long>(bytes));
  alloc.release(q);
  cudaFree(copy);
  cudaStreamDestroy(other);
  cudaStreamDestroy(mine);
#endif
}

}  // namespace troupe::kernels::cuda_test
