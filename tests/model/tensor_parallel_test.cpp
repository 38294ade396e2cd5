// Tensor and sequence parallel as units (model/tensor_parallel.hpp, actors/tp_group.hpp): each
// rank of a group runs on its own thread over the local transport, and what the group computes —
// a layer's output, its input gradient and every parameter gradient gathered back to full
// tensors; the vocabulary-parallel embedding and cross-entropy — is compared with the unsplit ops
// on the same inputs (fp32, 1e-5 of the largest magnitude). Sharding then gathering gives the
// same bits, and a tensor-parallel run repeated gives the same bits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <thread>

#include "actors/tp_group.hpp"
#include "core/rng.hpp"
#include "kernels/select.hpp"
#include "model/params.hpp"
#include "model/tensor_parallel.hpp"
#include "transport/local.hpp"

using namespace troupe;
using core::tensor;

namespace {

using named = std::map<std::string, tensor>;

core::model_config small(core::arch_kind arch, int kv = 0) {
  core::model_config c;
  c.arch = arch;
  c.num_layers = 1;
  c.hidden_size = 32;
  c.num_heads = 4;
  c.num_kv_heads = kv == 0 ? 4 : kv;
  c.ffn_hidden_size = arch == core::arch_kind::gpt2 ? 128 : 64;
  c.seq_length = 8;
  c.vocab_size = 50;  // not a multiple of 4: the last rank's rows are padded at tp 4
  c.tie_embeddings = false;
  return c;
}

tensor randn(const core::shape_t& shape, std::uint64_t key, float scale, float mean = 0) {
  tensor t = tensor::zeros(shape);
  core::rng_stream rng(key);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = mean + scale * rng.normal();
  return t;
}

// Every parameter of `spec`, random: norms near 1, biases and weights small.
named random_params(const core::model_config& cfg, const model::chunk_spec& spec, std::uint64_t seed) {
  named out;
  std::uint64_t k = seed;
  for (const auto& d : model::define_params(cfg, spec)) {
    const bool norm = d.rule == model::init_rule::ones;
    out[d.info.name] = randn(d.info.shape, ++k, norm ? 0.1f : 0.2f, norm ? 1.0f : 0.0f);
  }
  return out;
}

named zeros_like(const named& p) {
  named out;
  for (const auto& [name, t] : p) out[name] = tensor::zeros(t.shape());
  return out;
}

model::layer_tensors views(const core::model_config& cfg, named& p) {
  return model::layer_views(cfg, 0, [&](const std::string& n) { return p.at(n); });
}

double max_abs(const tensor& t) {
  double m = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(double(t.data<float>()[i])));
  return m;
}

// |a - b| <= 1e-5 of b's largest magnitude, element by element.
void check_close(const tensor& a, const tensor& b, const std::string& what) {
  INFO(what);
  REQUIRE(a.shape() == b.shape());
  const double tol = 1e-5 * std::max(max_abs(b), 1e-6);
  double worst = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i)
    worst = std::max(worst, std::fabs(double(a.data<float>()[i]) - b.data<float>()[i]));
  CHECK_MESSAGE(worst <= tol, what << ": max difference " << worst << " > " << tol);
}

