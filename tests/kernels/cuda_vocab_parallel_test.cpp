// The vocabulary-parallel ops of the CUDA backend (kernels/cuda/vocab_parallel.cu, the vp_ ops of
// kernels/cuda/embedding.cu) against their CPU twins (kernels/vocab_parallel.cpp), and the split
// cross-entropy against the CPU's unsplit cross_entropy over the whole vocabulary: a vocabulary
// split over tp = 1, 2 and 3 ranks (the last rank's block padded), ignored rows, targets in every
// rank. Outputs are poisoned with NaN before each GPU call. Skips where no GPU is visible.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/kernels/cuda_test_util.hpp"

namespace troupe::kernels::cuda_test {
namespace {

struct split {
  std::int64_t rows, first, valid;  // the block's width (padded), its first id, its real columns
};

/// Rank k of tp's vocabulary rows of v ids: v padded to a multiple of tp, as
/// model::vocab_range_of splits it.
split split_of(std::int64_t v, int tp, int k) {
  const std::int64_t padded = (v + tp - 1) / tp * tp, rows = padded / tp, first = k * rows;
  return {rows, first, std::max<std::int64_t>(0, std::min(rows, v - first))};
}

/// Columns [s.first, s.first + s.valid) of full [n, v] in a block [n, s.rows], the padding `pad`.
tensor block_of(const tensor& full, const split& s, float pad) {
  const std::int64_t n = full.dim(0), v = full.dim(1);
  tensor out = tensor::zeros({n, s.rows});
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < s.rows; ++j)
      out.data<float>()[i * s.rows + j] = j < s.valid ? full.data<float>()[i * v + s.first + j] : pad;
  return out;
}

/// The real columns of block b [n, s.rows] written into full [n, v].
void unblock(const tensor& b, const split& s, tensor& full) {
  const std::int64_t n = full.dim(0), v = full.dim(1);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < s.valid; ++j)
      full.data<float>()[i * v + s.first + j] = b.data<float>()[i * s.rows + j];
}

bool padding_zero(const tensor& b, const split& s) {
  for (std::int64_t i = 0; i < b.dim(0); ++i)
    for (std::int64_t j = s.valid; j < s.rows; ++j)
      if (b.data<float>()[i * s.rows + j] != 0.0f) return false;
  return true;
}

}  // namespace

