// Model chunks: layout and naming, initialisation, and the determinism contract of chunk.hpp —
// the same bits whatever the split, the recompute mode, the backward split (zero-bubble) or the
// interleaving of micro-batches — plus honest saved-activation accounting and inference.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "kernels/backend.hpp"
#include "kernels/select.hpp"
#include "model/chunk.hpp"
#include "tests/model/chunk_harness.hpp"

namespace troupe::model {
namespace {

using core::arch_kind;
using core::recompute_mode;
using namespace model::testing;

const arch_kind both_archs[] = {arch_kind::gpt2, arch_kind::llama};

std::string arch_name(arch_kind a) { return a == arch_kind::gpt2 ? "gpt2" : "llama"; }

/// A model of `layers` layers split into `parts` chunks, initialised from `seed`.
std::vector<chunk> model_of(const core::model_config& cfg, kernels::backend& be, int parts,
                            std::uint64_t seed = 42) {
  auto chunks = make_chunks(cfg, be, parts);
  for (auto& c : chunks) c.init(seed);
  return chunks;
}

struct run_result {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> grads;
};

/// Two micro-batches, forward both then backward both (GPipe order).
run_result run_two(std::vector<chunk>& chunks, kernels::backend& be, const core::model_config& cfg,
                   bool split_backward = false) {
  run_result r;
  for (auto& c : chunks) c.zero_grads();
  for (int mb = 0; mb < 2; ++mb)
    r.losses.push_back(forward_all(chunks, mb, random_tokens(cfg, 2, 100 + mb),
                                   random_tokens(cfg, 2, 200 + mb), 1.0f / 32));
  for (int mb = 0; mb < 2; ++mb) backward_all(chunks, mb, split_backward);
  r.grads = by_name(chunks, be, true);
  return r;
}

TEST_CASE("partition splits layers into equal contiguous chunks with embedding first, head last") {
  core::model_config cfg = tiny_config(arch_kind::gpt2, 4);
  auto specs = partition(cfg, 2);
  REQUIRE(specs.size() == 2);
  CHECK(specs[0].first_layer == 0);
  CHECK(specs[0].num_layers == 2);
  CHECK(specs[0].has_embedding);
  CHECK(!specs[0].has_head);
  CHECK(specs[1].first_layer == 2);
  CHECK(!specs[1].has_embedding);
  CHECK(specs[1].has_head);
  auto one = partition(cfg, 1);
  CHECK((one[0].has_embedding && one[0].has_head && one[0].num_layers == 4));
  CHECK_THROWS_AS(partition(cfg, 3), core::failure);
}

TEST_CASE("parameters carry Hugging Face names, block-aligned offsets and decay flags") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch);
    chunk c(cfg, partition(cfg, 1)[0], *be);
    std::set<std::string> names;
    std::int64_t end = 0;
    for (const auto& p : c.params()) {
      names.insert(p.name);
      CHECK(p.offset % kernels::norm_block == 0);
      CHECK(p.offset >= end);  // no overlap, in order
      end = p.offset + p.numel;
      CHECK(p.numel == core::numel_of(p.shape));
      CHECK(p.decay == (p.shape.size() == 2));
    }
    CHECK(c.flat_params().numel() >= end);
    CHECK(c.flat_params().numel() % kernels::norm_block == 0);
    CHECK(c.flat_grads().numel() == c.flat_params().numel());
    if (arch == arch_kind::gpt2) {
      for (const char* n : {"wte.weight", "wpe.weight", "h.1.ln_1.weight", "h.1.ln_1.bias",
                            "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
                            "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias", "h.0.ln_2.weight",
                            "h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias", "h.0.mlp.c_proj.weight",
                            "h.0.mlp.c_proj.bias", "ln_f.weight", "ln_f.bias"})
        CHECK_MESSAGE(names.count(n), n);
      // The tied head of the whole model reads the embedding: no copy of its own.
      CHECK(c.shares_head());
      CHECK(names.size() == 2 + 2 * 12 + 2);
      CHECK(c.param("lm_head.weight").raw() == c.param("wte.weight").raw());
      CHECK(c.grad("lm_head.weight").raw() != c.grad("wte.weight").raw());
      CHECK(c.param("h.0.attn.c_attn.weight").shape() == core::shape_t{48, 16});
      CHECK(c.param("h.0.mlp.c_proj.weight").shape() == core::shape_t{16, 64});
    } else {
      for (const char* n :
           {"model.embed_tokens.weight", "model.layers.1.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"})
        CHECK_MESSAGE(names.count(n), n);
      CHECK(names.size() == 1 + 2 * 9 + 2);
      CHECK(c.param("model.layers.0.self_attn.k_proj.weight").shape() == core::shape_t{8, 16});
    }
    // Split, the last chunk holds the head's copy, flagged tied.
    auto split = make_chunks(cfg, *be, 2);
    CHECK(!split[1].shares_head());
    bool head_tied = false;
    for (const auto& p : split[1].params())
      if (p.name == "lm_head.weight") head_tied = p.tied;
    CHECK(head_tied == cfg.tie_embeddings);
    CHECK(c.shares_head() == cfg.tie_embeddings);
    CHECK_THROWS_AS(c.param("h.7.ln_1.weight"), core::failure);
    CHECK_THROWS_AS(c.grad("nope"), core::failure);
  }
}

