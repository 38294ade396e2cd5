// The CUDA paths that the GPT-2 step spends its non-GEMM time in, at the sizes where their fast
// paths engage: the one-launch AdamW over runs of a flat buffer (against the CPU and against one
// adamw launch per run, bit for bit), LayerNorm over enough rows that each warp does several, and
// cross-entropy at GPT-2's vocabulary. Skips without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/kernels/cuda_test_util.hpp"
#include "tests/kernels/norm_blocks_fixture.hpp"
#include "kernels/message_hash.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cuda_test {
namespace {

struct backends {
  std::unique_ptr<backend> cpu = make_backend("cpu");
  std::unique_ptr<backend> gpu = make_backend("cuda");
};

/// `count` runs spaced `spacing` apart from `first`, of lengths 1 .. spacing - 1 (odd ones
/// included, so vector groups end early), decay alternating every third run.
std::vector<adamw_run> spaced_runs(int count, std::int64_t first, std::int64_t spacing) {
  std::vector<adamw_run> runs;
  for (int k = 0; k < count; ++k) {
    const std::int64_t b = first + k * spacing, len = 1 + (k * 37) % (spacing - 1);
    runs.push_back({b, b + len, k % 3 != 0});
  }
  return runs;
}

}  // namespace

TEST_CASE("cuda adamw_runs matches the CPU and one adamw launch per run bit for bit, gaps "
          "untouched") {
  if (!gpu_or_skip()) return;
  backends be;
  const std::int64_t spacing = 400;
  // 170 runs: more than one launch's table; first at 0 (16-byte packs) and at 1 (scalar path).
  for (std::int64_t first : {0, 1}) {
    for (dtype lt : {dtype::bf16, dtype::f16}) {
      INFO("first run at " << first << ", low " << core::dtype_name(lt));
      const std::vector<adamw_run> runs = spaced_runs(170, first, spacing);
      const std::int64_t n = first + 170 * spacing + 5;
      tensor p = random_host({n}, 80), g = random_host({n}, 81), m = random_host({n}, 82, 0.1f);
      tensor v = random_host({n}, 83, 0.1f);
      for (std::int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
      adamw_params ap;
      ap.lr = 2e-3f;
      ap.weight_decay = 0.1f;
      ap.grad_scale = 0.6f;
      ap.step = 4;

      tensor p_ref = p.clone(), m_ref = m.clone(), v_ref = v.clone();
      tensor low_ref = tensor::zeros({n}, lt);
      be.cpu->adamw_runs(p_ref, g, m_ref, v_ref, runs, ap, low_ref);

      tensor gg = be.gpu->from_host(g);
      auto fresh = [&] {
        return std::vector<tensor>{be.gpu->from_host(p), be.gpu->from_host(m), be.gpu->from_host(v),
                                   poisoned(*be.gpu, {n}, lt)};
      };
      std::vector<tensor> a = fresh(), b = fresh(), c = fresh();
      be.gpu->adamw_runs(a[0], gg, a[1], a[2], runs, ap, a[3]);
      be.gpu->adamw_runs(c[0], gg, c[1], c[2], runs, ap, c[3]);
      for (const adamw_run& r : runs) {
        const core::shape_t s{r.end - r.begin};
        tensor ps = b[0].slice(r.begin, s), ms = b[1].slice(r.begin, s),
               vs = b[2].slice(r.begin, s), ls = b[3].slice(r.begin, s);
        adamw_params q = ap;
        q.weight_decay = r.decay ? ap.weight_decay : 0.0f;
        be.gpu->adamw(ps, gg.slice(r.begin, s), ms, vs, q, ls);
      }
      for (int i = 0; i < 4; ++i) {
        INFO("buffer " << i << " (param, m, v, low)");
        const tensor ha = be.gpu->to_host(a[i]);
        CHECK(same_bits(ha, be.gpu->to_host(b[i])));
        CHECK(same_bits(ha, be.gpu->to_host(c[i])));
      }
      check_close(be.gpu->to_host(a[0]), p_ref, fp32_rtol, "param");
      check_close(be.gpu->to_host(a[1]), m_ref, fp32_rtol, "m");
      check_close(be.gpu->to_host(a[2]), v_ref, fp32_rtol, "v");
      // Low elements of the runs are the rounded params; gap elements keep their poison.
      const tensor low = download(*be.gpu, a[3]), pa = be.gpu->to_host(a[0]);
      const tensor low_want = rounded(pa, lt);
      std::int64_t wrong = 0, touched_gaps = 0;
      std::size_t r = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        while (r < runs.size() && runs[r].end <= i) ++r;
        const bool in_run = r < runs.size() && runs[r].begin <= i;
        const float got = low.data<float>()[i];
        if (in_run && got != low_want.data<float>()[i]) ++wrong;
        if (!in_run && !std::isnan(got)) ++touched_gaps;
        if (!in_run && pa.data<float>()[i] != p.data<float>()[i]) ++touched_gaps;
      }
      CHECK(wrong == 0);
      CHECK(touched_gaps == 0);
    }
  }
}

