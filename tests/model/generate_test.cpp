// Generation with a key/value cache (model/generate.hpp) against recomputing the whole sequence
// for every token, sampling, and the UTF-8 stream.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kernels/select.hpp"
#include "model/generate.hpp"
#include "model/tokenizer.hpp"
#include "tests/model/chunk_harness.hpp"

using namespace troupe;
using namespace troupe::model;

namespace {

/// A model large enough to have varied greedy continuations: T = 24, V = 61, weights drawn wider
/// than GPT-2's 0.02 so logits spread and the argmax is far from ties.
core::model_config gen_config(core::arch_kind arch) {
  core::model_config m = testing::tiny_config(arch, 2);
  m.hidden_size = 32;
  m.seq_length = 24;
  m.vocab_size = 61;
  m.init_std = 0.3f;
  m.ffn_hidden_size = arch == core::arch_kind::llama ? 48 : 0;
  return m;
}

/// The reference: each new token runs the model over the whole sequence so far (right-padded to
/// seq_length, read at the last real row; the training forward, causal attention over all rows)
/// and takes the largest logit (lowest id on ties). Stops at `eos`, after max_new tokens or when
/// the sequence fills seq_length.
std::vector<int> recompute_greedy(chunk& net, kernels::backend& be, const core::model_config& m,
                                  std::vector<int> ids, int max_new, int eos) {
  std::vector<int> out;
  const int T = m.seq_length;
  while (static_cast<int>(out.size()) < max_new && static_cast<int>(ids.size()) < T) {
    tensor input = tensor::zeros({T}, core::dtype::i32);
    for (std::size_t t = 0; t < ids.size(); ++t) input.data<std::int32_t>()[t] = ids[t];
    tensor logits = be.to_host(net.forward_logits(input));
    const float* row = logits.data<float>() + (ids.size() - 1) * static_cast<std::size_t>(m.vocab_size);
    const int next = static_cast<int>(std::max_element(row, row + m.vocab_size) - row);
    if (next == eos) break;
    out.push_back(next);
    ids.push_back(next);
  }
  return out;
}

struct outcome {
  std::vector<std::vector<int>> tokens;
  std::vector<stop_reason> stops;
  generate_stats stats;
};

outcome run(chunk& net, kernels::backend& be, const core::model_config& m,
            const std::vector<std::vector<int>>& prompts, const generate_options& o) {
  outcome r;
  r.tokens.resize(prompts.size());
  r.stops.resize(prompts.size(), stop_reason::eos);
  std::vector<int> stopped(prompts.size(), 0);
  generate_sink sink;
  sink.token = [&](int i, int id) {
    REQUIRE(stopped[static_cast<std::size_t>(i)] == 0);
    r.tokens[static_cast<std::size_t>(i)].push_back(id);
  };
  sink.stop = [&](int i, stop_reason why) {
    ++stopped[static_cast<std::size_t>(i)];
    r.stops[static_cast<std::size_t>(i)] = why;
  };
  r.stats = generate(net, be, m, prompts, o, sink);
  for (int s : stopped) CHECK(s == 1);
  return r;
}

const std::vector<std::vector<int>> kPrompts = {
    {5}, {1, 2, 3, 4, 5, 6, 7}, {40, 41, 13}, {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17}};

}  // namespace