TEST_CASE("the chunks of a split hold core::parameter_count parameters, tied head counted once") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs)
    for (bool tied : {false, true}) {
      CAPTURE(arch_name(arch));
      CAPTURE(tied);
      core::model_config cfg = tiny_config(arch, 4);
      cfg.ffn_hidden_size = 0;  // the family's default width rule
      cfg.tie_embeddings = tied;
      std::int64_t total = 0;
      for (auto& c : make_chunks(cfg, *be, 2))
        for (const auto& p : c.params())
          if (!p.tied) total += p.numel;
      CHECK(total == core::parameter_count(cfg));
    }
}

TEST_CASE("init gives each parameter the same values in any split, by the GPT-2 rules") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch, 4);
    auto whole = model_of(cfg, *be, 1, 7);
    const auto ref = by_name(whole, *be, false);
    for (int parts : {2, 4}) {
      auto split = model_of(cfg, *be, parts, 7);
      CHECK(differing(ref, by_name(split, *be, false)).empty());
    }
    // Another seed changes every random tensor (all matrices; norms and biases are constant).
    auto other_seed = model_of(cfg, *be, 1, 8);
    std::size_t matrices = 0;
    for (const auto& p : other_seed[0].params()) matrices += p.shape.size() == 2;
    matrices += other_seed[0].shares_head();  // by_name lists the shared head too
    CHECK(differing(ref, by_name(other_seed, *be, false)).size() == matrices);

    auto stats = [&](const std::string& name) {
      const auto& v = ref.at(name);
      double s = 0, s2 = 0;
      for (float x : v) s += x, s2 += double(x) * x;
      const double mean = s / v.size();
      return std::pair{mean, std::sqrt(s2 / v.size() - mean * mean)};
    };
    const bool gpt2 = arch == arch_kind::gpt2;
    const std::string emb = gpt2 ? "wte.weight" : "model.embed_tokens.weight";
    const std::string fc = gpt2 ? "h.2.mlp.c_fc.weight" : "model.layers.2.mlp.gate_proj.weight";
    const std::string res = gpt2 ? "h.2.mlp.c_proj.weight" : "model.layers.2.mlp.down_proj.weight";
    const std::string norm = gpt2 ? "h.2.ln_1.weight" : "model.layers.2.input_layernorm.weight";
    CHECK(stats(emb).second == doctest::Approx(0.02).epsilon(0.1));
    CHECK(stats(fc).second == doctest::Approx(0.02).epsilon(0.1));
    CHECK(stats(res).second == doctest::Approx(0.02 / std::sqrt(8.0)).epsilon(0.1));
    CHECK(stats(norm) == std::pair{1.0, 0.0});
    if (gpt2) CHECK(stats("h.2.mlp.c_fc.bias") == std::pair{0.0, 0.0});
    // A tied head starts equal to the embedding; an untied one does not.
    CHECK((ref.at("lm_head.weight") == ref.at(emb)) == cfg.tie_embeddings);
    // Padding between tensors stays zero.
    tensor flat = be->to_host(whole[0].flat_params());
    std::vector<bool> used(flat.numel(), false);
    for (const auto& p : whole[0].params())
      for (std::int64_t i = 0; i < p.numel; ++i) used[p.offset + i] = true;
    bool padding_zero = true;
    for (std::int64_t i = 0; i < flat.numel(); ++i)
      if (!used[i] && flat.data<float>()[i] != 0.0f) padding_zero = false;
    CHECK(padding_zero);
  }
}

