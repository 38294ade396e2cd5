// Whole-model gradient checks. An independent float64 implementation of both model families,
// written from their definitions (not from the chunk code), provides (1) a reference loss that
// the chunk's fp32 forward must match and (2) central finite differences that the chunk's
// analytic fp32 gradients must match, for a sample of entries of every parameter tensor.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "core/rng.hpp"
#include "kernels/backend.hpp"
#include "kernels/select.hpp"
#include "model/chunk.hpp"
#include "tests/model/chunk_harness.hpp"

namespace troupe::model {
namespace {

using vec = std::vector<double>;
using params_t = std::map<std::string, vec>;

/// y[n, o] = Σ_i x[n, i] w[o, i] (+ b[o]).
vec linear(const vec& x, std::int64_t rows, std::int64_t in, const vec& w, std::int64_t out,
           const vec* b = nullptr) {
  vec y(rows * out);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (std::int64_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  return y;
}

/// The float64 reference model, reading parameters by their Hugging Face names.
struct reference {
  core::model_config cfg;
  int ffn;
  dropout_ctx drop{};  // the masks of a training forward (none by default)

  /// Inverted dropout's factor for element `within` of the micro-batch's sequence `b`: 0 or
  /// 1/(1-p) where `site` of `layer` drops, 1 where it is off. The mask is the chunk's (fixed, so
  /// the loss stays a smooth function of the parameters); the arithmetic around it is this file's.
  double mask(int layer, dropout_site site, std::int64_t b, std::int64_t within) const {
    const kernels::dropout_spec s = drop.at(layer, site);
    if (!s.on()) return 1.0;
    const auto bits = core::dropout_bits(s.key, static_cast<std::uint64_t>(s.first_sample + b),
                                         static_cast<std::uint64_t>(within));
    return bits >= core::dropout_threshold(s.p) ? 1.0 / (1.0 - static_cast<double>(s.p)) : 0.0;
  }

  /// Linear module `module` (weight [out, in], optional bias) plus its LoRA adapter when the
  /// parameters hold one: y += (alpha / rank) · (x·Aᵀ)·Bᵀ.
  vec lin(const params_t& p, const std::string& module, const vec& x, std::int64_t rows,
          std::int64_t in, std::int64_t out, bool bias) const {
    vec y = linear(x, rows, in, p.at(module + ".weight"), out,
                   bias ? &p.at(module + ".bias") : nullptr);
    auto a = p.find(module + ".lora_A.weight");
    if (a == p.end()) return y;
    const std::int64_t r = cfg.lora.rank;
    const double s = cfg.lora.alpha / r;
    vec h = linear(x, rows, in, a->second, r);
    vec d = linear(h, rows, r, p.at(module + ".lora_B.weight"), out);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += s * d[i];
    return y;
  }

  vec norm(const params_t& p, const std::string& prefix, const vec& x, std::int64_t rows) const {
    const std::int64_t c = cfg.hidden_size;
    const vec& w = p.at(prefix + "weight");
    vec y(x.size());
    for (std::int64_t r = 0; r < rows; ++r) {
      const double* xr = &x[r * c];
      if (cfg.arch == core::arch_kind::gpt2) {
        const vec& b = p.at(prefix + "bias");
        double mean = 0, var = 0;
        for (std::int64_t j = 0; j < c; ++j) mean += xr[j];
        mean /= c;
        for (std::int64_t j = 0; j < c; ++j) var += (xr[j] - mean) * (xr[j] - mean);
        var /= c;
        const double rstd = 1.0 / std::sqrt(var + cfg.norm_eps);
        for (std::int64_t j = 0; j < c; ++j) y[r * c + j] = (xr[j] - mean) * rstd * w[j] + b[j];
      } else {
        double ms = 0;
        for (std::int64_t j = 0; j < c; ++j) ms += xr[j] * xr[j];
        const double rstd = 1.0 / std::sqrt(ms / c + cfg.norm_eps);
        for (std::int64_t j = 0; j < c; ++j) y[r * c + j] = xr[j] * rstd * w[j];
      }
    }
    return y;
  }

  /// Rotate-half RoPE of one head vector at position t.
  void rope(double* v, int t) const {
    const int d = cfg.head_dim(), half = d / 2;
    for (int i = 0; i < half; ++i) {
      const double freq = std::pow(cfg.rope_theta, -2.0 * i / d);
      const double cs = std::cos(t * freq), sn = std::sin(t * freq);
      const double a = v[i], b = v[i + half];
      v[i] = a * cs - b * sn;
      v[i + half] = b * cs + a * sn;
    }
  }

  /// Causal attention; q [N, H*D], k and v [N, Hkv*D]; query head h reads kv head h / (H/Hkv).
  vec attention(const vec& q, const vec& k, const vec& v, int batch, int layer) const {
    const int t_len = cfg.seq_length, h_n = cfg.num_heads, kv_n = cfg.kv_heads(),
              d = cfg.head_dim();
    vec out(static_cast<std::size_t>(batch) * t_len * h_n * d);
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < h_n; ++h) {
        const int kh = h / (h_n / kv_n);
        for (int t = 0; t < t_len; ++t) {
          const double* qr = &q[((b * t_len + t) * h_n + h) * d];
          std::vector<double> s(t + 1);
          double mx = -1e300;
          for (int u = 0; u <= t; ++u) {
            const double* kr = &k[((b * t_len + u) * kv_n + kh) * d];
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += qr[i] * kr[i];
            s[u] = dot / std::sqrt(static_cast<double>(d));
            mx = std::max(mx, s[u]);
          }
          double z = 0;
          for (auto& e : s) z += (e = std::exp(e - mx));
          double* o = &out[((b * t_len + t) * h_n + h) * d];
          for (int u = 0; u <= t; ++u) {
            const double* vr = &v[((b * t_len + u) * kv_n + kh) * d];
            const double m =
                mask(layer, dropout_site::attention, b, (std::int64_t(h) * t_len + t) * t_len + u);
            for (int i = 0; i < d; ++i) o[i] += s[u] / z * m * vr[i];
          }
        }
      }
    return out;
  }

  /// grad_scale × Σ_rows cross-entropy (negative targets skipped).
  double loss(const params_t& p, const std::vector<int>& tokens, const std::vector<int>& targets,
              double grad_scale) const {
    const std::int64_t n = tokens.size(), c = cfg.hidden_size, t_len = cfg.seq_length;
    const int batch = static_cast<int>(n / t_len), h_n = cfg.num_heads, kv_n = cfg.kv_heads(),
              d = cfg.head_dim();
    const bool gpt2 = cfg.arch == core::arch_kind::gpt2;
    vec x(n * c);
    const vec& wte = p.at(gpt2 ? "wte.weight" : "model.embed_tokens.weight");
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t j = 0; j < c; ++j) {
        x[r * c + j] = wte[tokens[r] * c + j];
        if (gpt2) x[r * c + j] += p.at("wpe.weight")[(r % t_len) * c + j];
        x[r * c + j] *= mask(0, dropout_site::embedding, r / t_len, (r % t_len) * c + j);
      }
    // Element i of a hidden state [N, C]: sequence i / (T·C), position i % (T·C).
    const auto hidden_mask = [&](int l, dropout_site site, std::size_t i) {
      return mask(l, site, static_cast<std::int64_t>(i) / (t_len * c),
                  static_cast<std::int64_t>(i) % (t_len * c));
    };
    for (int l = 0; l < cfg.num_layers; ++l) {
      const std::string pre = gpt2 ? "h." + std::to_string(l) + "."
                                   : "model.layers." + std::to_string(l) + ".";
      vec a = norm(p, pre + (gpt2 ? "ln_1." : "input_layernorm."), x, n);
      vec q, k, v;
      if (gpt2) {
        vec qkv = lin(p, pre + "attn.c_attn", a, n, c, 3 * c, true);
        q.resize(n * c), k.resize(n * c), v.resize(n * c);
        for (std::int64_t r = 0; r < n; ++r)
          for (std::int64_t j = 0; j < c; ++j) {
            q[r * c + j] = qkv[r * 3 * c + j];
            k[r * c + j] = qkv[r * 3 * c + c + j];
            v[r * c + j] = qkv[r * 3 * c + 2 * c + j];
          }
      } else {
        q = lin(p, pre + "self_attn.q_proj", a, n, c, h_n * d, false);
        k = lin(p, pre + "self_attn.k_proj", a, n, c, kv_n * d, false);
        v = lin(p, pre + "self_attn.v_proj", a, n, c, kv_n * d, false);
        for (std::int64_t r = 0; r < n; ++r) {
          for (int h = 0; h < h_n; ++h) rope(&q[(r * h_n + h) * d], static_cast<int>(r % t_len));
          for (int h = 0; h < kv_n; ++h) rope(&k[(r * kv_n + h) * d], static_cast<int>(r % t_len));
        }
      }
      vec att = attention(q, k, v, batch, l);
      vec proj = gpt2 ? lin(p, pre + "attn.c_proj", att, n, c, c, true)
                      : lin(p, pre + "self_attn.o_proj", att, n, c, c, false);
      for (std::size_t i = 0; i < x.size(); ++i)
        x[i] += proj[i] * hidden_mask(l, dropout_site::attention_out, i);
      vec m = norm(p, pre + (gpt2 ? "ln_2." : "post_attention_layernorm."), x, n);
      vec out;
      if (gpt2) {
        vec h = lin(p, pre + "mlp.c_fc", m, n, c, ffn, true);
        for (auto& e : h)
          e = 0.5 * e * (1 + std::tanh(std::sqrt(2 / M_PI) * (e + 0.044715 * e * e * e)));
        out = lin(p, pre + "mlp.c_proj", h, n, ffn, c, true);
      } else {
        vec g = lin(p, pre + "mlp.gate_proj", m, n, c, ffn, false);
        vec u = lin(p, pre + "mlp.up_proj", m, n, c, ffn, false);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
        out = lin(p, pre + "mlp.down_proj", g, n, ffn, c, false);
      }
      for (std::size_t i = 0; i < x.size(); ++i)
        x[i] += out[i] * hidden_mask(l, dropout_site::mlp_out, i);
    }
    vec f = norm(p, gpt2 ? "ln_f." : "model.norm.", x, n);
    vec logits = linear(f, n, c, p.at("lm_head.weight"), cfg.vocab_size);
    double total = 0;
    for (std::int64_t r = 0; r < n; ++r) {
      if (targets[r] < 0) continue;
      const double* lr = &logits[r * cfg.vocab_size];
      const double mx = *std::max_element(lr, lr + cfg.vocab_size);
      double z = 0;
      for (int j = 0; j < cfg.vocab_size; ++j) z += std::exp(lr[j] - mx);
      total += mx + std::log(z) - lr[targets[r]];
    }
    return total * grad_scale;
  }
};

/// Parameters far from the usual tiny init, so that every path carries a sizeable gradient.
void randomise(chunk& c, kernels::backend& be, std::uint64_t seed) {
  core::rng_stream rng(seed);
  std::vector<param_info> all = c.params();
  all.insert(all.end(), c.frozen_params().begin(), c.frozen_params().end());
  for (const auto& p : all) {
    tensor h = tensor::zeros(p.shape);
    const bool norm_w = p.shape.size() == 1 && p.name.find("bias") == std::string::npos;
    const float scale = p.shape.size() == 2 ? 0.3f : 0.2f;
    for (std::int64_t i = 0; i < h.numel(); ++i)
      h.data<float>()[i] = (norm_w ? 1.0f : 0.0f) + scale * rng.normal();
    tensor dst = c.param(p.name);
    be.copy(h, dst);
  }
  c.params_updated();
}

/// With `masked_mean`, targets are masked like instruction rows (a prompt at the start of each
/// sequence, padding at the end of the second) and the loss is their mean: grad_scale is
/// 1 / the trained targets, and the float64 reference divides its sum by the count it makes itself.
/// With `dropout`, both rates are set and the chunk's forward draws the masks of a training
/// micro-batch (a step and first sequence other than 0), which the reference applies too.
/// `hidden` (when not 0) replaces the tiny config's width.
void check_gradients(core::arch_kind arch, const core::lora_config& lora = {},
                     bool masked_mean = false, bool dropout = false, int hidden = 0) {
  auto be = kernels::make_backend("cpu");
  core::model_config cfg = model::testing::tiny_config(arch);
  cfg.lora = lora;
  if (hidden > 0) cfg.hidden_size = hidden;
  if (dropout) {
    cfg.attention_dropout = 0.25f;
    cfg.hidden_dropout = 0.2f;
  }
  const dropout_ctx drop = dropout ? training_dropout(cfg, 1234, 3, 10) : dropout_ctx{};
  chunk whole(cfg, partition(cfg, 1)[0], *be);
  randomise(whole, *be, 99);
  const int batch = 2;
  const std::int64_t n = static_cast<std::int64_t>(batch) * cfg.seq_length;
  tensor tokens = model::testing::random_tokens(cfg, batch, 5);
  tensor targets = model::testing::random_tokens(cfg, batch, 6);
  targets.data<std::int32_t>()[3] = -1;  // an ignored row
  std::int64_t trained = n;
  if (masked_mean) {
    const int T = cfg.seq_length;
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t t = r % T;
      if (t < 3 || (r >= T && t >= T - 2)) targets.data<std::int32_t>()[r] = -1;
    }
    trained = 0;
    for (std::int64_t r = 0; r < n; ++r) trained += targets.data<std::int32_t>()[r] >= 0;
    REQUIRE(trained < n - 4);
  }
  const float grad_scale = 1.0f / static_cast<float>(trained);