TEST_CASE("KV-cache greedy equals full-recompute greedy token for token, GPT-2 and LLaMA-GQA") {
  auto be = kernels::make_backend("cpu");
  std::set<stop_reason> reasons;
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    const core::model_config m = gen_config(arch);
    CAPTURE(static_cast<int>(arch));
    chunk net(m, partition(m, 1)[0], *be);
    net.init(11);
    generate_options o;
    o.max_new_tokens = 12;
    o.eos = 60;
    o.sample.temperature = 0;
    // A batch of prompts of different lengths; the longest can fill the 24 positions after 7.
    const outcome batch = run(net, *be, m, kPrompts, o);
    std::set<int> distinct;
    for (std::size_t i = 0; i < kPrompts.size(); ++i) {
      CAPTURE(i);
      const auto want = recompute_greedy(net, *be, m, kPrompts[i], o.max_new_tokens, o.eos);
      CHECK(batch.tokens[i] == want);
      distinct.insert(want.begin(), want.end());
      // Why it stopped follows from the reference's length.
      const int budget = std::min(o.max_new_tokens, m.seq_length - static_cast<int>(kPrompts[i].size()));
      const stop_reason why = static_cast<int>(want.size()) < budget ? stop_reason::eos
                              : budget == o.max_new_tokens          ? stop_reason::max_new_tokens
                                                                    : stop_reason::positions;
      CHECK(batch.stops[i] == why);
      reasons.insert(why);
      // Alone, the prompt continues the same way.
      CHECK(run(net, *be, m, {kPrompts[i]}, o).tokens[0] == want);
    }
    // The continuations are not a constant (which any bug could reproduce).
    CHECK(distinct.size() >= 5);
    CHECK(batch.stats.prompt_tokens == 1 + 7 + 3 + 17);
  }
  // The batches stopped sequences at EOS, at max_new_tokens and at the positions limit.
  CHECK(reasons.size() == 3);
}

TEST_CASE("LLaMA cached decode matches recompute with a batch where all prompts have one length") {
  // Equal lengths put several slots' rows at the same positions in one call.
  auto be = kernels::make_backend("cpu");
  const core::model_config m = gen_config(core::arch_kind::llama);
  chunk net(m, partition(m, 1)[0], *be);
  net.init(3);
  const std::vector<std::vector<int>> prompts = {{1, 2, 3}, {3, 2, 1}, {7, 7, 7}};
  generate_options o;
  o.max_new_tokens = 20;
  o.sample.temperature = 0;
  const outcome r = run(net, *be, m, prompts, o);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CHECK(r.tokens[i] == recompute_greedy(net, *be, m, prompts[i], 20, -1));
    CHECK(r.stops[i] == stop_reason::max_new_tokens);
  }
}

TEST_CASE("a seed names a sample; another seed gives another; top_k 1 is greedy") {
  auto be = kernels::make_backend("cpu");
  const core::model_config m = gen_config(core::arch_kind::gpt2);
  chunk net(m, partition(m, 1)[0], *be);
  net.init(5);
  generate_options o;
  o.max_new_tokens = 10;
  o.sample = {1.0, 0, 1.0, 7};
  const outcome a = run(net, *be, m, kPrompts, o);
  const outcome b = run(net, *be, m, kPrompts, o);
  CHECK(a.tokens == b.tokens);
  o.sample.seed = 8;
  CHECK(run(net, *be, m, kPrompts, o).tokens != a.tokens);
  // The draws of prompt i depend on (seed, i, position), not on the rest of the batch.
  o.sample.seed = 7;
  CHECK(run(net, *be, m, {kPrompts[0]}, o).tokens[0] == a.tokens[0]);

  generate_options greedy = o;
  greedy.sample.temperature = 0;
  const outcome g = run(net, *be, m, kPrompts, greedy);
  o.sample = {1.5, 1, 1.0, 99};
  CHECK(run(net, *be, m, kPrompts, o).tokens == g.tokens);
  // top_p small enough to keep one token is greedy too.
  o.sample = {1.0, 0, 1e-6, 99};
  CHECK(run(net, *be, m, kPrompts, o).tokens == g.tokens);
}

TEST_CASE("sample_token keeps the top_k and the top_p nucleus and draws in proportion") {
  // Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
  const std::vector<float> logits = {std::log(0.3f), std::log(0.05f), std::log(0.5f),
                                     std::log(0.15f)};
  auto draw = [&](sampling s, int n) {
    std::map<int, int> count;
    for (int i = 0; i < n; ++i) {
      auto rng = sample_stream(s.seed, 0, i);
      ++count[sample_token(logits.data(), 4, s, rng)];
    }
    return count;
  };
  const int n = 4000;
  auto all = draw({1.0, 0, 1.0, 1}, n);
  CHECK(all[2] == doctest::Approx(0.5 * n).epsilon(0.08));
  CHECK(all[0] == doctest::Approx(0.3 * n).epsilon(0.08));
  CHECK(all[1] > 0);
  auto k2 = draw({1.0, 2, 1.0, 1}, n);  // ids 2 and 0, 5 : 3
  CHECK(k2.size() == 2);
  CHECK(k2[2] == doctest::Approx(0.625 * n).epsilon(0.08));
  auto p = draw({1.0, 0, 0.75, 1}, n);  // 0.5 + 0.3 reaches 0.75: ids 2 and 0
  CHECK(p.size() == 2);
  CHECK(p.count(2) == 1);
  CHECK(p.count(0) == 1);
  auto p1 = draw({1.0, 0, 0.5, 1}, n);  // 0.5 alone reaches 0.5
  CHECK(p1.size() == 1);
  CHECK(p1.count(2) == 1);
  // Ties go to the lower id, greedy and top_k = 1 alike.
  const std::vector<float> tied = {1.0f, 3.0f, 3.0f};
  core::rng_stream rng(1);
  CHECK(sample_token(tied.data(), 3, {0, 0, 1.0, 0}, rng) == 1);
  CHECK(sample_token(tied.data(), 3, {2.0, 1, 1.0, 0}, rng) == 1);
}

