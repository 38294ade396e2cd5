// LoRA in the model: which parameters train and which are frozen, step 0 equal to the base model
// bit for bit, split / recompute / zero-bubble invariance with adapters, training that moves only
// the trainable weights, merging the adapters into the base (logits within 1e-5) and PEFT's
// layout. The adapters' gradients are checked against finite differences in gradcheck_test.cpp.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/select.hpp"
#include "model/lora.hpp"
#include "model/params.hpp"
#include "model/safetensors.hpp"
#include "model/trainer.hpp"
#include "tests/model/chunk_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace troupe::model {
namespace {

using testing::tiny_config;

core::lora_config all_targets(core::arch_kind arch, int rank = 4) {
  core::lora_config l;
  l.rank = rank;
  l.alpha = 2.0 * rank;
  l.targets = arch == core::arch_kind::gpt2
                  ? std::vector<std::string>{"c_attn", "c_proj", "c_fc"}
                  : std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"};
  return l;
}

bool same_bytes(const tensor& a, const tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

/// B of every adapter set to random values keyed by (key, name), so the adapters change the model
/// and any split of it gets the same values.
void randomise_b(chunk& c, kernels::backend& be, std::uint64_t key) {
  for (const auto& p : c.params()) {
    if (p.name.find(".lora_B.") == std::string::npos) continue;
    core::rng_stream rng(core::stream_key(key, core::hash_name(p.name)));
    tensor h = tensor::zeros(p.shape);
    for (std::int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = 0.2f * rng.normal();
    tensor dst = c.param(p.name);
    be.copy(h, dst);
  }
  c.params_updated();
}

TEST_CASE("lora: the adapters train, every base weight is frozen, PEFT's defaults as targets") {
  auto be = kernels::make_backend("cpu");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    core::model_config cfg = tiny_config(arch);
    cfg.lora.rank = 4;
    cfg.lora.alpha = 8;
    cfg.lora.targets = arch == core::arch_kind::gpt2 ? std::vector<std::string>{"c_attn"}
                                                     : std::vector<std::string>{"q_proj", "v_proj"};
    chunk c(cfg, partition(cfg, 1)[0], *be);
    std::vector<std::string> names;
    for (const auto& p : c.params()) names.push_back(p.name);
    if (arch == core::arch_kind::gpt2) {
      CHECK(names == std::vector<std::string>{"h.0.attn.c_attn.lora_A.weight",
                                              "h.0.attn.c_attn.lora_B.weight",
                                              "h.1.attn.c_attn.lora_A.weight",
                                              "h.1.attn.c_attn.lora_B.weight"});
      CHECK(c.param("h.0.attn.c_attn.lora_A.weight").shape() == core::shape_t{4, 16});
      CHECK(c.param("h.0.attn.c_attn.lora_B.weight").shape() == core::shape_t{48, 4});
    } else {
      CHECK(names.size() == 8);
      CHECK(c.param("model.layers.1.self_attn.v_proj.lora_B.weight").shape() == core::shape_t{8, 4});
    }
    // Every base weight is frozen: no gradient to ask for.
    const auto spec = partition(cfg, 1)[0];
    const auto base = define_params(tiny_config(arch), spec);
    // The plain model's tied head reads its embedding; frozen, the head keeps its copy.
    CHECK(c.frozen_params().size() ==
          base.size() + (shares_head(tiny_config(arch), spec, 1) ? 1 : 0));
    for (const auto& d : base) CHECK(c.frozen(d.info.name));
    CHECK_THROWS_WITH_AS(c.grad(embedding_name(cfg)), doctest::Contains("is frozen"), core::failure);
    CHECK(!tied_gradients(cfg));
    // The trainable tensors are the adapters: a fraction of the model.
    std::int64_t trainable = 0, frozen = 0;
    for (const auto& p : c.params()) trainable += p.numel;
    for (const auto& p : c.frozen_params()) frozen += p.numel;
    CHECK(trainable * 10 < frozen);
  }
}

TEST_CASE("lora: trainable and freeze pick base modules; a tied embedding is one weight") {
  core::model_config cfg = tiny_config(core::arch_kind::gpt2);
  cfg.lora.rank = 2;
  cfg.lora.alpha = 2;
  cfg.lora.targets = {"c_attn"};
  cfg.lora.trainable = {"ln_1", "lm_head"};
  CHECK(base_trainable(cfg, "h.1.ln_1.weight"));
  CHECK(base_trainable(cfg, "h.1.ln_1.bias"));
  CHECK(!base_trainable(cfg, "h.1.ln_2.weight"));
  CHECK(base_trainable(cfg, "wte.weight"));  // tied to lm_head
  CHECK(tied_gradients(cfg));
  core::model_config full = tiny_config(core::arch_kind::llama);
  full.lora.freeze = {"embed_tokens", "q_proj"};
  CHECK(!base_trainable(full, "model.embed_tokens.weight"));
  CHECK(!base_trainable(full, "model.layers.0.self_attn.q_proj.weight"));
  CHECK(base_trainable(full, "model.layers.0.self_attn.k_proj.weight"));
  CHECK(base_trainable(full, "model.norm.weight"));
  core::model_config norms = tiny_config(core::arch_kind::llama);
  norms.lora.trainable = {"norm"};  // model.norm only, not the layers' *_layernorm
  CHECK(base_trainable(norms, "model.norm.weight"));
  CHECK(!base_trainable(norms, "model.layers.0.input_layernorm.weight"));
}

TEST_CASE("lora: step 0's loss and logits equal the base model's bit for bit") {
  auto be = kernels::make_backend("cpu");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    core::model_config base_cfg = tiny_config(arch);
    core::model_config cfg = base_cfg;
    cfg.lora = all_targets(arch);
    chunk base(base_cfg, partition(base_cfg, 1)[0], *be), lora(cfg, partition(cfg, 1)[0], *be);
    base.init(11);
    lora.init(11);
    // The frozen weights are the base model's own initialisation.
    for (const auto& p : base.params()) CHECK(same_bytes(base.param(p.name), lora.param(p.name)));
    tensor tokens = testing::random_tokens(cfg, 2, 3), targets = testing::random_tokens(cfg, 2, 4);
    base.forward(0, tokens, targets, 1.0f / 16);
    lora.forward(0, tokens, targets, 1.0f / 16);
    const double lb = base.loss_sum(0), ll = lora.loss_sum(0);
    CHECK(std::memcmp(&lb, &ll, sizeof lb) == 0);
    CHECK(same_bytes(base.forward_logits(tokens), lora.forward_logits(tokens)));
    // With B ≠ 0 the adapters do change the output.
    randomise_b(lora, *be, 5);
    CHECK(!same_bytes(base.forward_logits(tokens), lora.forward_logits(tokens)));
  }
}

TEST_CASE("lora: 1, 2 and 4 chunks, recompute and the split backward give the same bits") {
  auto be = kernels::make_backend("cpu");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    core::model_config cfg = tiny_config(arch, 4);
    cfg.lora = all_targets(arch);
    cfg.lora.trainable = {arch == core::arch_kind::gpt2 ? "ln_2" : "input_layernorm"};
    tensor tokens = testing::random_tokens(cfg, 2, 7), targets = testing::random_tokens(cfg, 2, 8);
    std::map<std::string, std::vector<float>> reference;
    double reference_loss = 0;
    struct variant {
      int parts;
      core::recompute_mode mode;
      bool split;
    };
    for (variant v : {variant{1, core::recompute_mode::none, false},
                      variant{2, core::recompute_mode::full, false},
                      variant{4, core::recompute_mode::selective, true},
                      variant{2, core::recompute_mode::none, true}}) {
      INFO("chunks " << v.parts << ", split " << v.split);
      auto chunks = testing::make_chunks(cfg, *be, v.parts);
      for (auto& c : chunks) {
        c.init(3);
        randomise_b(c, *be, 9);
        c.set_recompute(v.mode);
        c.zero_grads();
      }
      double loss = 0;
      for (int mb = 0; mb < 2; ++mb) {
        loss += testing::forward_all(chunks, mb, tokens, targets, 1.0f / 32);
        testing::backward_all(chunks, mb, v.split);
      }
      auto grads = testing::by_name(chunks, *be, true);
      if (reference.empty()) {
        reference = grads;
        reference_loss = loss;
        // The gradients exist and are not all zero.
        double sum = 0;
        for (const auto& [n, g] : grads)
          for (float x : g) sum += std::abs(x);
        CHECK(sum > 0);
      } else {
        CHECK(testing::differing(reference, grads).empty());
        CHECK(std::memcmp(&loss, &reference_loss, sizeof loss) == 0);
      }
    }
  }
}