  whole.zero_grads();
  whole.forward(0, tokens, targets, grad_scale, drop);
  const double loss = whole.loss_sum(0) * grad_scale;
  whole.backward(0, {});

  reference ref{cfg, cfg.ffn_hidden_size > 0 ? cfg.ffn_hidden_size : 4 * cfg.hidden_size, drop};
  params_t p;
  std::vector<chunk> one;
  one.push_back(std::move(whole));
  for (auto& [name, v] : model::testing::by_name(one, *be, false)) p[name] = vec(v.begin(), v.end());
  for (const auto& f : one[0].frozen_params()) {
    tensor t = be->to_host(one[0].param(f.name));
    p[f.name] = vec(t.data<float>(), t.data<float>() + t.numel());
  }
  const auto grads = model::testing::by_name(one, *be, true);
  std::vector<int> tok(tokens.data<std::int32_t>(), tokens.data<std::int32_t>() + n);
  std::vector<int> tgt(targets.data<std::int32_t>(), targets.data<std::int32_t>() + n);
  // The reference's own mean: Σ over its unmasked targets / their count.
  const double ref_scale = masked_mean ? 1.0 / static_cast<double>(std::count_if(
                                                   tgt.begin(), tgt.end(), [](int t) { return t >= 0; }))
                                       : grad_scale;
  const double ref_loss = ref.loss(p, tok, tgt, ref_scale);
  INFO("chunk loss " << loss << ", float64 reference " << ref_loss);
  CHECK(std::abs(loss - ref_loss) <= 1e-5 * std::abs(ref_loss));