TEST_CASE("cuda vocabulary-parallel cross-entropy matches its CPU twin and the unsplit cross_entropy") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  const std::int64_t n = 24;
  const float grad_scale = 0.25f;
  for (std::int64_t v : {std::int64_t{37}, std::int64_t{1001}})
    for (int tp : {1, 2, 3}) {
      INFO("vocabulary ", v, ", tp ", tp);
      const tensor logits = random_host({n, v}, 91 + v, 3.0f);
      tensor tgt = random_tokens(n, v, 92);
      tgt.data<std::int32_t>()[3] = -1;  // ignored rows
      tgt.data<std::int32_t>()[10] = -1;
      tgt.data<std::int32_t>()[0] = static_cast<std::int32_t>(v - 1);  // the last id: the last rank
      // The reference: the CPU's cross-entropy over the whole vocabulary.
      tensor dref = logits.clone(), loss_ref = tensor::zeros({n});
      cpu->cross_entropy(dref, tgt, loss_ref, grad_scale);

      const tensor gtgt = gpu->from_host(tgt);
      std::vector<tensor> cpu_blocks, gpu_blocks;
      tensor maxima_cpu = tensor::zeros({tp * n}), maxima_gpu = tensor::zeros({tp * n});
      for (int k = 0; k < tp; ++k) {
        const split s = split_of(v, tp, k);
        // Padding columns hold a huge value: an op that reads them is caught.
        const tensor b = block_of(logits, s, 1e30f);
        cpu_blocks.push_back(b.clone());
        gpu_blocks.push_back(upload(*gpu, b, dtype::f32));
        tensor mc = tensor::zeros({n});
        cpu->vp_row_max(cpu_blocks[k], s.valid, mc);
        tensor mg = poisoned(*gpu, {n}, dtype::f32);
        gpu->vp_row_max(gpu_blocks[k], s.valid, mg);
        const tensor mgh = download(*gpu, mg);
        CHECK_MESSAGE(same_bits(mgh, mc), "row maxima, rank ", k);
        std::memcpy(maxima_cpu.data<float>() + k * n, mc.data<float>(), sizeof(float) * n);
        std::memcpy(maxima_gpu.data<float>() + k * n, mgh.data<float>(), sizeof(float) * n);
      }
      // Each rank's statistics; their sum over the ranks (rank order, as the group sums).
      const tensor gmax = gpu->from_host(maxima_gpu);
      tensor sums_cpu = tensor::zeros({2 * n}), sums_gpu = tensor::zeros({2 * n});
      for (int k = 0; k < tp; ++k) {
        const split s = split_of(v, tp, k);
        tensor sc = tensor::zeros({2 * n});
        cpu->vp_row_stats(cpu_blocks[k], s.valid, maxima_cpu, tgt, s.first, v, sc);
        tensor sg = poisoned(*gpu, {2 * n}, dtype::f32);
        gpu->vp_row_stats(gpu_blocks[k], s.valid, gmax, gtgt, s.first, v, sg);
        const tensor sgh = download(*gpu, sg);
        check_close(sgh, sc, fp32_rtol, "row statistics, rank " + std::to_string(k));
        for (std::int64_t i = 0; i < 2 * n; ++i) {
          sums_cpu.data<float>()[i] += sc.data<float>()[i];
          sums_gpu.data<float>()[i] += sgh.data<float>()[i];
        }
      }
      tensor lc = tensor::zeros({n});
      cpu->vp_losses(maxima_cpu, sums_cpu, tgt, lc);
      tensor lg = poisoned(*gpu, {n}, dtype::f32);
      gpu->vp_losses(gmax, gpu->from_host(sums_gpu), gtgt, lg);
      check_close(download(*gpu, lg), lc, fp32_rtol, "losses against the CPU twin");
      check_close(download(*gpu, lg), loss_ref, fp32_rtol, "losses against the unsplit cross_entropy");
      CHECK(download(*gpu, lg).data<float>()[3] == 0.0f);

      tensor dfull = tensor::zeros({n, v});
      for (int k = 0; k < tp; ++k) {
        const split s = split_of(v, tp, k);
        cpu->vp_softmax_grad(cpu_blocks[k], s.valid, maxima_cpu, sums_cpu, tgt, s.first, grad_scale);
        gpu->vp_softmax_grad(gpu_blocks[k], s.valid, gmax, gpu->from_host(sums_gpu), gtgt, s.first,
                             grad_scale);
        const tensor dg = download(*gpu, gpu_blocks[k]);
        check_close(dg, cpu_blocks[k], fp32_rtol, "d logits against the CPU twin, rank " + std::to_string(k));
        CHECK_MESSAGE(padding_zero(dg, s), "padding columns of rank ", k, " not zero");
        unblock(dg, s, dfull);
      }
      check_close(dfull, dref, fp32_rtol, "d logits against the unsplit cross_entropy");
    }
}