TEST_CASE("lora: training lowers the loss, moves the adapters and leaves the base bit-unchanged") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    testing::scratch_dir tmp("lora");
    core::config cfg = testing::tiny_run(tmp, arch);
    cfg.model.lora = all_targets(arch, 8);
    cfg.optimizer.lr = 3e-2;
    cfg.train.steps = 12;
    auto be = kernels::make_backend("cpu");
    auto t = trainer::create(cfg, *be, 1);
    REQUIRE_MESSAGE(t.ok(), t.err().to_string());
    chunk& c = (*t)->chunks()[0];
    const tensor base_before = c.flat_frozen().clone();
    const tensor adapters_before = c.flat_params().clone();
    std::vector<double> losses;
    for (int step = 0; step < cfg.train.steps; ++step) {
      auto r = (*t)->train_step(step);
      REQUIRE_MESSAGE(r.ok(), r.err().to_string());
      losses.push_back(r->loss);
    }
    CHECK(same_bytes(c.flat_frozen(), base_before));
    CHECK(!same_bytes(c.flat_params(), adapters_before));
    MESSAGE("loss " << losses.front() << " -> " << losses.back());
    // From a random base (frozen embedding and head) the adapters alone lower it by about 0.15;
    // without a working backward it would not move at all.
    CHECK(losses.back() < losses.front() - 0.1);
  }
}