TEST_CASE("check_prompts refuses empty and too long prompts and ids outside the vocabulary") {
  const core::model_config m = gen_config(core::arch_kind::gpt2);
  CHECK(check_prompts(m, {{1, 2}}).ok());
  CHECK(check_prompts(m, {std::vector<int>(24, 1)}).ok());
  auto msg = [&](const std::vector<std::vector<int>>& p) {
    auto st = check_prompts(m, p);
    REQUIRE_FALSE(st.ok());
    return st.err().to_string();
  };
  CHECK(msg({}).find("no prompt") != std::string::npos);
  CHECK(msg({{1}, std::vector<int>(25, 1)}).find(
            "prompt 2 is 25 tokens long, more than the model's 24 positions") != std::string::npos);
  CHECK(msg({{1}, {}}).find("prompt 2 has no tokens") != std::string::npos);
  CHECK(msg({{61}}).find("token 61, outside the model's vocabulary of 61") != std::string::npos);
}

namespace {

/// Python's bytes.decode("utf-8", errors="replace") of the examples below, from the Unicode
/// standard's "U+FFFD substitution of maximal subparts" (chapter 3): each maximal subpart of an
/// ill-formed sequence becomes one U+FFFD.
const std::string R = "\xEF\xBF\xBD";

/// Feeds `bytes` cut at `cuts` and checks that every piece is whole UTF-8 (a fresh stream passes
/// it through unchanged with nothing left over); returns the concatenation.
std::string stream_in_pieces(const std::string& bytes, const std::vector<std::size_t>& cuts) {
  utf8_stream s;
  std::string out;
  std::size_t at = 0;
  auto piece = [&](const std::string& p) {
    utf8_stream check;
    CHECK(check.push(p) == p);
    CHECK(check.finish().empty());
    out += p;
  };
  for (std::size_t c : cuts) {
    piece(s.push(std::string_view(bytes).substr(at, c - at)));
    at = c;
  }
  piece(s.push(std::string_view(bytes).substr(at)));
  piece(s.finish());
  return out;
}

}  // namespace

TEST_CASE("utf8_stream replaces ill-formed bytes as Python's errors=\"replace\" does") {
  struct example {
    std::string in, want;
  };
  const std::vector<example> cases = {
      // Unicode 15, table 3-8: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64.
      {"\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64", "a" + R + R + R + "b" + R + "c" + R + R + "d"},
      {"\xC0\xAF", R + R},                  // overlong lead bytes are never valid
      {"\xED\xA0\x80", R + R + R},          // a surrogate: ED takes 80..9F only
      {"\xF4\x90\x80\x80", R + R + R + R},  // above U+10FFFF
      {"\xE2\x82\xAC\xF0\x9F\x99\x82", "\xE2\x82\xAC\xF0\x9F\x99\x82"},  // € 🙂 untouched
      {"ok\xE2\x82", "ok" + R},             // a dangling partial character at the end: one U+FFFD
      {"\xF0\x9F\x99", R},
  };
  for (const auto& c : cases) {
    CAPTURE(c.in);
    CHECK(stream_in_pieces(c.in, {}) == c.want);
    // Any single cut, and a cut after every byte, give the same text.
    for (std::size_t k = 0; k <= c.in.size(); ++k) CHECK(stream_in_pieces(c.in, {k}) == c.want);
    std::vector<std::size_t> every;
    for (std::size_t k = 1; k < c.in.size(); ++k) every.push_back(k);
    CHECK(stream_in_pieces(c.in, every) == c.want);
  }
  utf8_stream s;
  CHECK(s.push("\xE2\x82") == "");  // held back, nothing printed yet
  CHECK(s.push("\xAC!") == "\xE2\x82\xAC!");
}