  core::rng_stream pick(7);
  const double h = 1e-5;
  double worst = 0;
  std::string worst_name;
  for (auto& entry : grads) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    auto& g = entry.second;
    vec& values = p.at(name);
    // Sampled entries plus the largest-gradient one.
    std::vector<std::size_t> idx;
    for (int i = 0; i < 6; ++i) idx.push_back(pick.below(values.size()));
    idx.push_back(std::max_element(g.begin(), g.end(),
                                   [](float a, float b) { return std::abs(a) < std::abs(b); }) -
                  g.begin());
    double diff2 = 0, norm2 = 0;
    for (std::size_t i : idx) {
      const double keep = values[i];
      values[i] = keep + h;
      const double up = ref.loss(p, tok, tgt, ref_scale);
      values[i] = keep - h;
      const double down = ref.loss(p, tok, tgt, ref_scale);
      values[i] = keep;
      const double numeric = (up - down) / (2 * h);
      diff2 += (g[i] - numeric) * (g[i] - numeric);
      norm2 += numeric * numeric + static_cast<double>(g[i]) * g[i];
    }
    INFO(name << ": largest |grad| " << std::abs(g[idx.back()]));
    REQUIRE(norm2 > 0);  // every tensor must carry gradient, or the check proves nothing
    const double rel = std::sqrt(diff2 / norm2);
    CHECK(rel < 1e-4);
    if (rel > worst) worst = rel, worst_name = name;
  }
  MESSAGE("worst relative error " << worst << " (" << worst_name << ")");
}

