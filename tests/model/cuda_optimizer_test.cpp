// The optimizer step on the GPU as the trainer runs it: slots_of hands AdamW the chunk's bf16
// weight copy, so the one adamw_runs launch must leave exactly what params_updated() (a separate
// conversion of the fp32 master weights) would. Skips without a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "model/chunk.hpp"
#include "model/optimizer.hpp"
#include "tests/kernels/cuda_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cuda_test {

TEST_CASE("cuda adamw_update writes the chunk's bf16 weights as params_updated would") {
  if (!gpu_or_skip()) return;
  auto gpu = make_backend("cuda");
  core::model_config cfg;
  cfg.arch = core::arch_kind::gpt2;
  cfg.num_layers = 2;
  cfg.hidden_size = 64;
  cfg.num_heads = 2;
  cfg.seq_length = 32;
  cfg.vocab_size = 100;
  cfg.tie_embeddings = true;
  model::chunk c(cfg, model::partition(cfg, 1).at(0), *gpu, core::precision_kind::bf16);
  c.init(5);
  model::optimizer_state state = model::make_optimizer_state(*gpu, c);
  std::vector<model::param_slot> slots = model::slots_of(c, state);
  for (const model::param_slot& s : slots) REQUIRE(s.low.defined());
  // Gradients: random values over the whole flat buffer, padding included (which AdamW must skip).
  const std::int64_t n = c.flat_grads().numel();
  gpu->copy(random_host({n}, 3, 0.01f), c.flat_grads());
  core::optimizer_config opt;
  opt.lr = 1e-2;
  opt.weight_decay = 0.1;
  const tensor before = gpu->to_host(c.flat_params());
  model::adamw_update(*gpu, slots, opt, opt.lr, 1.0f, 0);
  const tensor low = gpu->to_host(c.flat_low());
  const tensor params = gpu->to_host(c.flat_params());
  CHECK_FALSE(same_bits(params, before));
  c.params_updated();
  CHECK(same_bits(gpu->to_host(c.flat_low()), low));
  // Padding between tensors stays zero in the master weights.
  std::int64_t covered = 0;
  for (const model::param_info& p : c.params()) covered += p.numel;
  std::int64_t nonzero_padding = 0;
  std::vector<char> in_param(static_cast<std::size_t>(n), 0);
  for (const model::param_info& p : c.params())
    std::fill(in_param.begin() + p.offset, in_param.begin() + p.offset + p.numel, 1);
  for (std::int64_t i = 0; i < n; ++i)
    if (!in_param[i] && params.data<float>()[i] != 0.0f) ++nonzero_padding;
  CHECK(covered < n);  // the case has padding to check
  CHECK(nonzero_padding == 0);
}

}  // namespace troupe::kernels::cuda_test