TEST_CASE("splitting the model into 1, 2 or 4 chunks gives bit-identical losses and gradients") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch, 4);
    auto whole = model_of(cfg, *be, 1, 3);
    const auto weights = by_name(whole, *be, false);
    const run_result ref = run_two(whole, *be, cfg);
    for (int parts : {2, 4}) {
      CAPTURE(parts);
      auto split = make_chunks(cfg, *be, parts);
      set_by_name(split, *be, weights);
      const run_result r = run_two(split, *be, cfg);
      CHECK(r.losses == ref.losses);
      CHECK(differing(ref.grads, r.grads).empty());
    }
  }
}

TEST_CASE("recompute none, full and selective give bit-identical losses and gradients") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch, 4);
    for (int parts : {1, 2}) {
      CAPTURE(parts);
      auto chunks = model_of(cfg, *be, parts, 11);
      const run_result ref = run_two(chunks, *be, cfg);
      // Every layer, then per layer (recompute.layers / layer_list): some layers of a chunk
      // recompute, the others keep everything; the first and the last layer of the model each.
      const std::vector<std::vector<bool>> masks = {
          {}, {true, false, false, false}, {false, true, false, true}, {false, false, false, true}};
      for (recompute_mode mode : {recompute_mode::full, recompute_mode::selective}) {
        for (const auto& mask : masks) {
          CAPTURE(mask.size() > 1 && mask[1]);
          for (auto& c : chunks) c.set_recompute(mode, mask);
          for (bool split_backward : {false, true}) {
            CAPTURE(split_backward);
            const run_result r = run_two(chunks, *be, cfg, split_backward);
            CHECK(r.losses == ref.losses);
            CHECK(differing(ref.grads, r.grads).empty());
          }
        }
      }
    }
  }
}

TEST_CASE("a step's gradients never hold the last step's: zeroed or written by the weight pass") {
  // zero_grads zeroes only what the backward adds into; the first weight pass of each layer and
  // of the head writes the linear weights' gradients. NaN left in the whole buffer by an earlier
  // step must not reach a single gradient, padding included, in any backward order.
  auto be = kernels::make_backend("cpu");
  auto poison = [&](std::vector<chunk>& chunks) {
    for (auto& c : chunks) {
      for (tensor g : {c.flat_grads(), c.shares_head() ? c.grad("lm_head.weight") : tensor{}}) {
        if (!g.defined()) continue;
        tensor nan = tensor::zeros(g.shape());
        std::fill_n(nan.data<float>(), nan.numel(), std::nanf(""));
        be->copy(nan, g);
      }
    }
  };
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch, 4);
    for (int parts : {1, 2}) {
      CAPTURE(parts);
      auto chunks = model_of(cfg, *be, parts, 23);
      const run_result ref = run_two(chunks, *be, cfg);
      for (bool split_backward : {false, true}) {
        CAPTURE(split_backward);
        poison(chunks);
        const run_result r = run_two(chunks, *be, cfg, split_backward);
        CHECK(r.losses == ref.losses);
        CHECK(differing(ref.grads, r.grads).empty());
        for (auto& c : chunks) {
          const tensor all = be->to_host(c.flat_grads());
          CHECK(std::all_of(all.data<float>(), all.data<float>() + all.numel(),
                            [](float x) { return std::isfinite(x); }));
        }
      }
      // A reader before the backward sees zeros, not the NaN: grad() zeroes what is unwritten.
      poison(chunks);
      for (auto& c : chunks) c.zero_grads();
      for (const auto& [name, g] : by_name(chunks, *be, true)) {
        CAPTURE(name);
        CHECK(std::all_of(g.begin(), g.end(), [](float x) { return x == 0.0f; }));
      }
      const run_result again = run_two(chunks, *be, cfg);
      CHECK(differing(ref.grads, again.grads).empty());
    }
  }
}