TEST_CASE("cuda adamw_runs_hashed: the bits of one adamw per run, and the message hash of what it "
          "wrote; adamw_runs by blocks the same bits") {
  if (!gpu_or_skip()) return;
  backends be;
  // Runs laid out as a chunk's flat buffer lays out tensors (each at a multiple of 1024 elements,
  // one 4096-byte hash block, padded after it; adjacent ones of one decay merged), 170 of them:
  // two launches, the second beginning on a block.
  std::vector<adamw_run> chunk;
  for (int k = 0; k < 170; ++k) {
    const std::int64_t b = 1024 * (k + k / 5), len = k % 4 == 0 ? 1024 : 1 + (k * 389) % 1023;
    chunk.push_back({b, b + len, k % 3 != 0});
  }
  std::vector<adamw_run> chunk_tail = chunk;
  chunk_tail.push_back({1024 * 205, 1024 * 205 + 300, true});
  struct layout {
    const char* what;
    std::vector<adamw_run> runs;
    std::int64_t n;
    std::int64_t offset;  // elements into the buffers (not a multiple of 4: no 16-byte groups)
    bool low, nan_factor;
  };
  const std::vector<layout> cases = {
      {"tensors of a chunk, two launches, a last short block", chunk_tail, 1024 * 205 + 333, 0, true, false},
      {"the same, no low copy", chunk_tail, 1024 * 205 + 333, 0, false, false},
      {"one run over whole blocks", {{0, 1024 * 9, true}}, 1024 * 9, 0, true, false},
      {"one block, shorter than 4096 bytes", {{4, 200, false}, {204, 299, true}}, 300, 0, true, false},
      {"no runs: hashed, not updated", {}, 5000, 0, true, false},
      {"a non-finite grad_factor: hashed, not updated", chunk, 1024 * 205, 0, true, true},
      {"runs spaced 400 apart: the second launch inside a block", spaced_runs(170, 0, 400),
       170 * 400 + 5, 0, true, false},
      {"runs spaced 400 apart, one launch: blocks with run ends and gaps", spaced_runs(100, 0, 400),
       100 * 400 + 5, 0, true, false},
      {"buffers not 16-byte aligned", spaced_runs(20, 3, 400), 20 * 400 + 7, 1, true, false},
  };
  for (const layout& c : cases) {
    for (dtype lt : {dtype::bf16, dtype::f16}) {
      if (!c.low && lt == dtype::f16) continue;
      INFO(c.what << ", low " << (c.low ? core::dtype_name(lt) : "none"));
      const std::int64_t n = c.n, total = c.n + c.offset;
      tensor p = random_host({total}, 180), g = random_host({total}, 181);
      tensor m = random_host({total}, 182, 0.1f), v = random_host({total}, 183, 0.1f);
      for (std::int64_t i = 0; i < total; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
      adamw_params ap;
      ap.lr = 2e-3f;
      ap.weight_decay = 0.1f;
      ap.grad_scale = 0.6f;
      ap.step = 4;
      if (c.nan_factor) {
        tensor f = tensor::zeros({1}, dtype::f64);
        f.data<double>()[0] = std::numeric_limits<double>::quiet_NaN();
        ap.grad_factor = be.gpu->from_host(f);
      }
      auto fresh = [&] {
        auto at = [&](const tensor& t) { return be.gpu->from_host(t).slice(c.offset, {n}); };
        return std::vector<tensor>{at(p), at(m), at(v),
                                   c.low ? poisoned(*be.gpu, {total}, lt).slice(c.offset, {n})
                                         : tensor{}};
      };
      const tensor gg = be.gpu->from_host(g).slice(c.offset, {n});
      std::vector<tensor> a = fresh(), b = fresh(), ref = fresh();
      const auto count = static_cast<std::int64_t>(message_hash_blocks_of(static_cast<std::size_t>(n) * 4));
      tensor blocks = be.gpu->empty({count}, dtype::i64);
      be.gpu->adamw_runs_hashed(a[0], gg, a[1], a[2], c.runs, ap, a[3], blocks);
      be.gpu->adamw_runs(b[0], gg, b[1], b[2], c.runs, ap, b[3]);
      // The reference: one adamw launch per run (adamw_kernel, its own code).
      for (const adamw_run& r : c.runs) {
        const core::shape_t sh{r.end - r.begin};
        tensor ps = ref[0].slice(r.begin, sh), ms = ref[1].slice(r.begin, sh),
               vs = ref[2].slice(r.begin, sh);
        tensor ls = ref[3].defined() ? ref[3].slice(r.begin, sh) : tensor{};
        adamw_params q = ap;
        q.weight_decay = r.decay ? ap.weight_decay : 0.0f;
        be.gpu->adamw(ps, gg.slice(r.begin, sh), ms, vs, q, ls);
      }
      for (int i = 0; i < 4; ++i) {
        if (!a[i].defined()) continue;
        INFO("buffer " << i << " (param, m, v, low)");
        const tensor want = be.gpu->to_host(ref[i]);
        CHECK(same_bits(be.gpu->to_host(a[i]), want));
        CHECK(same_bits(be.gpu->to_host(b[i]), want));
      }
      const tensor written = be.gpu->to_host(a[0]);
      if (c.nan_factor || c.runs.empty())
        CHECK(same_bits(written, p.slice(c.offset, {n}).clone()));
      else
        CHECK_FALSE(same_bits(written, p.slice(c.offset, {n}).clone()));
      // Every block's digest, and the hash finished from them, are the CPU twin's.
      std::vector<std::uint64_t> want(static_cast<std::size_t>(count));
      message_hash_blocks(written.raw(), written.bytes(), want.data());
      const tensor got = be.gpu->to_host(blocks);
      std::int64_t wrong = 0;
      for (std::int64_t i = 0; i < count; ++i)
        wrong += got.data<std::uint64_t>()[i] != want[static_cast<std::size_t>(i)];
      CHECK(wrong == 0);
      CHECK(be.gpu->message_hash_of_blocks_async(blocks, written.bytes())->get() ==
            message_hash(written.raw(), written.bytes()));
    }
  }
}

TEST_CASE("cuda message_hash_of_blocks_async: the CPU twin's hash for every level count") {
  if (!gpu_or_skip()) return;
  backends be;
  // No block, one short and one full block, two blocks, and digests that fill more than a block.
  for (std::int64_t elems : {0, 7, 1024, 1025, 1024 * 512, 1024 * 512 + 1, 1024 * 1300}) {
    INFO("fp32 elements: " << elems);
    const tensor x = random_host({elems}, 190);
    const std::size_t bytes = x.bytes();
    const auto count = static_cast<std::int64_t>(message_hash_blocks_of(bytes));
    tensor host_blocks = tensor::zeros({count}, dtype::i64);
    if (count > 0) message_hash_blocks(x.raw(), bytes, host_blocks.data<std::uint64_t>());
    const std::uint64_t want = message_hash(x.raw(), bytes);
    CHECK(message_hash_of_blocks(host_blocks.data<std::uint64_t>(), bytes) == want);
    CHECK(be.gpu->message_hash_of_blocks_async(be.gpu->from_host(host_blocks), bytes)->get() == want);
    CHECK(be.cpu->message_hash_of_blocks_async(host_blocks, bytes)->get() == want);
  }
}

TEST_CASE("cuda message_hash_sumsq_blocks: the CPU twin's digests, and each tensor's sumsq_blocks "
          "bits in place") {
  if (!gpu_or_skip()) return;
  backends be;
  struct layout {
    const char* what;
    testing::norm_layout l;
    std::int64_t offset;  // elements into the buffer: 1 is not 16-byte aligned (the default's path)
  };
  const std::vector<layout> cases = {
      {"a chunk's tensors, every fifth not counted", testing::assorted_layout(170, 0), 0},
      {"the same with a last short block", testing::assorted_layout(170, 333), 0},
      {"one tensor, one short block", {{{0, 700, true}}, 800}, 0},
      {"nothing counted", {{{0, 5000, false}}, 6144}, 0},
      {"not 16-byte aligned", testing::assorted_layout(20, 7), 1},
  };
  for (const layout& c : cases) {
    INFO(c.what);
    const tensor host = random_host({c.l.numel + c.offset}, 220);
    const tensor x = be.gpu->from_host(host).slice(c.offset, {c.l.numel});
    const tensor xh = host.slice(c.offset, {c.l.numel}).clone();
    const tensor counts = testing::counts_of(c.l);
    const std::int64_t nb = counts.numel();
    tensor blocks = poisoned(*be.gpu, {nb}, dtype::i64), sums = poisoned(*be.gpu, {nb}, dtype::f64);
    be.gpu->message_hash_sumsq_blocks(x, be.gpu->from_host(counts), blocks, sums);
    std::vector<std::uint64_t> want(static_cast<std::size_t>(nb));
    message_hash_blocks(xh.raw(), xh.bytes(), want.data());
    const tensor got = be.gpu->to_host(blocks);
    std::int64_t wrong = 0;
    for (std::int64_t b = 0; b < nb; ++b) wrong += got.data<std::uint64_t>()[b] != want[b];
    CHECK(wrong == 0);
    CHECK(be.gpu->message_hash_of_blocks_async(blocks, x.bytes())->get() ==
          message_hash(xh.raw(), xh.bytes()));
    // The sums: the bits the GPU's sumsq_blocks_list gives the counted tensors (what a shard
    // computes without the stage's sums), 0 elsewhere; the CPU twin's to rounding.
    std::vector<std::int64_t> first;
    const auto views = testing::counted_views(c.l, x, &first);
    std::int64_t listed = 0;
    for (const tensor& v : views) listed += (v.numel() + norm_block - 1) / norm_block;
    tensor list = poisoned(*be.gpu, {listed}, dtype::f64);
    be.gpu->sumsq_blocks_list(views, list);
    const tensor list_h = be.gpu->to_host(list), sums_h = be.gpu->to_host(sums);
    tensor cpu_sums = tensor::zeros({nb}, dtype::f64), cpu_blocks = tensor::zeros({nb}, dtype::i64);
    be.cpu->message_hash_sumsq_blocks(xh, counts, cpu_blocks, cpu_sums);
    std::vector<double> expect(static_cast<std::size_t>(nb), 0.0);
    std::int64_t at = 0;
    for (std::size_t k = 0; k < views.size(); ++k) {
      const std::int64_t n = (views[k].numel() + norm_block - 1) / norm_block;
      for (std::int64_t i = 0; i < n; ++i) expect[first[k] + i] = list_h.data<double>()[at + i];
      at += n;
    }
    std::int64_t differ = 0, far = 0;
    for (std::int64_t b = 0; b < nb; ++b) {
      const double g = sums_h.data<double>()[b], cpu = cpu_sums.data<double>()[b];
      differ += std::memcmp(&g, &expect[b], sizeof(double)) != 0;
      far += !(std::fabs(g - cpu) <= 1e-12 * std::fabs(cpu));
    }
    CHECK(differ == 0);
    CHECK(far == 0);
  }
}

TEST_CASE("cuda adamw_runs rejects overlapping runs and runs outside the buffers") {
  if (!gpu_or_skip()) return;
  backends be;
  tensor p = be.gpu->empty({100}, dtype::f32), g = be.gpu->empty({100}, dtype::f32);
  tensor m = be.gpu->empty({100}, dtype::f32), v = be.gpu->empty({100}, dtype::f32), none;
  adamw_params ap;
  auto message = [&](std::vector<adamw_run> runs) {
    try {
      be.gpu->adamw_runs(p, g, m, v, runs, ap, none);
    } catch (const core::failure& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(message({{0, 50, true}, {40, 60, false}}).find("overlap") != std::string::npos);
  CHECK(message({{90, 101, true}}).find("not a range") != std::string::npos);
}

TEST_CASE("cuda layernorm over many rows matches the CPU, deterministically, wide rows included") {
  if (!gpu_or_skip()) return;
  backends be;
  // 3000 rows: every warp of the row-cached kernels takes several rows; C 1600 (GPT-2 1.5B) and
  // 1024 are wide rows; C 2052 takes the plain kernels (too wide to cache in fp32 packs; not a
  // multiple of 8 in bf16).
  for (auto shape : {std::pair<std::int64_t, std::int64_t>{3000, 768}, {2000, 1600}, {300, 1024},
                     {40, 2052}, {1, 64}}) {
    const std::int64_t N = shape.first, C = shape.second;  // plain names: INFO captures them
    for (dtype t : {dtype::f32, dtype::bf16}) {
      INFO("dtype " << core::dtype_name(t) << ", N " << N << ", C " << C);
      const double rtol = rtol_for(t);
      tensor x = rounded(random_host({N, C}, 90, 1.5f), t);
      tensor w = rounded(random_host({C}, 91), t), b = rounded(random_host({C}, 92), t);
      tensor dy = rounded(random_host({N, C}, 93), t), dx0 = rounded(random_host({N, C}, 94), t);
      tensor dw0 = random_host({C}, 95), db0 = random_host({C}, 96);
      tensor gx = upload(*be.gpu, x, t), gw = upload(*be.gpu, w, t), gb = upload(*be.gpu, b, t);
      tensor gdy = upload(*be.gpu, dy, t);

      tensor y_ref = tensor::zeros({N, C}), mean_ref = tensor::zeros({N}),
             rstd_ref = tensor::zeros({N});
      be.cpu->layernorm_forward(x, w, b, 1e-5f, y_ref, mean_ref, rstd_ref);
      tensor gy = poisoned(*be.gpu, {N, C}, t), gmean = poisoned(*be.gpu, {N}, dtype::f32),
             grstd = poisoned(*be.gpu, {N}, dtype::f32);
      be.gpu->layernorm_forward(gx, gw, gb, 1e-5f, gy, gmean, grstd);
      check_close(download(*be.gpu, gy), y_ref, rtol, "y");
      check_close(download(*be.gpu, gmean), mean_ref, fp32_rtol, "mean");
      check_close(download(*be.gpu, grstd), rstd_ref, fp32_rtol, "rstd");

      tensor dx_ref = dx0.clone(), dw_ref = dw0.clone(), db_ref = db0.clone();
      be.cpu->layernorm_backward(dy, x, w, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref);
      std::vector<tensor> first;
      for (int rep = 0; rep < 2; ++rep) {
        tensor gdx = upload(*be.gpu, dx0, t), gdw = upload(*be.gpu, dw0, dtype::f32),
               gdb = upload(*be.gpu, db0, dtype::f32);
        be.gpu->layernorm_backward(gdy, gx, gw, gmean, grstd, gdx, gdw, gdb);
        std::vector<tensor> got = {be.gpu->to_host(gdx), be.gpu->to_host(gdw),
                                   be.gpu->to_host(gdb)};
        if (rep == 0) {
          check_close(host_f32(got[0]), dx_ref, rtol, "dx");
          check_close(got[1], dw_ref, rtol, "dw");
          check_close(got[2], db_ref, rtol, "db");
          first = got;
        } else {
          for (int i = 0; i < 3; ++i) CHECK(same_bits(got[i], first[i]));
        }
      }
      // Without a bias gradient, dw and dx are the same.
      tensor gdx = upload(*be.gpu, dx0, t), gdw = upload(*be.gpu, dw0, dtype::f32), no_db;
      be.gpu->layernorm_backward(gdy, gx, gw, gmean, grstd, gdx, gdw, no_db);
      CHECK(same_bits(be.gpu->to_host(gdx), first[0]));
      CHECK(same_bits(be.gpu->to_host(gdw), first[1]));
      // With the residual read from its own buffer and dx written (NaN before), the same bits as
      // accumulating onto a dx that held the residual.
      tensor gres = upload(*be.gpu, dx0, t), gdx_w = poisoned(*be.gpu, {N, C}, t);
      tensor gdw_r = upload(*be.gpu, dw0, dtype::f32), gdb_r = upload(*be.gpu, db0, dtype::f32);
      tensor none;
      be.gpu->layernorm_backward_residual(gdy, gx, gw, gmean, grstd, gres, gdx_w, gdw_r, gdb_r,
                                          none);
      CHECK(same_bits(be.gpu->to_host(gdx_w), first[0]));
      CHECK(same_bits(be.gpu->to_host(gdw_r), first[1]));
      CHECK(same_bits(be.gpu->to_host(gdb_r), first[2]));
      // With the residual's column sums (a projection's bias gradient) from the same pass: dx,
      // dw and db keep their bits, the sums match the CPU's (into fp32 and into bf16) and repeat
      // bit for bit.
      const tensor rs0 = random_host({C}, 97), rs_ref = column_sums_f64(dx0, rs0);
      std::vector<tensor> with_rsum;
      for (int rep = 0; rep < 2; ++rep) {
        tensor gdx_s = poisoned(*be.gpu, {N, C}, t), gdw_s = upload(*be.gpu, dw0, dtype::f32);
        tensor gdb_s = upload(*be.gpu, db0, dtype::f32), grs = upload(*be.gpu, rs0, dtype::f32);
        be.gpu->layernorm_backward_residual(gdy, gx, gw, gmean, grstd, gres, gdx_s, gdw_s,
                                            gdb_s, grs);
        std::vector<tensor> got = {be.gpu->to_host(gdx_s), be.gpu->to_host(gdw_s),
                                   be.gpu->to_host(gdb_s), be.gpu->to_host(grs)};
        for (int i = 0; i < 3; ++i) CHECK(same_bits(got[i], first[i]));
        if (rep == 0) {
          check_close(got[3], rs_ref, rtol, "rsum");
          with_rsum = got;
        } else {
          CHECK(same_bits(got[3], with_rsum[3]));
        }
      }
      tensor grs16 = upload(*be.gpu, rs0, dtype::bf16), gdx_h = poisoned(*be.gpu, {N, C}, t);
      be.gpu->layernorm_backward_residual(gdy, gx, gw, gmean, grstd, gres, gdx_h, gdw_r, gdb_r,
                                          grs16);
      check_close(host_f32(be.gpu->to_host(grs16)), rs_ref, rtol_for(dtype::bf16), "rsum bf16");
      // sum_rows: the bias gradient's own pass, against the CPU.
      tensor gcs = upload(*be.gpu, rs0, dtype::f32);
      be.gpu->sum_rows(gres, gcs);
      check_close(be.gpu->to_host(gcs), rs_ref, rtol, "sum_rows");
      CHECK_THROWS(be.gpu->layernorm_backward_residual(gdy, gx, gw, gmean, grstd, gres, gres,
                                                       gdw_r, gdb_r, gcs));
    }
  }
}

TEST_CASE("cuda cross-entropy at GPT-2's vocabulary matches the CPU, masked logits included") {
  if (!gpu_or_skip()) return;
  backends be;
  const std::int64_t N = 24, V = 50304;
  tensor tgt = random_tokens(N, V, 100);
  tgt.data<std::int32_t>()[5] = -1;
  tgt.data<std::int32_t>()[7] = 4;  // not the masked entry 3 of row 7
  for (dtype t : {dtype::f32, dtype::bf16}) {
    INFO("dtype " << core::dtype_name(t));
    tensor logits = rounded(random_host({N, V}, 101, 4.0f), t);
    // Row 2 masked at its first 20000 entries (a thread's first packs are all −∞), row 7 at one.
    for (std::int64_t i = 0; i < 20000; ++i)
      if (i != tgt.data<std::int32_t>()[2]) logits.data<float>()[2 * V + i] = -INFINITY;
    logits.data<float>()[7 * V + 3] = -INFINITY;
    tensor lref = logits.clone(), loss_ref = tensor::zeros({N});
    be.cpu->cross_entropy(lref, tgt, loss_ref, 1.0f / 3);
    tensor gtgt = be.gpu->from_host(tgt);
    std::vector<tensor> first;
    for (int rep = 0; rep < 2; ++rep) {
      tensor glog = upload(*be.gpu, logits, t);
      tensor gloss = poisoned(*be.gpu, {N}, dtype::f32);
      be.gpu->cross_entropy(glog, gtgt, gloss, 1.0f / 3);
      std::vector<tensor> got = {be.gpu->to_host(gloss), be.gpu->to_host(glog)};
      if (rep == 0) {
        check_close(got[0], loss_ref, t == dtype::f32 ? fp32_rtol : 1e-3, "losses");
        check_close(host_f32(got[1]), lref, rtol_for(t), "dlogits");
        const tensor d = host_f32(got[1]);
        CHECK(d.data<float>()[2 * V + 10] == 0.0f);
        CHECK(d.data<float>()[7 * V + 3] == 0.0f);
        first = got;
      } else {
        CHECK(same_bits(got[0], first[0]));
        CHECK(same_bits(got[1], first[1]));
      }
    }
  }
}

}  // namespace troupe::kernels::cuda_test