TEST_CASE("gpt2 analytic gradients match float64 finite differences for every tensor") {
  check_gradients(core::arch_kind::gpt2);
}

TEST_CASE("llama analytic gradients match float64 finite differences for every tensor") {
  check_gradients(core::arch_kind::llama);
}

TEST_CASE("llama gradients match float64 finite differences with q, k and v back to back") {
  // At width 64 each projection fills whole 1024-element blocks of the flat buffer, so the three
  // lie back to back and the layer runs them as one matrix in place (llama_layer.cpp); at the
  // tiny width above they are apart and the layer stacks copies.
  core::model_config cfg = model::testing::tiny_config(core::arch_kind::llama);
  cfg.hidden_size = 64;
  auto be = kernels::make_backend("cpu");
  chunk c(cfg, partition(cfg, 1)[0], *be);
  std::map<std::string, param_info> at;
  for (const auto& p : c.params()) at[p.name] = p;
  const std::string l = "model.layers.0.self_attn.";
  const param_info &q = at.at(l + "q_proj.weight"), &k = at.at(l + "k_proj.weight"),
                   &v = at.at(l + "v_proj.weight");
  CHECK(k.offset == q.offset + q.numel);
  CHECK(v.offset == k.offset + k.numel);
  check_gradients(core::arch_kind::llama, {}, false, false, 64);
}