bool same_bits(const tensor& a, const tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

tensor concat_rows(const std::vector<tensor>& parts) {
  std::int64_t rows = 0;
  for (const auto& p : parts) rows += p.dim(0);
  core::shape_t s = parts[0].shape();
  s[0] = rows;
  tensor out = tensor::zeros(s);
  std::size_t at = 0;
  for (const auto& p : parts) {
    std::memcpy(static_cast<char*>(out.raw()) + at, p.raw(), p.bytes());
    at += p.bytes();
  }
  return out;
}

// Runs fn(rank, group) on tp threads, one local transport endpoint and CPU backend each.
template <class F>
void run_group(int tp, bool sp, int kv_replicas, F&& fn) {
  auto hub = std::make_shared<transport::local_hub>();
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(tp));
  std::vector<std::thread> threads;
  std::vector<int> ranks;
  for (int r = 0; r < tp; ++r) ranks.push_back(r);
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      try {
        transport::local_transport t(hub, r);
        auto be = kernels::make_backend("cpu");
        actors::tp_group g(t, ranks, *be, sp, kv_replicas, std::chrono::seconds(20));
        fn(r, g, *be);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  CHECK(hub->in_flight() == 0);
}

struct layer_result {
  tensor y, dx;
  named grads;
};

struct layer_case {
  core::model_config cfg;
  int batch = 2;
  bool dropout = false;
  bool norms_in_input_phase = false;
};

model::layer_dropout dropout_of(const layer_case& c) {
  if (!c.dropout) return {};
  model::dropout_ctx ctx;
  ctx.attention = 0.2f;
  ctx.hidden = 0.3f;
  ctx.step_key = 77;
  ctx.first_sample = 5;
  return {ctx.at(0, model::dropout_site::attention), ctx.at(0, model::dropout_site::attention_out),
          ctx.at(0, model::dropout_site::mlp_out)};
}

// The unsplit layer: forward, backward_input, backward_weight.
layer_result reference(const layer_case& c, named params, const tensor& x, const tensor& dy) {
  auto be = kernels::make_backend("cpu");
  auto ops = model::make_layer_ops(c.cfg, *be, core::dtype::f32);
  layer_result r;
  r.grads = zeros_like(params);
  const model::layer_tensors w = views(c.cfg, params);
  model::layer_tensors g = views(c.cfg, r.grads);
  model::layer_acts a;
  r.y = ops->forward(w, x, a, dropout_of(c));
  model::layer_stash s;
  r.dx = ops->backward_input(w, a, dy, s, c.norms_in_input_phase ? &g : nullptr);
  ops->backward_weight(w, a, s, g);
  return r;
}

// The same layer split over tp ranks; outputs and gradients gathered back to full tensors.
layer_result split_run(const layer_case& c, const named& params, const tensor& x, const tensor& dy,
                       int tp, bool sp) {
  const std::int64_t n = x.dim(0), rows = sp ? n / tp : n;
  const auto mine_of = [&](const tensor& t, int r) {
    return sp ? t.rows(r * rows, r * rows + rows).clone() : t.clone();
  };
  std::vector<layer_result> ranks(static_cast<std::size_t>(tp));
  run_group(tp, sp, model::kv_replicas(c.cfg, tp), [&](int r, actors::tp_group& g, kernels::backend& be) {
    named mine;
    for (const auto& [name, t] : params) mine[name] = model::shard_tensor(c.cfg, name, t, tp, r);
    layer_result& out = ranks[static_cast<std::size_t>(r)];
    out.grads = zeros_like(mine);
    auto ops = model::make_tp_layer_ops(c.cfg, be, core::dtype::f32, tp, g);
    const model::layer_tensors w = views(c.cfg, mine);
    model::layer_tensors gr = views(c.cfg, out.grads);
    model::layer_acts a;
    g.begin(0, 0, 0, actors::tp_phase::forward);
    out.y = ops->forward(w, mine_of(x, r), a, dropout_of(c)).clone();
    model::layer_stash s;
    g.begin(0, 0, 0, actors::tp_phase::backward_input);
    out.dx = ops->backward_input(w, a, mine_of(dy, r), s,
                                 c.norms_in_input_phase ? &gr : nullptr)
                 .clone();
    g.begin(0, 0, 0, actors::tp_phase::backward_weight);
    ops->backward_weight(w, a, s, gr);
  });
  layer_result full;
  std::vector<tensor> ys, dxs;
  for (const auto& r : ranks) ys.push_back(r.y), dxs.push_back(r.dx);
  if (sp) {
    full.y = concat_rows(ys);
    full.dx = concat_rows(dxs);
  } else {
    // Without sequence parallel every rank holds the whole residual stream, the same bits.
    for (int r = 1; r < tp; ++r) {
      CHECK(same_bits(ys[r], ys[0]));
      CHECK(same_bits(dxs[r], dxs[0]));
    }
    full.y = ys[0];
    full.dx = dxs[0];
  }
  for (const auto& [name, t] : params) {
    std::vector<tensor> parts;
    for (const auto& r : ranks) parts.push_back(r.grads.at(name));
    full.grads[name] = model::unshard_tensor(c.cfg, name, parts);
  }
  return full;
}

void check_layer(const layer_case& c, int tp, bool sp) {
  const std::string arch = c.cfg.arch == core::arch_kind::gpt2 ? "gpt2" : "llama";
  INFO("arch " << arch << ", kv heads "
               << c.cfg.kv_heads() << ", tp " << tp << ", sequence parallel " << sp
               << ", dropout " << c.dropout << ", norm grads in backward_input "
               << c.norms_in_input_phase);
  const model::chunk_spec spec{0, 1, false, false};
  const named params = random_params(c.cfg, spec, 100);
  const std::int64_t n = std::int64_t(c.batch) * c.cfg.seq_length, C = c.cfg.hidden_size;
  const tensor x = randn({n, C}, 1, 1.0f), dy = randn({n, C}, 2, 1.0f);
  const layer_result want = reference(c, params, x, dy);
  const layer_result got = split_run(c, params, x, dy, tp, sp);
  check_close(got.y, want.y, "output");
  check_close(got.dx, want.dx, "input gradient");
  for (const auto& [name, t] : want.grads) {
    REQUIRE(max_abs(t) > 0);  // every gradient is exercised
    check_close(got.grads.at(name), t, "gradient of " + name);
  }
}

}  // namespace