TEST_CASE("backward_input then backward_weight gives the bits of backward, in zero-bubble order") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch, 4);
    auto chunks = model_of(cfg, *be, 2, 5);
    const run_result ref = run_two(chunks, *be, cfg);

    // ZB-H1-like: inputs of both micro-batches first, weights later, stages interleaved.
    for (auto& c : chunks) c.zero_grads();
    std::vector<double> losses;
    for (int mb = 0; mb < 2; ++mb)
      losses.push_back(forward_all(chunks, mb, random_tokens(cfg, 2, 100 + mb),
                                   random_tokens(cfg, 2, 200 + mb), 1.0f / 32));
    tensor g0 = chunks[1].backward_input(0, {});
    tensor g1 = chunks[1].backward_input(1, {});
    CHECK(chunks[0].backward_input(0, g0).defined() == false);
    chunks[1].backward_weight(0);
    chunks[0].backward_input(1, g1);
    chunks[0].backward_weight(0);
    chunks[1].backward_weight(1);
    chunks[0].backward_weight(1);
    CHECK(losses == ref.losses);
    CHECK(differing(ref.grads, by_name(chunks, *be, true)).empty());
    for (auto& c : chunks) CHECK(c.saved_activation_bytes() == 0);
  }
}

TEST_CASE("gradients of micro-batches accumulate in backward call order, whatever the forwards") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch, 2);
    auto chunks = model_of(cfg, *be, 2, 9);
    auto data = [&](int mb) {
      return std::pair{random_tokens(cfg, 2, 100 + mb), random_tokens(cfg, 2, 200 + mb)};
    };
    auto fwd = [&](int mb) {
      auto [tok, tgt] = data(mb);
      return forward_all(chunks, mb, tok, tgt, 1.0f / 32);
    };
    // GPipe order: F0 F1 B0 B1.
    const run_result gpipe = run_two(chunks, *be, cfg);
    // 1F1B order: F0 B0 F1 B1.
    for (auto& c : chunks) c.zero_grads();
    const double l0 = fwd(0);
    backward_all(chunks, 0);
    const double l1 = fwd(1);
    backward_all(chunks, 1);
    CHECK(std::vector{l0, l1} == gpipe.losses);
    CHECK(differing(gpipe.grads, by_name(chunks, *be, true)).empty());
    // Forwards in the other order, backwards in the same order: same bits.
    for (auto& c : chunks) c.zero_grads();
    fwd(1);
    fwd(0);
    backward_all(chunks, 0);
    backward_all(chunks, 1);
    CHECK(differing(gpipe.grads, by_name(chunks, *be, true)).empty());
    // Each micro-batch alone: the accumulated gradient is their sum.
    std::map<std::string, std::vector<float>> single[2];
    for (int mb = 0; mb < 2; ++mb) {
      for (auto& c : chunks) c.zero_grads();
      fwd(mb);
      backward_all(chunks, mb);
      single[mb] = by_name(chunks, *be, true);
    }
    double worst = 0;
    for (const auto& [name, g] : gpipe.grads)
      for (std::size_t i = 0; i < g.size(); ++i) {
        const double sum = double(single[0].at(name)[i]) + single[1].at(name)[i];
        worst = std::max(worst, std::abs(g[i] - sum) / (std::abs(sum) + 1e-6));
      }
    CHECK(worst < 1e-5);
  }
}