TEST_CASE("vocabulary-parallel ops on the CPU refuse a token or target outside the vocabulary; "
          "the CUDA ops write NaN") {
  auto cpu = make_backend("cpu");
  const std::int64_t n = 4, v = 10, c = 3;
  const tensor z = random_host({n, v}, 93);
  tensor tgt = random_tokens(n, v, 94);
  tgt.data<std::int32_t>()[2] = static_cast<std::int32_t>(v);
  tensor maxima = tensor::zeros({n});
  cpu->vp_row_max(z, v, maxima);
  tensor stats = tensor::zeros({2 * n});
  CHECK_THROWS_WITH(cpu->vp_row_stats(z, v, maxima, tgt, 0, v, stats),
                    doctest::Contains("target 10 at row 2 is outside the vocabulary [0, 10)"));
  const tensor wte = random_host({v, c}, 95);
  tensor out = tensor::zeros({n, c});
  CHECK_THROWS_WITH(cpu->vp_embedding_forward(tgt, wte, 0, v, v, tensor{}, 2, out),
                    doctest::Contains("token 10 at row 2 is outside the vocabulary"));
  if (!gpu_or_skip()) return;
  auto gpu = make_backend("cuda");
  tensor sg = poisoned(*gpu, {2 * n}, dtype::f32);
  gpu->vp_row_stats(gpu->from_host(z), v, gpu->from_host(maxima), gpu->from_host(tgt), 0, v, sg);
  const tensor s = download(*gpu, sg);
  CHECK(std::isnan(s.data<float>()[2]));
  CHECK(std::isfinite(s.data<float>()[1]));
  tensor og = poisoned(*gpu, {n, c}, dtype::f32);
  gpu->vp_embedding_forward(gpu->from_host(tgt), gpu->from_host(wte), 0, v, v, tensor{}, 2, og);
  const tensor o = download(*gpu, og);
  CHECK(std::isnan(o.data<float>()[2 * c]));
  CHECK(std::isfinite(o.data<float>()[1 * c]));
}

TEST_CASE("cuda vocabulary-parallel embedding forward and backward match the CPU twin") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  const std::int64_t v = 37, c = 24;
  const int seq = 8, batch = 3;
  const std::int64_t n = seq * batch;
  const tensor wte_full = random_host({v, c}, 95), wpe = random_host({seq, c}, 96);
  tensor tok = random_tokens(n, v, 97);
  tok.data<std::int32_t>()[5] = tok.data<std::int32_t>()[9] = 3;  // a repeated token
  tok.data<std::int32_t>()[0] = static_cast<std::int32_t>(v - 1);
  const tensor gtok = gpu->from_host(tok);
  const tensor dout = random_host({n, c}, 98);
  for (int tp : {1, 2, 3}) {
    INFO("tp ", tp);
    for (int k = 0; k < tp; ++k) {
      INFO("rank ", k);
      const split s = split_of(v, tp, k);
      tensor wte = tensor::zeros({s.rows, c});
      std::memcpy(wte.data<float>(), wte_full.data<float>() + s.first * c,
                  sizeof(float) * static_cast<std::size_t>(s.valid * c));
      const bool positions = k == 0;  // rank 0 adds the positions
      tensor oc = tensor::zeros({n, c});
      cpu->vp_embedding_forward(tok, wte, s.first, s.valid, v, positions ? wpe : tensor{}, seq, oc);
      tensor og = poisoned(*gpu, {n, c}, dtype::f32);
      gpu->vp_embedding_forward(gtok, gpu->from_host(wte), s.first, s.valid, v,
                                positions ? gpu->from_host(wpe) : tensor{}, seq, og);
      CHECK(same_bits(download(*gpu, og), oc));

      tensor dwte_c = random_host({s.rows, c}, 99), dwpe_c = random_host({seq, c}, 100);
      tensor dwte_g = gpu->from_host(dwte_c), dwpe_g = gpu->from_host(dwpe_c);
      cpu->vp_embedding_backward(dout, tok, s.first, s.valid, seq, dwte_c, dwpe_c);
      gpu->vp_embedding_backward(gpu->from_host(dout), gtok, s.first, s.valid, seq, dwte_g, dwpe_g);
      check_close(download(*gpu, dwte_g), dwte_c, fp32_rtol, "dwte");
      check_close(download(*gpu, dwpe_g), dwpe_c, fp32_rtol, "dwpe");
    }
  }
}

}  // namespace troupe::kernels::cuda_test
