// `troupe generate MODEL (--prompt TEXT)... [--prompts FILE] [--max-new-tokens N]
// [--temperature T] [--top-k K] [--top-p P] [--seed S] [--device D] [--dtype T]`: continues a batch
// of prompts with a key/value cache (model/generate.hpp): one prefill of all prompts, then one
// decode step per new token. MODEL is a troupe checkpoint (or run directory), whose manifest gives
// the model's config and the run's tokenizer (data.tokenizer), or a Hugging Face model directory
// (model/hf.hpp), whose config.json gives the model and which holds its tokenizer files;
// --tokenizer overrides either (model/text_tokenizer.hpp: GPT-2's files or a tokenizer.json).
//
// Output: each prompt followed by its continuation and a newline, in prompt order; the prompt
// being shown streams as its tokens arrive, the later ones are held until their turn. Text leaves
// through a utf8_stream, so stdout never carries half a UTF-8 character. The prefill and decode
// rates go to stderr.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "cli/model_source.hpp"
#include "core/config.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "model/generate.hpp"
#include "model/hf.hpp"
#include "model/text_tokenizer.hpp"
#include "model/tokenizer.hpp"
#include "kernels/select.hpp"

namespace troupe::cli {
namespace {

struct generate_args {
  std::string checkpoint;
  std::vector<std::string> prompts;
  std::string prompts_file;
  int max_new_tokens = 64;
  double temperature = 0.8;
  int top_k = 40;
  double top_p = 1.0;
  std::string seed = "0";  // parsed by parse_seed: CLI11 would wrap "-1" to 2^64 - 1
  std::string tokenizer_dir;
  std::string device;      // "" = the checkpoint's runtime.device
  std::string dtype = "fp32";
  int batch_size = 32;
  bool ignore_eos = false;
};

int fail(const core::error& e) {
  print_error(e.to_string());
  return 1;
}

/// A bound on the request itself; a sequence also stops at the model's positions.
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

core::result<core::precision_kind> parse_dtype(const std::string& text) {
  if (text == "fp32") return core::precision_kind::fp32;
  if (text == "bf16") return core::precision_kind::bf16;
  if (text == "fp16") return core::precision_kind::fp16;
  return core::error::make("--dtype '" + text + "' is not one of fp32, bf16, fp16",
                           "fp32 runs everywhere; bf16 and fp16 need --device cuda");
}

// Usage errors found after parsing (the numbers CLI11 lets through): exit 2.
core::status check_args(const generate_args& a) {
  if (a.prompts.empty() && a.prompts_file.empty())
    return core::error::make("no prompt given",
                             "pass --prompt TEXT (repeatable) and/or --prompts FILE");
  if (a.max_new_tokens > max_tokens)
    return core::error::make("--max-new-tokens " + std::to_string(a.max_new_tokens) +
                                 " is above the " + std::to_string(max_tokens) +
                                 " one call generates",
                             "a sequence stops at the model's seq_length positions anyway; ask "
                             "for at most that many");
  if (!std::isfinite(a.temperature) || a.temperature < 0 || a.temperature > max_temperature)
    return core::error::make("--temperature " + fmt::format("{}", a.temperature) +
                                 " is not a number in 0.." + fmt::format("{}", max_temperature),
                             "0 picks the most likely token; 0.8 is the usual sampling temperature");
  if (a.batch_size < 1)
    return core::error::make("--batch-size " + std::to_string(a.batch_size) + " is not 1 or more",
                             "32 sequences run side by side by default");
  if (!(a.top_p > 0 && a.top_p <= 1))
    return core::error::make("--top-p " + fmt::format("{}", a.top_p) +
                                 " is not a probability in (0, 1]",
                             "1 keeps every token; 0.9 samples from the most likely 90 %");
  if (auto s = parse_seed(a.seed); !s) return s.err();
  if (auto d = parse_dtype(a.dtype); !d) return d.err();
  return {};
}

/// The prompts of --prompts FILE: one per line (blank lines skipped), or for a name ending in
/// ".jsonl" one JSON object per line with a string "prompt" (instruction data reads as is).
core::result<std::vector<std::string>> read_prompts(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return core::error::at_file(path, "cannot open the prompts file",
                                "check the path given to --prompts");
  const bool jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  std::vector<std::string> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (!jsonl) {
      out.push_back(line);
      continue;
    }
    auto bad = [&](const std::string& what) {
      core::error e = core::error::at_file(
          path, what, "each line of a .jsonl prompts file is an object such as {\"prompt\": \"Hi\"}");
      e.where.line = n;
      return e;
    };
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) return bad("not valid JSON");
    if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string())
      return bad("no string \"prompt\" in this record");
    out.push_back(j["prompt"].get<std::string>());
  }
  if (in.bad()) return core::error::at_file(path, "read error", "check the file");
  if (out.empty())
    return core::error::at_file(path, "the prompts file holds no prompt",
                                "write one prompt per line");
  return out;
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

