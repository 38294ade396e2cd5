// `troupe generate CHECKPOINT --prompt TEXT [--tokens N] [--temperature T] [--top_k K] [--seed S]`:
// samples a continuation from a checkpoint. The model's config comes from the checkpoint's
// manifest; the tokenizer from its data.tokenizer_dir (or --tokenizer). Each new token runs the
// whole model over the last seq_length tokens, right-padded to seq_length: attention is causal, so
// the padding never reaches the position that is read, and one fixed shape serves every step.
// Draws come from a stream keyed by (seed, position), so a seed names a sample.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "core/config.hpp"
#include "core/rng.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "model/tokenizer.hpp"
#include "kernels/select.hpp"

namespace troupe::cli {
namespace {

struct generate_args {
  std::string checkpoint;
  std::string prompt;
  int tokens = 64;
  double temperature = 0.8;
  int top_k = 40;
  std::string seed = "0";  // parsed by parse_seed: CLI11 would wrap "-1" to 2^64 - 1
  std::string tokenizer_dir;
};

// Index drawn from softmax(logits / temperature) restricted to the top_k largest logits;
// temperature <= 0 picks the largest (the first one on ties).
int sample(const float* logits, int vocab, double temperature, int top_k, core::rng_stream& rng) {
  if (temperature <= 0) return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
  float threshold = -INFINITY;
  if (top_k > 0 && top_k < vocab) {
    std::vector<float> sorted(logits, logits + vocab);
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<>());
    threshold = sorted[static_cast<std::size_t>(top_k - 1)];
  }
  const float top = *std::max_element(logits, logits + vocab);
  std::vector<double> weights(static_cast<std::size_t>(vocab), 0.0);
  double total = 0;
  for (int i = 0; i < vocab; ++i)
    if (logits[i] >= threshold) total += weights[i] = std::exp((logits[i] - top) / temperature);
  double u = rng.uniform() * total;
  for (int i = 0; i < vocab; ++i) {
    u -= weights[i];
    if (u < 0) return i;
  }
  return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
}

int fail(const core::error& e) {
  print_error(e.to_string());
  return 1;
}

/// Each new token runs the whole model over seq_length positions: a million of them is days of
/// CPU time already. Larger requests are refused rather than left to run without end.
constexpr int max_tokens = 1 << 20;
/// exp(logit / T) stays a number for temperatures up to here; above, sampling is uniform anyway.
constexpr double max_temperature = 1e6;

core::result<std::uint64_t> parse_seed(const std::string& text) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size())
    return core::error::make("--seed '" + text + "' is not a whole number in 0.." +
                                 std::to_string(UINT64_MAX),
                             "pass a seed such as --seed 7; the same seed gives the same sample");
  return v;
}

// Usage errors found after parsing (the numbers CLI11 lets through): exit 2.
core::status check_args(const generate_args& a) {
  if (a.tokens > max_tokens)
    return core::error::make(
        "--tokens " + std::to_string(a.tokens) + " is above the " + std::to_string(max_tokens) +
            " one call generates",
        "each token runs the whole model over seq_length positions; generate in several calls, "
        "passing the text so far as --prompt");
  if (!std::isfinite(a.temperature) || a.temperature < 0 || a.temperature > max_temperature)
    return core::error::make("--temperature " + fmt::format("{}", a.temperature) +
                                 " is not a number in 0.." + fmt::format("{}", max_temperature),
                             "0 picks the most likely token; 0.8 is the usual sampling temperature");
  if (auto s = parse_seed(a.seed); !s) return s.err();
  return {};
}

// A checkpoint whose weights are not finite gives garbage (NaN logits sample token 0 forever):
// refuse it, naming the first tensor and index.
core::status check_finite(model::chunk& net, kernels::backend& be, const std::string& dir) {
  for (const auto& p : net.params()) {
    core::tensor t = net.param(p.name);
    if (!be.dev().is_cpu()) t = be.to_host(t);
    const float* v = t.data<float>();
    const std::int64_t n = t.numel();
    std::int64_t bad = 0, first = -1;
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::isfinite(v[i]) && bad++ == 0) first = i;
    if (bad > 0) {
      core::error e = core::error::at_file(
          dir, std::to_string(bad) + " of the " + std::to_string(n) +
                   " weights are NaN or infinite (the first at index " + std::to_string(first) +
                   "): the model cannot generate text",
          "the training diverged before this checkpoint was saved; generate from an earlier one");
      e.where.key = "tensor '" + p.name + "'";
      return e;
    }
  }
  return {};
}