// LoRA: the adapters of every linear module (and, trained in full beside them, the norms) against
// the float64 model with y = x·Wᵀ + (alpha/r)·(x·Aᵀ)·Bᵀ; the frozen base weights get no gradient.
TEST_CASE("gpt2 LoRA adapter gradients match float64 finite differences") {
  core::lora_config l;
  l.rank = 3;
  l.alpha = 5;
  l.targets = {"c_attn", "c_proj", "c_fc"};
  l.trainable = {"ln_1", "ln_f"};
  check_gradients(core::arch_kind::gpt2, l);
}

TEST_CASE("llama LoRA adapter gradients match float64 finite differences") {
  core::lora_config l;
  l.rank = 2;
  l.alpha = 3;
  l.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  l.trainable = {"post_attention_layernorm"};
  check_gradients(core::arch_kind::llama, l);
}

// Dropout on every site (embedding, attention probabilities, both residual branches) with the
// masks held fixed: the analytic gradients, masks redrawn in the backward, against float64
// finite differences of the same masked model.
TEST_CASE("gradients with dropout on match float64 finite differences (gpt2, llama)") {
  check_gradients(core::arch_kind::gpt2, {}, false, true);
  check_gradients(core::arch_kind::llama, {}, false, true);
}

TEST_CASE("gradients of the masked mean loss match float64 finite differences (gpt2, llama)") {
  check_gradients(core::arch_kind::gpt2, {}, true);
  check_gradients(core::arch_kind::llama, {}, true);
}

}  // namespace
}  // namespace troupe::model
