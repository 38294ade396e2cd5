// The generation ops of the CUDA backend (kernels/cuda/attention_decode.cu, rope and embedding at
// positions) against their CPU twins, fp32 and bf16: a prefill of prompts of different lengths in
// their slots, then a decode step of one row per slot, over grouped-query heads.
#include <doctest/doctest.h>

#include <vector>

#include "tests/kernels/cuda_test_util.hpp"

using namespace troupe;
using namespace troupe::kernels::cuda_test;

namespace {

tensor ids_host(const std::vector<std::int32_t>& v) {
  tensor t = tensor::zeros({static_cast<std::int64_t>(v.size())}, dtype::i32);
  std::copy(v.begin(), v.end(), t.data<std::int32_t>());
  return t;
}

}  // namespace

TEST_CASE("cuda kv_cache_write and attention_decode match the CPU in fp32 and bf16, GQA, D 64 and 80") {
  if (!gpu_or_skip()) return;
  auto cpu = kernels::make_backend("cpu");
  auto gpu = kernels::make_backend("cuda");
  for (dtype t : {dtype::f32, dtype::bf16}) {
    for (int D : {64, 80}) {
      CAPTURE(core::dtype_name(t));
      CAPTURE(D);
      const kernels::attention_dims d{0, 0, 6, 2, D};
      const std::int64_t w = (6 + 2 * 2) * D, kvw = 2 * D;
      const int slots = 3, positions = 70;
      // Prefill: prompts of 1, 37 and 66 tokens in slots 2, 0 and 1.
      std::vector<std::int32_t> slot, pos;
      const int lengths[3] = {1, 37, 66}, slot_of[3] = {2, 0, 1};
      for (int p = 0; p < 3; ++p)
        for (int i = 0; i < lengths[p]; ++i) slot.push_back(slot_of[p]), pos.push_back(i);
      const auto rows = static_cast<std::int64_t>(slot.size());
      const tensor qkv = rounded(random_host({rows, w}, 21 + D), t);
      tensor kc = tensor::zeros({slots, positions, kvw}), vc = tensor::zeros({slots, positions, kvw});
      tensor want = tensor::zeros({rows, 6 * D});
      cpu->kv_cache_write(qkv, ids_host(slot), ids_host(pos), d, kc, vc);
      cpu->attention_decode(qkv, ids_host(slot), ids_host(pos), kc, vc, d, want);

      tensor gk = upload(*gpu, tensor::zeros({slots, positions, kvw}), t);
      tensor gv = upload(*gpu, tensor::zeros({slots, positions, kvw}), t);
      const tensor g_qkv = upload(*gpu, qkv, t), g_slot = gpu->from_host(ids_host(slot)),
                   g_pos = gpu->from_host(ids_host(pos));
      gpu->kv_cache_write(g_qkv, g_slot, g_pos, d, gk, gv);
      CHECK(same_bits(host_as(kc, t), gpu->to_host(gk)));
      CHECK(same_bits(host_as(vc, t), gpu->to_host(gv)));
      const tensor got = written_twice(*gpu, {rows, 6 * D}, t, [&](tensor& out) {
        gpu->attention_decode(g_qkv, g_slot, g_pos, gk, gv, d, out);
      }, "prefill");
      check_close(got, rounded(want, t), rtol_for(t), "prefill attention");

      // Decode: one row per slot at its next position.
      const std::vector<std::int32_t> s2 = {2, 0, 1}, p2 = {1, 37, 66};
      const tensor q2 = rounded(random_host({3, w}, 99 + D), t);
      cpu->kv_cache_write(q2, ids_host(s2), ids_host(p2), d, kc, vc);
      tensor want2 = tensor::zeros({3, 6 * D});
      cpu->attention_decode(q2, ids_host(s2), ids_host(p2), kc, vc, d, want2);
      const tensor g_q2 = upload(*gpu, q2, t), g_s2 = gpu->from_host(ids_host(s2)),
                   g_p2 = gpu->from_host(ids_host(p2));
      gpu->kv_cache_write(g_q2, g_s2, g_p2, d, gk, gv);
      const tensor got2 = written_twice(*gpu, {3, 6 * D}, t, [&](tensor& out) {
        gpu->attention_decode(g_q2, g_s2, g_p2, gk, gv, d, out);
      }, "decode");
      check_close(got2, rounded(want2, t), rtol_for(t), "decode attention");
    }
  }
}

TEST_CASE("cuda rope and embedding at explicit positions match the CPU") {
  if (!gpu_or_skip()) return;
  auto cpu = kernels::make_backend("cpu");
  auto gpu = kernels::make_backend("cuda");
  const std::vector<std::int32_t> pos = {0, 5, 1023, 7, 300};
  const tensor x = random_host({5, 4 * 64}, 5);
  tensor want = tensor::zeros({5, 4 * 64});
  cpu->rope_forward_at(x, ids_host(pos), 4, 3, 64, kernels::rope_spec{500000.0}, want);
  const tensor g_pos = gpu->from_host(ids_host(pos)), g_x = upload(*gpu, x, dtype::f32);
  const tensor got = written_twice(*gpu, {5, 4 * 64}, dtype::f32, [&](tensor& y) {
    gpu->rope_forward_at(g_x, g_pos, 4, 3, 64, kernels::rope_spec{500000.0}, y);
  }, "rope_forward_at");
  check_close(got, want, fp32_rtol, "rope_forward_at");

  const tensor wte = random_host({50, 32}, 6), wpe = random_host({1024, 32}, 7);
  const tensor tok = random_tokens(5, 50, 8);
  tensor e_want = tensor::zeros({5, 32});
  cpu->embedding_forward_at(tok, wte, wpe, ids_host(pos), e_want);
  const tensor g_wte = upload(*gpu, wte, dtype::f32), g_wpe = upload(*gpu, wpe, dtype::f32),
               g_tok = gpu->from_host(tok);
  const tensor e_got = written_twice(*gpu, {5, 32}, dtype::f32, [&](tensor& out) {
    gpu->embedding_forward_at(g_tok, g_wte, g_wpe, g_pos, out);
  }, "embedding_forward_at");
  CHECK(same_bits(e_got, e_want));
}