int run_generate(const generate_args& a) {
  if (auto st = check_args(a); !st) {
    print_error(st.err().to_string());
    return 2;
  }
  const std::uint64_t seed = parse_seed(a.seed).value();
  auto dir = model::checkpoint::resolve(a.checkpoint);
  if (!dir) return fail(dir.err());
  auto ck = model::checkpoint::reader::open(dir.value());
  if (!ck) return fail(ck.err());
  auto cfg = core::parse_config(ck->info().config_toml, dir.value() + "/manifest.json");
  if (!cfg) return fail(cfg.err());
  const core::model_config& m = cfg->model;

  std::string tok_dir = a.tokenizer_dir;
  if (tok_dir.empty()) tok_dir = cfg->data.tokenizer_dir;
  if (tok_dir.empty()) tok_dir = model::tokenizer::default_dir;
  auto tok = model::tokenizer::load(tok_dir);
  if (!tok) return fail(tok.err());

  kernels::set_cpu_threads(cfg->runtime.threads);
  kernels::set_gemm_tune_file(cfg->runtime.gemm_tune_file);
  auto be = kernels::make_backend(cfg->runtime.device);
  model::chunk net(m, model::partition(m, 1)[0], *be);
  if (auto st = model::checkpoint::restore(ck.value(), *be, m, net, nullptr); !st)
    return fail(st.err());
  if (auto st = check_finite(net, *be, dir.value()); !st) return fail(st.err());

  std::vector<int> ids = tok->encode(a.prompt);
  if (ids.empty()) ids.push_back(model::tokenizer::eot_id);
  for (int id : ids)
    if (id >= m.vocab_size)
      return fail(core::error::make("prompt token " + std::to_string(id) +
                                        " is outside the model's vocabulary of " +
                                        std::to_string(m.vocab_size),
                                    "the checkpoint was trained with a smaller vocabulary"));
  const int vocab = std::min(m.vocab_size, tok->vocab_size());
  const int T = m.seq_length;

  std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
  std::fflush(stdout);
  core::tensor input = core::tensor::zeros({T}, core::dtype::i32);
  for (int n = 0; n < a.tokens; ++n) {
    const std::size_t len = std::min<std::size_t>(ids.size(), static_cast<std::size_t>(T));
    const int* window = ids.data() + (ids.size() - len);
    std::int32_t* in = input.data<std::int32_t>();
    for (int t = 0; t < T; ++t)
      in[t] = t < static_cast<int>(len) ? window[t] : model::tokenizer::eot_id % m.vocab_size;
    core::tensor logits = be->to_host(net.forward_logits(be->dev().is_cpu() ? input : be->from_host(input)));
    const float* row = logits.data<float>() + (len - 1) * static_cast<std::size_t>(m.vocab_size);
    core::rng_stream rng(core::stream_key(seed, 0x6e4e, ids.size()));
    int next = sample(row, vocab, a.temperature, a.top_k, rng);
    ids.push_back(next);
    const std::string& bytes = tok->token_bytes(next);
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    std::fflush(stdout);
  }
  std::printf("\n");
  return 0;
}

const command_registrar reg{command{
    "generate", "Sample text from a checkpoint", [](CLI::App& app) {
      auto a = std::make_shared<generate_args>();
      app.add_option("checkpoint", a->checkpoint, "checkpoint directory or run directory")
          ->required();
      app.add_option("--prompt", a->prompt, "text to continue")->required();
      app.add_option("--tokens", a->tokens, "tokens to generate (at most 1048576)")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--temperature", a->temperature, "softmax temperature; 0 = greedy")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--top_k", a->top_k, "sample among the K most likely tokens; 0 = all")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--seed", a->seed, "seed of the sampling stream (0 .. 2^64-1)")
          ->capture_default_str();
      app.add_option("--tokenizer", a->tokenizer_dir,
                     "folder with encoder.json and vocab.bpe (default: the run's "
                     "data.tokenizer_dir)");
      return [a] { return run_generate(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