TEST_CASE("GPT-2 tokens that split characters stream as whole characters") {
  auto tok = tokenizer::load(TROUPE_SOURCE_DIR "/data/gpt2");
  REQUIRE_MESSAGE(tok.ok(), "run scripts/setup.sh to fetch the GPT-2 vocabulary");
  const std::string text = "naïve café — 日本語のテキスト 🙂🚀 ✓ Ωμέγα";
  const std::vector<int> ids = tok->encode(text);
  std::string bytes;
  std::vector<std::size_t> cuts;
  int split = 0;
  for (int id : ids) {
    const std::string& b = tok->token_bytes(id);
    utf8_stream alone;
    if (alone.push(b) != b) ++split;  // this token's bytes end or start inside a character
    bytes += b;
    cuts.push_back(bytes.size());
  }
  REQUIRE(bytes == text);
  CHECK(split >= 3);  // the test does cut inside characters
  CHECK(stream_in_pieces(bytes, cuts) == text);
}

TEST_CASE("cuda generation with the KV cache gives the CPU's greedy tokens, GPT-2 and LLaMA-GQA") {
  if (!kernels::cuda_available()) {
    MESSAGE("skipped: no CUDA device in this build or on this machine");
    return;
  }
  auto cpu = kernels::make_backend("cpu");
  auto gpu = kernels::make_backend("cuda");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    CAPTURE(static_cast<int>(arch));
    const core::model_config m = gen_config(arch);
    chunk on_cpu(m, partition(m, 1)[0], *cpu), on_gpu(m, partition(m, 1)[0], *gpu);
    on_cpu.init(11);
    on_gpu.init(11);
    generate_options o;
    o.max_new_tokens = 12;
    o.sample.temperature = 0;
    const outcome want = run(on_cpu, *cpu, m, kPrompts, o);
    const outcome got = run(on_gpu, *gpu, m, kPrompts, o);
    CHECK(got.tokens == want.tokens);
    // And sampling: the same logits up to rounding draw the same tokens almost always; the
    // GPU's own draws are reproducible exactly.
    o.sample = {1.0, 0, 0.9, 5};
    CHECK(run(on_gpu, *gpu, m, kPrompts, o).tokens == run(on_gpu, *gpu, m, kPrompts, o).tokens);
  }
}

TEST_CASE("token_text pieces add up to the decoder's text: GPT-2, LLaMA-2 (SentencePiece), LLaMA-3") {
  const std::string text = "Call me Ishmael.  Some years ago — 日本語 🙂 naïve\n  indent, 12345 end";
  int tried = 0;
  for (const char* dir : {"/data/gpt2", "/data/llama2", "/data/llama3"}) {
    CAPTURE(dir);
    auto tok = load_tokenizer(std::string(TROUPE_SOURCE_DIR) + dir);
    if (!tok) {
      MESSAGE("skipped " << dir << ": " << tok.err().to_string());
      continue;
    }
    ++tried;
    const std::vector<int> ids = tok.value()->encode_for_model(text);
    REQUIRE(ids.size() > 8);
    for (std::size_t cut : {std::size_t{1}, std::size_t{3}, ids.size() / 2}) {
      CAPTURE(cut);
      const std::vector<int> prompt(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(cut));
      token_text pieces(*tok.value(), prompt);
      std::string streamed;
      for (std::size_t i = cut; i < ids.size(); ++i) streamed += pieces.next(ids[i]);
      const std::string whole = tok.value()->decode(ids), head = tok.value()->decode(prompt);
      REQUIRE(whole.compare(0, head.size(), head) == 0);
      CHECK(streamed == whole.substr(head.size()));
    }
  }
  CHECK(tried >= 1);  // the GPT-2 vocabulary is always there (scripts/setup.sh)
}