TEST_CASE("lora: the merged model's logits equal the adapter model's within 1e-5") {
  auto be = kernels::make_backend("cpu");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    core::model_config cfg = tiny_config(arch);
    cfg.lora = all_targets(arch, 3);
    std::vector<chunk> adapted;
    adapted.emplace_back(cfg, partition(cfg, 1)[0], *be);
    adapted[0].init(21);
    randomise_b(adapted[0], *be, 22);
    auto merged = merge_lora(cfg, gather_parameters(adapted, *be));
    REQUIRE_MESSAGE(merged.ok(), merged.err().to_string());
    const core::model_config plain_cfg = without_lora(cfg);
    chunk plain(plain_cfg, partition(plain_cfg, 1)[0], *be);
    // The merged tensors hold the tied head's copy; the plain whole model's head reads wte.
    REQUIRE(merged->size() == plain.params().size() + (plain.shares_head() ? 1 : 0));
    for (const auto& p : plain.params()) {
      tensor dst = plain.param(p.name);
      be->copy(merged->at(p.name), dst);
    }
    plain.params_updated();
    tensor tokens = testing::random_tokens(cfg, 2, 23);
    tensor a = adapted[0].forward_logits(tokens), m = plain.forward_logits(tokens);
    double worst = 0, moved = 0;
    chunk base(plain_cfg, partition(plain_cfg, 1)[0], *be);
    base.init(21);
    tensor b = base.forward_logits(tokens);
    for (std::int64_t i = 0; i < a.numel(); ++i) {
      worst = std::max(worst, double(std::abs(a.data<float>()[i] - m.data<float>()[i])));
      moved = std::max(moved, double(std::abs(a.data<float>()[i] - b.data<float>()[i])));
    }
    MESSAGE("largest |merged - adapter| logit difference " << worst << " (adapters moved logits by up to "
                                                          << moved << ")");
    CHECK(worst <= 1e-5);
    CHECK(moved > 1e-3);  // the adapters matter, so the comparison can fail
  }
}

TEST_CASE("lora: a merge refuses adapters without their B or base") {
  core::model_config cfg = tiny_config(core::arch_kind::gpt2);
  cfg.lora = all_targets(core::arch_kind::gpt2, 2);
  named_tensors p;
  p["h.0.attn.c_attn.lora_A.weight"] = tensor::zeros({2, 16});
  auto r = merge_lora(cfg, p);
  REQUIRE(!r.ok());
  CHECK(r.err().to_string().find("h.0.attn.c_attn.lora_B.weight") != std::string::npos);
  p["h.0.attn.c_attn.lora_B.weight"] = tensor::zeros({48, 2});
  p["h.0.attn.c_attn.weight"] = tensor::zeros({48, 15});
  r = merge_lora(cfg, p);
  REQUIRE(!r.ok());
  CHECK(r.err().to_string().find("does not fit") != std::string::npos);
}