/// Bytes a GPT-2 chunk holding the whole model keeps per micro-batch without recompute, from the
/// layer diagram in layer.hpp: per layer x, n1, mid, n2, att (C each), qkv (3C), fc (4C; GPT-2
/// recomputes act = gelu(fc) in backward), four norm statistics and lse (H per row); the head
/// keeps its input, norm output, two statistics and dlogits (V); the tokens (int32).
std::size_t gpt2_none_bytes(const core::model_config& cfg, std::int64_t n) {
  const std::int64_t c = cfg.hidden_size, h = cfg.num_heads, v = cfg.vocab_size;
  const std::int64_t layer = n * (5 * c + 3 * c + 4 * c + 4 + h);
  const std::int64_t head = n * (2 * c + 2 + v);
  return static_cast<std::size_t>(4 * (cfg.num_layers * layer + head + n));
}

TEST_CASE("saved activation bytes are exact and shrink from none to selective to full") {
  auto be = kernels::make_backend("cpu");
  core::model_config cfg = tiny_config(arch_kind::gpt2, 2);
  const std::int64_t n = 2 * cfg.seq_length;
  const tensor tok = random_tokens(cfg, 2, 1), tgt = random_tokens(cfg, 2, 2);
  std::map<recompute_mode, std::size_t> held, peak;
  for (recompute_mode mode :
       {recompute_mode::none, recompute_mode::selective, recompute_mode::full}) {
    auto chunks = model_of(cfg, *be, 1);
    chunks[0].set_recompute(mode);
    forward_all(chunks, 0, tok, tgt, 1.0f / n);
    held[mode] = chunks[0].saved_activation_bytes();
    forward_all(chunks, 1, tok, tgt, 1.0f / n);
    CHECK(chunks[0].saved_activation_bytes() == 2 * held[mode]);
    backward_all(chunks, 0);
    CHECK(chunks[0].saved_activation_bytes() == held[mode]);
    backward_all(chunks, 1);
    CHECK(chunks[0].saved_activation_bytes() == 0);
    peak[mode] = chunks[0].peak_saved_activation_bytes();
  }
  const std::size_t none = gpt2_none_bytes(cfg, n);
  const std::size_t attention = 4 * cfg.num_layers * n * (cfg.hidden_size + cfg.num_heads);
  CHECK(held[recompute_mode::none] == none);
  CHECK(held[recompute_mode::selective] == none - attention);
  CHECK(held[recompute_mode::full] == static_cast<std::size_t>(4 * 2 * n));  // tokens, targets
  CHECK(held[recompute_mode::full] < held[recompute_mode::selective]);
  CHECK(held[recompute_mode::selective] < held[recompute_mode::none]);
  // Peaks: two micro-batches in flight, and the one being recomputed is whole again.
  CHECK(peak[recompute_mode::none] >= 2 * none);
  CHECK(peak[recompute_mode::full] >= none);
  CHECK(peak[recompute_mode::full] < peak[recompute_mode::none]);
}