TEST_CASE("a GPT-2 layer split over tp 1, 2, 4 matches the unsplit layer, with and without sequence parallel") {
  for (int tp : {1, 2, 4})
    for (bool sp : {false, true})
      for (bool norms : {false, true}) {
        layer_case c{small(core::arch_kind::gpt2)};
        c.norms_in_input_phase = norms;
        check_layer(c, tp, sp);
      }
}

TEST_CASE("a LLaMA layer split over tp 1, 2, 4 matches the unsplit layer, key/value heads split or replicated") {
  // 4 kv heads split at every tp; 2 split at tp 2 and replicated at tp 4; 1 replicated.
  for (int kv : {4, 2, 1})
    for (int tp : {1, 2, 4})
      for (bool sp : {false, true}) {
        layer_case c{small(core::arch_kind::llama, kv)};
        c.norms_in_input_phase = sp;
        check_layer(c, tp, sp);
      }
}

TEST_CASE("tensor-parallel layers draw the unsplit layer's dropout masks") {
  // At tp 4 with sequence parallel a rank's 4 rows are half a sequence: its hidden masks come
  // from the whole micro-batch's; attention masks are drawn at the global head index.
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama})
    for (int tp : {2, 4})
      for (bool sp : {false, true}) {
        layer_case c{small(arch, arch == core::arch_kind::llama ? 2 : 0)};
        c.dropout = true;
        check_layer(c, tp, sp);
      }
}

TEST_CASE("a tensor-parallel layer run twice gives the same bits") {
  for (bool sp : {false, true}) {
    layer_case c{small(core::arch_kind::llama, 2)};
    c.dropout = true;
    const named params = random_params(c.cfg, {0, 1, false, false}, 7);
    const tensor x = randn({16, 32}, 3, 1.0f), dy = randn({16, 32}, 4, 1.0f);
    const layer_result a = split_run(c, params, x, dy, 4, sp);
    const layer_result b = split_run(c, params, x, dy, 4, sp);
    CHECK(same_bits(a.y, b.y));
    CHECK(same_bits(a.dx, b.dx));
    for (const auto& entry : a.grads) {  // no structured binding: clang 14 cannot capture one
      const auto& name = entry.first;
      const auto& t = entry.second;
      CHECK_MESSAGE(same_bits(t, b.grads.at(name)), name);
    }
  }
}