void write_out(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

/// Prints the prompts and their continuations in prompt order: the first unfinished prompt
/// streams, later ones collect their text until every earlier one is done.
class ordered_printer {
 public:
  explicit ordered_printer(const std::vector<std::string>& prompts)
      : prompts_(prompts), streams_(prompts.size()), held_(prompts.size()),
        done_(prompts.size(), false) {
    open(0);
  }
  void text(int i, const std::string& bytes) { emit(i, streams_[static_cast<std::size_t>(i)].push(bytes)); }
  void stop(int i) {
    const auto k = static_cast<std::size_t>(i);
    emit(i, streams_[k].finish());
    done_[k] = true;
    while (current_ < prompts_.size() && done_[current_]) {
      write_out("\n");
      if (++current_ < prompts_.size()) open(current_);
    }
  }

 private:
  void open(std::size_t i) {
    write_out(prompts_[i] + held_[i]);
    held_[i].clear();
  }
  void emit(int i, const std::string& piece) {
    if (static_cast<std::size_t>(i) == current_)
      write_out(piece);
    else
      held_[static_cast<std::size_t>(i)] += piece;
  }

  const std::vector<std::string>& prompts_;
  std::vector<model::utf8_stream> streams_;
  std::vector<std::string> held_;
  std::vector<bool> done_;
  std::size_t current_ = 0;
};

std::string rate(double tokens, double seconds) {
  return seconds > 0 ? fmt::format("{:.1f}", tokens / seconds) : std::string("-");
}

int run_generate(const generate_args& a) {
  if (auto st = check_args(a); !st) {
    print_error(st.err().to_string());
    return 2;
  }
  const std::uint64_t seed = parse_seed(a.seed).value();
  const core::precision_kind precision = parse_dtype(a.dtype).value();
  std::vector<std::string> texts = a.prompts;
  if (!a.prompts_file.empty()) {
    auto more = read_prompts(a.prompts_file);
    if (!more) return fail(more.err());
    texts.insert(texts.end(), more->begin(), more->end());
  }

  // The model: a Hugging Face directory (config.json + safetensors) or a troupe checkpoint, whose
  // manifest also names the tokenizer, device and threads of its run.
  auto src = open_model_source(a.checkpoint);
  if (!src) return fail(src.err());
  const core::model_config m = src->model;
  const core::runtime_config run = src->run ? src->run->runtime : core::runtime_config{};
  const std::string source = src->path;
  std::string tok_dir = a.tokenizer_dir;
  // A model directory's own tokenizer files (tokenizer.json, or GPT-2's encoder.json and
  // vocab.bpe); a checkpoint's run's data.tokenizer.
  if (tok_dir.empty()) tok_dir = src->run ? src->run->data.tokenizer_spec() : a.checkpoint;

  if (tok_dir.empty()) tok_dir = model::tokenizer::default_dir;
  auto loaded = model::load_tokenizer(tok_dir);
  if (!loaded) {
    core::error e = loaded.err();
    if (a.tokenizer_dir.empty() && src->hf_dir)
      e.hint = "the model directory holds no tokenizer troupe reads (tokenizer.json, or GPT-2's "
               "encoder.json and vocab.bpe); pass one with --tokenizer, e.g. --tokenizer data/gpt2";
    return fail(e);
  }
  const model::text_tokenizer& tok = *loaded.value();

  const std::string device = a.device.empty() ? run.device : a.device;
  if (device == "cpu" && precision != core::precision_kind::fp32)
    return fail(core::error::make("--dtype " + a.dtype + " on the cpu device",
                                  "the cpu backend computes in fp32; use --dtype fp32 or "
                                  "--device cuda"));
  std::vector<std::vector<int>> prompts;
  for (const std::string& t : texts) {
    std::vector<int> ids = tok.encode_for_model(t);
    // An empty prompt starts a text where documents begin: at BOS, or (GPT-2) at the end-of-text
    // token that separates them.
    if (ids.empty()) {
      const auto start = tok.bos_id() ? tok.bos_id() : tok.eos_id();
      if (!start)
        return fail(core::error::make("prompt " + std::to_string(prompts.size() + 1) +
                                          " is empty and " + tok.describe() +
                                          " has no BOS or EOS token to start from",
                                      "give the prompt some text"));
      ids.push_back(*start);
    }
    prompts.push_back(std::move(ids));
  }
  if (auto st = model::check_prompts(m, prompts); !st) return fail(st.err());

  kernels::set_cpu_threads(run.threads);
  kernels::set_gemm_tune_file(run.gemm_tune_file);
  std::unique_ptr<kernels::backend> be;
  try {
    be = kernels::make_backend(device);
  } catch (const core::failure& e) {
    return fail(core::error::make(std::string("--device ") + device + ": " + e.what(),
                                  "use --device cpu, or cuda on a machine with a GPU"));
  }
  model::chunk net(m, model::partition(m, 1)[0], *be, precision);
  if (auto st = src->load(*be, m, net); !st) return fail(st.err());
  if (auto st = check_finite(net, *be, source); !st) return fail(st.err());

  model::generate_options o;
  o.max_new_tokens = a.max_new_tokens;
  o.eos = a.ignore_eos ? -1 : tok.eos_id().value_or(-1);
  o.vocab = std::min(m.vocab_size, tok.vocab_size());
  o.sample = {a.temperature, a.top_k, a.top_p, seed};

  ordered_printer out(texts);
  std::vector<int> made(prompts.size(), 0);
  std::vector<model::token_text> pieces;
  for (const auto& p : prompts) pieces.emplace_back(tok, p);
  model::generate_sink sink;
  sink.token = [&](int i, int id) {
    ++made[static_cast<std::size_t>(i)];
    out.text(i, pieces[static_cast<std::size_t>(i)].next(id));
  };
  sink.stop = [&](int i, model::stop_reason r) {
    out.stop(i);
    if (r == model::stop_reason::positions)
      std::fprintf(stderr,
                   "generate: prompt %d stopped after %d new tokens at the model's %d positions "
                   "(model.seq_length)\n",
                   i + 1, made[static_cast<std::size_t>(i)], m.seq_length);
  };
  // The prompts run in batches of --batch-size sequences, one after the other (each batch's
  // cache holds only its own sequences); draws are keyed by the prompt's overall index.
  model::generate_stats st;
  for (std::size_t first = 0; first < prompts.size(); first += static_cast<std::size_t>(a.batch_size)) {
    const std::size_t last = std::min(prompts.size(), first + static_cast<std::size_t>(a.batch_size));
    const std::vector<std::vector<int>> part(prompts.begin() + static_cast<std::ptrdiff_t>(first),
                                             prompts.begin() + static_cast<std::ptrdiff_t>(last));
    o.index_base = static_cast<int>(first);
    model::generate_sink shifted;
    shifted.token = [&](int i, int id) { sink.token(o.index_base + i, id); };
    shifted.stop = [&](int i, model::stop_reason r) { sink.stop(o.index_base + i, r); };
    const model::generate_stats s = model::generate(net, *be, m, part, o, shifted);
    st.prompt_tokens += s.prompt_tokens;
    st.prefill_seconds += s.prefill_seconds;
    st.decode_tokens += s.decode_tokens;
    st.decode_steps += s.decode_steps;
    st.decode_seconds += s.decode_seconds;
    st.new_tokens += s.new_tokens;
  }
  std::fprintf(stderr,
               "generate: %zu prompt(s) on %s (%s): prefill %lld tokens in %.3f s (%s tokens/s); "
               "decode %lld tokens in %d steps, %.3f s (%s tokens/s)\n",
               prompts.size(), be->name().c_str(), a.dtype.c_str(),
               static_cast<long long>(st.prompt_tokens), st.prefill_seconds,
               rate(static_cast<double>(st.prompt_tokens), st.prefill_seconds).c_str(),
               static_cast<long long>(st.decode_tokens), st.decode_steps, st.decode_seconds,
               rate(static_cast<double>(st.decode_tokens), st.decode_seconds).c_str());
  return 0;
}

const command_registrar reg{command{
    "generate", "Continue prompts with a checkpoint (KV cache, batched)", [](CLI::App& app) {
      auto a = std::make_shared<generate_args>();
      app.add_option("checkpoint", a->checkpoint,
                     "checkpoint directory, run directory or Hugging Face model directory")
          ->required();
      app.add_option("--prompt", a->prompts, "text to continue (repeat for a batch)");
      app.add_option("--prompts", a->prompts_file,
                     "file of prompts: one per line, or JSON lines with \"prompt\" (.jsonl)");
      app.add_option("--max-new-tokens,--tokens", a->max_new_tokens,
                     "new tokens per prompt at most (a sequence also stops at EOS and at the "
                     "model's seq_length positions)")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--temperature", a->temperature, "softmax temperature; 0 = greedy")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--top-k,--top_k", a->top_k, "sample among the K most likely tokens; 0 = all")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      app.add_option("--top-p,--top_p", a->top_p,
                     "then among the most likely tokens whose probability reaches P; 1 = all")
          ->capture_default_str();
      app.add_option("--seed", a->seed, "seed of the sampling streams (0 .. 2^64-1)")
          ->capture_default_str();
      app.add_option("--tokenizer", a->tokenizer_dir,
                     "a tokenizer.json, a folder holding one, or a folder with GPT-2's "
                     "encoder.json and vocab.bpe (default: the run's data.tokenizer)");
      app.add_option("--device", a->device,
                     "cpu, cuda or cuda:N (default: the checkpoint's runtime.device)");
      app.add_option("--dtype", a->dtype, "compute precision: fp32, bf16 or fp16 (cuda)")
          ->capture_default_str();
      app.add_option("--batch-size", a->batch_size,
                     "prompts run side by side at most; more run in further batches")
          ->capture_default_str();
      app.add_flag("--ignore-eos", a->ignore_eos,
                   "do not stop at the end-of-text token (benchmarks: a fixed length)");
      return [a] { return run_generate(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