TEST_CASE("GPT-2 layers that keep their GELU output give the bits of recomputing it") {
  // recompute.keep_gelu: on the CPU the kept output and the recomputed one are the same op on the
  // same pre-activation, so every combination with the recompute modes, splits and the split
  // backward gives the reference's bits. Each keeping layer holds one [N, 4C] tensor more after
  // the forward, and the same bytes as a recomputing one between its two backward phases.
  auto be = kernels::make_backend("cpu");
  core::model_config cfg = tiny_config(arch_kind::gpt2, 4);
  const std::vector<bool> last_two = {false, false, true, true}, all(4, true);
  for (int parts : {1, 2}) {
    CAPTURE(parts);
    auto chunks = model_of(cfg, *be, parts, 17);
    const run_result ref = run_two(chunks, *be, cfg);
    for (recompute_mode mode :
         {recompute_mode::none, recompute_mode::selective, recompute_mode::full}) {
      // Some layers recompute, or every layer (under full: the whole chunk reruns).
      for (const std::vector<bool>& layers : {std::vector<bool>{false, true, false, true},
                                              std::vector<bool>{}}) {
        CAPTURE(layers.empty());
        for (const auto& keep : {last_two, all}) {
          CAPTURE(keep[0]);
          for (auto& c : chunks) c.set_recompute(mode, layers, keep);
          for (bool split_backward : {false, true}) {
            CAPTURE(split_backward);
            const run_result r = run_two(chunks, *be, cfg, split_backward);
            CHECK(r.losses == ref.losses);
            CHECK(differing(ref.grads, r.grads).empty());
          }
        }
      }
    }
  }

  const std::int64_t n = 2 * cfg.seq_length;
  const tensor tok = random_tokens(cfg, 2, 1), tgt = random_tokens(cfg, 2, 2);
  auto held = [&](const std::vector<bool>& keep) {
    auto chunks = model_of(cfg, *be, 1);
    chunks[0].set_recompute(recompute_mode::none, {}, keep);
    forward_all(chunks, 0, tok, tgt, 1.0f / n);
    const std::size_t after_forward = chunks[0].saved_activation_bytes();
    CHECK(!chunks[0].backward_input(0, {}).defined());
    const std::size_t between = chunks[0].saved_activation_bytes();
    chunks[0].backward_weight(0);
    CHECK(chunks[0].saved_activation_bytes() == 0);
    return std::pair{after_forward, between};
  };
  const auto none = held({}), two = held(last_two);
  const std::size_t act = static_cast<std::size_t>(4 * n * 4 * cfg.hidden_size);  // fp32 [N, 4C]
  CHECK(none.first == gpt2_none_bytes(cfg, n));
  CHECK(two.first == none.first + 2 * act);
  CHECK(two.second == none.second);
}

TEST_CASE("split backward holds the weight-phase state until backward_weight and then frees it") {
  auto be = kernels::make_backend("cpu");
  core::model_config cfg = tiny_config(arch_kind::llama, 2);
  auto chunks = model_of(cfg, *be, 1);
  forward_all(chunks, 0, random_tokens(cfg, 2, 1), random_tokens(cfg, 2, 2), 1.0f / 16);
  const std::size_t after_forward = chunks[0].saved_activation_bytes();
  CHECK(!chunks[0].backward_input(0, {}).defined());
  const std::size_t between = chunks[0].saved_activation_bytes();
  CHECK(between > 0);
  CHECK(after_forward > 0);
  CHECK_THROWS_AS(chunks[0].backward_input(0, {}), core::failure);
  chunks[0].backward_weight(0);
  CHECK(chunks[0].saved_activation_bytes() == 0);
}

TEST_CASE("forward_logits reproduces the training loss and saves nothing") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : both_archs) {
    CAPTURE(arch_name(arch));
    core::model_config cfg = tiny_config(arch, 2);
    for (int parts : {1, 2}) {
      CAPTURE(parts);
      auto chunks = model_of(cfg, *be, parts);
      const tensor tok = random_tokens(cfg, 2, 1), tgt = random_tokens(cfg, 2, 2);
      const double loss = forward_all(chunks, 0, tok, tgt, 1.0f / 16);
      for (auto& c : chunks) c.release(0);
      CHECK_THROWS_AS(chunks.back().loss_sum(0), core::failure);

      tensor h = tok;
      for (std::size_t i = 0; i + 1 < chunks.size(); ++i) {
        h = chunks[i].forward(1, h);
        chunks[i].release(1);
      }
      tensor logits = chunks.back().forward_logits(h);
      CHECK(logits.shape() == core::shape_t{16, cfg.vocab_size});
      CHECK(logits.type() == core::dtype::f32);
      for (auto& c : chunks) CHECK(c.saved_activation_bytes() == 0);
      tensor losses = tensor::zeros({16});
      be->cross_entropy(logits, tgt, losses, 0);
      double sum = 0;
      for (int i = 0; i < 16; ++i) sum += losses.data<float>()[i];
      CHECK(sum == loss);
    }
  }
}