TEST_CASE("lora: PEFT export names adapters as PEFT does and writes its config") {
  auto be = kernels::make_backend("cpu");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    testing::scratch_dir tmp("peft");
    core::model_config cfg = tiny_config(arch);
    cfg.lora.rank = 2;
    cfg.lora.alpha = 4;
    cfg.lora.targets = arch == core::arch_kind::gpt2 ? std::vector<std::string>{"c_attn"}
                                                     : std::vector<std::string>{"q_proj", "v_proj"};
    std::vector<chunk> cs;
    cs.emplace_back(cfg, partition(cfg, 1)[0], *be);
    cs[0].init(1);
    auto params = gather_parameters(cs, *be);
    REQUIRE(write_peft_adapter(cfg, params, tmp / "out").ok());
    auto f = safetensors::file::open(tmp / "out/adapter_model.safetensors");
    REQUIRE_MESSAGE(f.ok(), f.err().to_string());
    const std::string a = arch == core::arch_kind::gpt2
                              ? "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
                              : "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    auto t = f->load(a);
    REQUIRE_MESSAGE(t.ok(), t.err().to_string());
    const std::string troupe = arch == core::arch_kind::gpt2 ? "h.0.attn.c_attn.lora_A.weight"
                                                            : "model.layers.0.self_attn.q_proj.lora_A.weight";
    CHECK(same_bytes(*t, params.at(troupe)));
    CHECK(f->entries().size() == (arch == core::arch_kind::gpt2 ? 4u : 8u));
    std::ifstream in(tmp / "out/adapter_config.json");
    auto j = nlohmann::json::parse(in);
    CHECK(j["peft_type"] == "LORA");
    CHECK(j["r"] == 2);
    CHECK(j["lora_alpha"] == 4.0);
    CHECK(j["target_modules"] == nlohmann::json(cfg.lora.targets));
    CHECK(j["fan_in_fan_out"] == (arch == core::arch_kind::gpt2));
  }
  core::model_config cfg = tiny_config(core::arch_kind::gpt2);
  cfg.lora = all_targets(core::arch_kind::gpt2, 2);
  cfg.lora.trainable = {"ln_f"};
  auto st = write_peft_adapter(cfg, {}, "unused");
  REQUIRE(!st.ok());
  CHECK(st.err().to_string().find("--merge-lora") != std::string::npos);
}

}  // namespace
}  // namespace troupe::model

namespace troupe::model {
namespace {

TEST_CASE("lora: the checkpoint names its frozen base; resuming on another base is refused") {
  testing::scratch_dir tmp("lora_base");
  core::config cfg = testing::tiny_run(tmp);
  cfg.model.lora = all_targets(core::arch_kind::gpt2, 2);
  cfg.train.steps = 2;
  train_options opt;
  opt.log = nullptr;
  auto r = train_single_rank(cfg, opt);
  REQUIRE_MESSAGE(r.ok(), r.err().to_string());
  auto ck = checkpoint::reader::open(r->checkpoint);
  REQUIRE(ck.ok());
  CHECK(ck->info().base_source == "seed 1234");
  CHECK(ck->info().base_xxh64 == identify_base(cfg).xxh64);
  CHECK(ck->info().base_xxh64.size() == 16);
  // Only the adapters are stored: 4 modules (c_attn, c_fc and both c_proj) x 2 layers x (A, B),
  // each with its two moments.
  CHECK(ck->info().tensors.size() == 4 * 2 * 2 * 3);
  core::config other = cfg;
  other.train.seed = 99;
  other.train.steps = 3;
  opt.resume = r->checkpoint;
  auto bad = train_single_rank(other, opt);
  REQUIRE(!bad.ok());
  CHECK(bad.err().to_string().find("another frozen base") != std::string::npos);
  cfg.train.steps = 3;
  auto good = train_single_rank(cfg, opt);
  CHECK_MESSAGE(good.ok(), (good.ok() ? "" : good.err().to_string()));
}

}  // namespace
}  // namespace troupe::model