TEST_CASE("sharding every parameter and gathering it back gives the same bits") {
  for (auto [arch, kv] : {std::pair{core::arch_kind::gpt2, 0}, std::pair{core::arch_kind::llama, 4},
                          std::pair{core::arch_kind::llama, 2}, std::pair{core::arch_kind::llama, 1}}) {
    core::model_config cfg = small(arch, kv);
    cfg.num_layers = 2;
    const named params = random_params(cfg, {0, 2, true, true}, 11);
    for (int tp : {1, 2, 4}) {
      const model::layer_split s = model::split_of(cfg, tp, tp - 1);
      for (const auto& entry : params) {  // no structured binding: clang 14 cannot capture one
        const auto& name = entry.first;
        const auto& full = entry.second;
        std::vector<tensor> parts;
        for (int r = 0; r < tp; ++r) parts.push_back(model::shard_tensor(cfg, name, full, tp, r));
        CHECK_MESSAGE(same_bits(model::unshard_tensor(cfg, name, parts), full), name << " tp " << tp);
        if (name == "lm_head.weight") {
          // The vocabulary is padded to a multiple of tp: 50 rows become 13 per rank at tp 4.
          CHECK(parts[0].dim(0) == (cfg.vocab_size + tp - 1) / tp);
          CHECK(max_abs(parts.back().rows(model::vocab_range_of(50, tp, tp - 1).valid,
                                          parts.back().dim(0))) == 0);
        }
      }
      // The layer's local shapes follow the split.
      const std::int64_t d = cfg.head_dim();
      if (arch == core::arch_kind::llama) {
        const std::string k = "model.layers.0.self_attn.k_proj.weight";
        CHECK(model::shard_tensor(cfg, k, params.at(k), tp, tp - 1).dim(0) == s.kv_heads * d);
        CHECK(s.kv_replicated == (cfg.kv_heads() < tp));
      } else {
        const std::string qkv = "h.0.attn.c_attn.weight";
        CHECK(model::shard_tensor(cfg, qkv, params.at(qkv), tp, tp - 1).dim(0) == 3 * s.heads * d);
      }
    }
  }
  // GPT-2's fused c_attn is split per head: rank 1 of 2 holds heads 2 and 3 of q, k and v.
  core::model_config cfg = small(core::arch_kind::gpt2);
  const tensor full = randn({96, 32}, 5, 1.0f);
  const tensor part = model::shard_tensor(cfg, "h.0.attn.c_attn.weight", full, 2, 1);
  for (int b = 0; b < 3; ++b)
    CHECK(std::memcmp(part.rows(b * 16, b * 16 + 16).raw(), full.rows(b * 32 + 16, b * 32 + 32).raw(),
                      16 * 32 * sizeof(float)) == 0);
}

TEST_CASE("the vocabulary-parallel embedding matches the unsplit one, forward and backward") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama})
    for (int tp : {1, 2, 4})
      for (bool sp : {false, true}) {
        INFO("arch " << int(arch) << " tp " << tp << " sp " << sp);
        const core::model_config cfg = small(arch);
        named params = random_params(cfg, {0, 0, true, false}, 21);
        const std::int64_t n = 16, C = 32;
        tensor tokens = tensor::zeros({n}, core::dtype::i32);
        core::rng_stream rng(9);
        for (std::int64_t i = 0; i < n; ++i)
          tokens.data<std::int32_t>()[i] = static_cast<std::int32_t>(rng.below(50));
        tokens.data<std::int32_t>()[3] = 49;  // the last real row, on the padded rank at tp 4
        const tensor dout = randn({n, C}, 8, 1.0f);
        auto view = [](named& p) {
          return [&p](const std::string& name) { return p.at(name); };
        };
        // Reference.
        auto be = kernels::make_backend("cpu");
        model::embedding_tensors w = model::embedding_views(cfg, view(params));
        tensor want = tensor::zeros({n, C});
        be->embedding_forward(tokens, w.wte, w.wpe, cfg.seq_length, want);
        named want_g = zeros_like(params);
        model::embedding_tensors wg = model::embedding_views(cfg, view(want_g));
        be->embedding_backward(dout, tokens, cfg.seq_length, wg.wte, wg.wpe);

        const std::int64_t rows = sp ? n / tp : n;
        std::vector<tensor> outs(static_cast<std::size_t>(tp));
        std::vector<named> grads(static_cast<std::size_t>(tp));
        run_group(tp, sp, 1, [&](int r, actors::tp_group& g, kernels::backend& b) {
          named mine;
          for (const auto& [name, t] : params) mine[name] = model::shard_tensor(cfg, name, t, tp, r);
          grads[r] = zeros_like(mine);
          const model::embedding_tensors lw = model::embedding_views(cfg, view(mine));
          model::embedding_tensors lg = model::embedding_views(cfg, view(grads[r]));
          g.begin(0, -1, 0, actors::tp_phase::embedding_forward);
          outs[r] = model::vp_embedding_forward(g, b, lw, tokens, cfg.vocab_size, cfg.seq_length).clone();
          g.begin(0, -1, 0, actors::tp_phase::embedding_backward);
          model::vp_embedding_backward(g, b, sp ? dout.rows(r * rows, r * rows + rows).clone() : dout.clone(), tokens,
                                       cfg.vocab_size, cfg.seq_length, lg);
        });
        const tensor got = sp ? concat_rows(outs) : outs[0];
        CHECK(same_bits(got, want));  // one rank's row plus zeros: exact
        for (const auto& [name, t] : params) {
          std::vector<tensor> parts;
          for (const auto& gr : grads) parts.push_back(gr.at(name));
          check_close(model::unshard_tensor(cfg, name, parts), want_g.at(name), "gradient of " + name);
        }
      }
}