TEST_CASE("an evaluation forward (grad_scale 0) reports the loss, keeps nothing, allows no backward") {
  auto be = kernels::make_backend("cpu");
  core::model_config cfg = tiny_config(arch_kind::gpt2, 2);
  auto chunks = model_of(cfg, *be, 1);
  const tensor tok = random_tokens(cfg, 2, 1), tgt = random_tokens(cfg, 2, 2);
  const double train_loss = forward_all(chunks, 0, tok, tgt, 1.0f / 16);
  chunks[0].release(0);
  const double eval_loss = forward_all(chunks, 3, tok, tgt, 0.0f);
  CHECK(eval_loss == train_loss);
  CHECK(chunks[0].saved_activation_bytes() == 0);
  CHECK_THROWS_AS(chunks[0].backward(3, {}), core::failure);
  chunks[0].release(3);
  CHECK(chunks[0].saved_activation_bytes() == 0);
}

TEST_CASE("a bf16 chunk keeps fp32 master weights and gradients and wants bf16 activations") {
  auto be = kernels::make_backend("cpu");
  core::model_config cfg = tiny_config(arch_kind::llama, 2);
  auto fp32 = model_of(cfg, *be, 2);
  std::vector<chunk> low;
  for (const auto& s : partition(cfg, 2)) low.emplace_back(cfg, s, *be, core::precision_kind::bf16);
  for (auto& c : low) {
    c.init(42);
    CHECK(c.flat_params().type() == core::dtype::f32);
    CHECK(c.flat_grads().type() == core::dtype::f32);
  }
  CHECK(differing(by_name(fp32, *be, false), by_name(low, *be, false)).empty());
  const tensor hidden32 = tensor::zeros({16, cfg.hidden_size});
  CHECK_THROWS_AS(low[1].forward(0, hidden32, random_tokens(cfg, 2, 1), 1), core::failure);
  // The CPU backend computes in fp32 only: a low-precision forward is refused, not approximated.
  CHECK_THROWS_AS(low[0].forward(0, random_tokens(cfg, 2, 1)), core::failure);
}

TEST_CASE("misuse is reported: repeated forward, unknown micro-batch, wrong input") {
  auto be = kernels::make_backend("cpu");
  core::model_config cfg = tiny_config(arch_kind::gpt2, 2);
  auto chunks = model_of(cfg, *be, 2);
  const tensor tok = random_tokens(cfg, 2, 1);
  tensor h = chunks[0].forward(0, tok);
  CHECK(h.shape() == core::shape_t{16, cfg.hidden_size});
  CHECK_THROWS_AS(chunks[0].forward(0, tok), core::failure);
  CHECK_THROWS_AS(chunks[0].backward(5, h), core::failure);
  CHECK_THROWS_AS(chunks[0].backward_weight(0), core::failure);
  CHECK_THROWS_AS(chunks[1].forward(0, h), core::failure);           // no targets
  CHECK_THROWS_AS(chunks[1].forward(1, tok, tok, 1), core::failure);  // tokens, not hidden
  CHECK_THROWS_AS(chunks[0].forward(1, tensor::zeros({5}, core::dtype::i32)),
                  core::failure);  // not whole sequences
  CHECK_THROWS_AS(chunks[0].forward_logits(tok), core::failure);  // no head here
}

}  // namespace
}  // namespace troupe::model
