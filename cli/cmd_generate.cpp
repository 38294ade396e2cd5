// `troupe generate CHECKPOINT --prompt TEXT [--tokens N] [--temperature T] [--top_k K] [--seed S]`:
// samples a continuation from a checkpoint. The model's config comes from the checkpoint's
// manifest; the tokenizer from its data.tokenizer_dir (or --tokenizer). Each new token runs the
// whole model over the last seq_length tokens, right-padded to seq_length: attention is causal, so
// the padding never reaches the position that is read, and one fixed shape serves every step.
// Draws come from a stream keyed by (seed, position), so a seed names a sample.
#include <algorithm>
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
  std::uint64_t seed = 0;
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

int run_generate(const generate_args& a) {
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
    core::rng_stream rng(core::stream_key(a.seed, 0x6e4e, ids.size()));
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
      app.add_option("--tokens", a->tokens, "tokens to generate")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--temperature", a->temperature, "softmax temperature; 0 = greedy")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--top_k", a->top_k, "sample among the K most likely tokens; 0 = all")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--seed", a->seed, "seed of the sampling stream")->capture_default_str();
      app.add_option("--tokenizer", a->tokenizer_dir,
                     "folder with encoder.json and vocab.bpe (default: the run's "
                     "data.tokenizer_dir)");
      return [a] { return run_generate(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