TEST_CASE("the vocabulary-parallel cross-entropy matches the full head and loss without gathering logits") {
  for (int tp : {1, 2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      const core::model_config cfg = small(core::arch_kind::llama);
      const std::int64_t n = 16, C = 32, V = cfg.vocab_size;
      const tensor h = randn({n, C}, 31, 1.0f), head = randn({V, C}, 32, 0.5f);
      tensor targets = tensor::zeros({n}, core::dtype::i32);
      for (std::int64_t i = 0; i < n; ++i) targets.data<std::int32_t>()[i] = static_cast<std::int32_t>((i * 7) % V);
      targets.data<std::int32_t>()[2] = -1;  // ignored
      targets.data<std::int32_t>()[5] = 49;  // the last real token, on the padded rank at tp 4
      const float scale = 1.0f / 15;
      // Reference: full logits, cross_entropy, then the head's backward.
      auto be = kernels::make_backend("cpu");
      tensor logits = tensor::zeros({n, V}), losses = tensor::zeros({n});
      be->linear_forward(h, head, {}, logits);
      be->cross_entropy(logits, targets, losses, scale);
      tensor dh = tensor::zeros({n, C}), dw = tensor::zeros({V, C}), none;
      be->linear_backward_input(logits, head, dh);
      be->linear_backward_weight(logits, h, dw, none);

      const std::int64_t rows = sp ? n / tp : n;
      std::vector<tensor> got_losses(tp), got_dh(tp), got_dw(tp);
      run_group(tp, sp, 1, [&](int r, actors::tp_group& g, kernels::backend& b) {
        const tensor w = model::shard_tensor(cfg, "lm_head.weight", head, tp, r);
        got_dw[r] = tensor::zeros(w.shape());
        g.begin(0, -2, 0, actors::tp_phase::loss);
        const model::vp_loss l = model::vp_cross_entropy(
            g, b, sp ? h.rows(r * rows, r * rows + rows).clone() : h.clone(), w, targets, V, scale, got_dw[r]);
        got_losses[r] = l.losses.clone();
        got_dh[r] = l.dh.clone();
      });
      for (int r = 1; r < tp; ++r) CHECK(same_bits(got_losses[r], got_losses[0]));
      check_close(got_losses[0], losses, "losses");
      CHECK(got_losses[0].data<float>()[2] == 0.0f);
      check_close(sp ? concat_rows(got_dh) : got_dh[0], dh, "gradient of h");
      check_close(model::unshard_tensor(cfg, "lm_head.weight", got_dw), dw, "gradient of lm_head");
    }
}
