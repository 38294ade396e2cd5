// LoRA on the GPU against the CPU: the adapters are composed of existing backend ops (no kernel of
// their own), so this checks the composition on the CUDA backend — LLaMA's column-block adapters
// in the fused q/k/v GEMM included. fp32: the loss and every trainable gradient agree with the
// CPU; bf16: step 0's loss equals the bf16 base model's bit for bit. Skips without a GPU.
#include <doctest/doctest.h>

#include <cstring>

#include "kernels/select.hpp"
#include "model/chunk.hpp"
#include "model/params.hpp"
#include "tests/kernels/cuda_test_util.hpp"

namespace troupe::kernels::cuda_test {
namespace {

core::model_config small(core::arch_kind arch) {
  core::model_config m;
  m.arch = arch;
  m.num_layers = 2;
  m.hidden_size = 128;
  m.num_heads = 2;
  m.num_kv_heads = arch == core::arch_kind::llama ? 1 : 2;
  m.ffn_hidden_size = arch == core::arch_kind::llama ? 256 : 512;
  m.seq_length = 64;
  m.vocab_size = 320;
  m.tie_embeddings = arch == core::arch_kind::gpt2;
  m.lora.rank = 8;
  m.lora.alpha = 16;
  m.lora.targets = arch == core::arch_kind::gpt2
                       ? std::vector<std::string>{"c_attn", "c_proj", "c_fc"}
                       : std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"};
  return m;
}

/// B set from a keyed stream so that every adapter path carries gradient.
void set_b(model::chunk& c, backend& be) {
  std::uint64_t seed = 500;
  for (const auto& p : c.params())
    if (p.name.find(".lora_B.") != std::string::npos) {
      tensor dst = c.param(p.name);
      be.copy(random_host(p.shape, seed++, 0.05f), dst);
    }
  c.params_updated();
}

}  // namespace

TEST_CASE("cuda lora: fp32 loss and adapter gradients agree with the CPU (gpt2 and llama)") {
  if (!gpu_or_skip()) return;
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    const core::model_config m = small(arch);
    const std::int64_t rows = 2 * m.seq_length;
    const tensor tok = random_tokens(rows, m.vocab_size, 31), tgt = random_tokens(rows, m.vocab_size, 32);
    model::chunk a(m, model::partition(m, 1)[0], *cpu), b(m, model::partition(m, 1)[0], *gpu);
    for (auto* c : {&a, &b}) c->init(5);
    set_b(a, *cpu);
    set_b(b, *gpu);
    const float scale = 1.0f / static_cast<float>(rows);
    double loss[2];
    int i = 0;
    for (auto [c, be] : {std::pair{&a, cpu.get()}, std::pair{&b, gpu.get()}}) {
      c->zero_grads();
      c->forward(0, be == cpu.get() ? tok : be->from_host(tok), be == cpu.get() ? tgt : be->from_host(tgt), scale);
      c->backward(0, tensor{});
      loss[i++] = c->loss_sum(0) * scale;
    }
    CHECK(loss[1] == doctest::Approx(loss[0]).epsilon(1e-5));
    for (const auto& p : a.params()) check_close(gpu->to_host(b.grad(p.name)), a.grad(p.name), 2e-4, p.name);
  }
}

TEST_CASE("cuda lora: bf16 step 0's loss equals the bf16 base model's bit for bit") {
  if (!gpu_or_skip()) return;
  auto gpu = make_backend("cuda");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    core::model_config m = small(arch);
    // GPT-2's c_fc adapter adds to the pre-activation, which the base model computes fused with
    // its GELU in a cuBLASLt epilogue (from the fp32 accumulator); the adapter path rounds first.
    if (arch == core::arch_kind::gpt2) m.lora.targets = {"c_attn", "c_proj"};
    core::model_config base = m;
    base.lora = {};
    const std::int64_t rows = 2 * m.seq_length;
    const tensor tok = gpu->from_host(random_tokens(rows, m.vocab_size, 41));
    const tensor tgt = gpu->from_host(random_tokens(rows, m.vocab_size, 42));
    model::chunk a(base, model::partition(base, 1)[0], *gpu, core::precision_kind::bf16);
    model::chunk b(m, model::partition(m, 1)[0], *gpu, core::precision_kind::bf16);
    a.init(6);
    b.init(6);
    a.forward(0, tok, tgt, 1.0f / rows);
    b.forward(0, tok, tgt, 1.0f / rows);
    const double la = a.loss_sum(0), lb = b.loss_sum(0);
    CHECK(std::memcmp(&la, &lb, sizeof la) == 0);
  }
}

}  // namespace troupe::kernels::cuda_test
