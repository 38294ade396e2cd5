// Generation with a key/value cache; see generate.hpp for what is promised.
#include "model/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <span>

#include "core/error.hpp"

namespace troupe::model {

// ---- sampling ------------------------------------------------------------------------------------

int sample_token(const float* logits, int vocab, const sampling& s, core::rng_stream& rng) {
  auto before = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (s.temperature <= 0) {
    int best = 0;
    for (int i = 1; i < vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    return best;
  }
  // The candidates, most likely first once ordered: all of them, or the top_k.
  std::vector<int> ids(static_cast<std::size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::size_t keep = ids.size();
  if (s.top_k > 0 && s.top_k < vocab) {
    keep = static_cast<std::size_t>(s.top_k);
    std::nth_element(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep - 1), ids.end(),
                     before);
    ids.resize(keep);
  }
  const bool nucleus = s.top_p < 1.0;
  if (nucleus) std::sort(ids.begin(), ids.end(), before);
  float top = -INFINITY;
  for (int i : ids) top = std::max(top, logits[i]);
  std::vector<double> w(ids.size());
  double total = 0;
  for (std::size_t j = 0; j < ids.size(); ++j)
    total += w[j] = std::exp((static_cast<double>(logits[ids[j]]) - top) / s.temperature);
  if (nucleus) {
    // The smallest prefix whose probability reaches top_p (at least one token).
    double cum = 0;
    std::size_t n = 0;
    while (n < ids.size()) {
      cum += w[n++];
      if (cum >= s.top_p * total) break;
    }
    ids.resize(n);
    w.resize(n);
    total = cum;
  }
  const double u = static_cast<double>(rng.next_u64() >> 11) * 0x1.0p-53;
  double acc = u * total;
  for (std::size_t j = 0; j < ids.size(); ++j) {
    acc -= w[j];
    if (acc < 0) return ids[j];
  }
  return ids.back();  // u * total rounded up to the sum of the weights
}

core::rng_stream sample_stream(std::uint64_t seed, int prompt, std::int64_t position) {
  return core::rng_stream(core::stream_key(seed, 0x6e4e, prompt, position));
}

// ---- UTF-8 -------------------------------------------------------------------------------------

namespace {

constexpr std::string_view replacement = "\xEF\xBF\xBD";

/// How many bytes follow a lead byte and the range its first continuation byte must lie in
/// (Unicode's table of well-formed sequences, which Python's decoder follows); 0 continuations
/// with ok = false for a byte that can start no character.
struct lead_info {
  bool ok;
  int more;
  unsigned char lo, hi;
};

lead_info lead(unsigned char b) {
  if (b < 0x80) return {true, 0, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {true, 1, 0x80, 0xBF};
  if (b == 0xE0) return {true, 2, 0xA0, 0xBF};
  if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) return {true, 2, 0x80, 0xBF};
  if (b == 0xED) return {true, 2, 0x80, 0x9F};
  if (b == 0xF0) return {true, 3, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {true, 3, 0x80, 0xBF};
  if (b == 0xF4) return {true, 3, 0x80, 0x8F};
  return {false, 0, 0, 0};
}

}  // namespace

std::string utf8_stream::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  std::size_t i = 0;
  const std::size_t n = pending_.size();
  while (i < n) {
    const auto b = static_cast<unsigned char>(pending_[i]);
    const lead_info l = lead(b);
    if (!l.ok) {
      out += replacement;
      ++i;
      continue;
    }
    // Count the continuation bytes that fit; stop at the first that does not.
    std::size_t j = i + 1;
    int good = 0;
    while (good < l.more && j < n) {
      const auto c = static_cast<unsigned char>(pending_[j]);
      const bool fits = good == 0 ? (c >= l.lo && c <= l.hi) : (c >= 0x80 && c <= 0xBF);
      if (!fits) break;
      ++good;
      ++j;
    }
    if (good == l.more) {
      out.append(pending_, i, j - i);
    } else if (j == n) {
      break;  // a character still arriving: hold it back
    } else {
      out += replacement;  // a maximal subpart that cannot be completed
    }
    i = j;
  }
  pending_.erase(0, i);
  return out;
}

std::string utf8_stream::finish() {
  std::string out = push({});
  if (!pending_.empty()) out += replacement;
  pending_.clear();
  return out;
}

// ---- token text ----------------------------------------------------------------------------------

token_text::token_text(const text_tokenizer& tok, std::vector<int> prompt)
    : tok_(&tok), ids_(std::move(prompt)) {}

std::string token_text::next(int id) {
  const std::size_t n = ids_.size(), from = n > context ? n - context : 0;
  const std::string before = tok_->decode(std::span<const int>(ids_).subspan(from));
  ids_.push_back(id);
  const std::string after = tok_->decode(std::span<const int>(ids_).subspan(from));
  std::size_t same = 0;
  while (same < before.size() && same < after.size() && before[same] == after[same]) ++same;
  return after.substr(same);
}

// ---- generation ----------------------------------------------------------------------------------

const char* stop_name(stop_reason r) {
  switch (r) {
    case stop_reason::eos: return "eos";
    case stop_reason::max_new_tokens: return "max_new_tokens";
    case stop_reason::positions: return "positions";
  }
  return "?";
}

core::status check_prompts(const core::model_config& cfg,
                           const std::vector<std::vector<int>>& prompts) {
  if (prompts.empty())
    return core::error::make("no prompt to continue", "pass --prompt TEXT or --prompts FILE");
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    const std::string which = "prompt " + std::to_string(i + 1);
    if (p.empty()) return core::error::make(which + " has no tokens", "give it some text");
    if (static_cast<std::int64_t>(p.size()) > cfg.seq_length)
      return core::error::make(
          which + " is " + std::to_string(p.size()) + " tokens long, more than the model's " +
              std::to_string(cfg.seq_length) + " positions (model.seq_length)",
          "shorten it to at most " + std::to_string(cfg.seq_length) + " tokens");
    for (int id : p)
      if (id < 0 || id >= cfg.vocab_size)
        return core::error::make(which + " holds token " + std::to_string(id) +
                                     ", outside the model's vocabulary of " +
                                     std::to_string(cfg.vocab_size),
                                 "the checkpoint was trained with a different vocabulary");
  }
  return {};
}

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// int32 [values.size()] on the backend's device.
tensor ids_tensor(kernels::backend& be, const std::vector<std::int32_t>& values) {
  tensor host = tensor::zeros({static_cast<std::int64_t>(values.size())}, core::dtype::i32);
  std::copy(values.begin(), values.end(), host.data<std::int32_t>());
  return be.dev().is_cpu() ? host : be.from_host(host);
}

}  // namespace

generate_stats generate(chunk& net, kernels::backend& be, const core::model_config& cfg,
                        const std::vector<std::vector<int>>& prompts, const generate_options& o,
                        const generate_sink& sink) {
  generate_stats st;
  const int count = static_cast<int>(prompts.size());
  const int vocab = o.vocab > 0 ? std::min(o.vocab, cfg.vocab_size) : cfg.vocab_size;
  const int positions = cfg.seq_length;

  // Each sequence may grow to max_new_tokens more, and never past the model's positions.
  std::vector<int> length(count), budget(count), made(count, 0);
  int longest = 0;
  for (int i = 0; i < count; ++i) {
    length[i] = static_cast<int>(prompts[i].size());
    budget[i] = std::min(o.max_new_tokens, positions - length[i]);
    longest = std::max(longest, std::min(positions, length[i] + std::max(budget[i], 0)));
    st.prompt_tokens += length[i];
  }
  std::vector<int> active;
  for (int i = 0; i < count; ++i) {
    if (budget[i] > 0) {
      active.push_back(i);
    } else if (sink.stop) {
      sink.stop(i, o.max_new_tokens <= 0 ? stop_reason::max_new_tokens : stop_reason::positions);
    }
  }
  if (active.empty()) return st;
  kv_cache cache = net.make_kv_cache(count, longest);

  // Samples one token per row of `logits` (row j belongs to active[j]) and keeps those that go
  // on; `last` receives each continuing sequence's new token.
  std::vector<int> last(count, 0);
  auto take = [&](const tensor& logits_dev) {
    const tensor logits = be.dev().is_cpu() ? logits_dev : be.to_host(logits_dev);
    std::vector<int> still;
    for (std::size_t j = 0; j < active.size(); ++j) {
      const int i = active[j];
      const std::int64_t pos = length[i] + made[i];  // the new token's position
      core::rng_stream rng = sample_stream(o.sample.seed, o.index_base + i, pos);
      const int id = sample_token(logits.data<float>() + j * static_cast<std::size_t>(cfg.vocab_size),
                                  vocab, o.sample, rng);
      ++made[i];
      ++st.new_tokens;
      if (id == o.eos) {
        if (sink.stop) sink.stop(i, stop_reason::eos);
        continue;
      }
      if (sink.token) sink.token(i, id);
      if (made[i] >= budget[i]) {
        if (sink.stop)
          sink.stop(i, made[i] >= o.max_new_tokens ? stop_reason::max_new_tokens
                                                   : stop_reason::positions);
        continue;
      }
      last[i] = id;
      still.push_back(i);
    }
    active = std::move(still);
  };

  // Prefill: every prompt's rows at once, each prompt in its own slot; the logits of the last row
  // of each prompt give its first new token.
  auto t0 = clock_type::now();
  {
    std::vector<std::int32_t> tok, slot, pos;
    std::vector<std::int64_t> rows;
    for (int i = 0; i < count; ++i)
      for (int t = 0; t < length[i]; ++t) {
        tok.push_back(prompts[i][static_cast<std::size_t>(t)]);
        slot.push_back(i);
        pos.push_back(t);
        if (t == length[i] - 1 && budget[i] > 0)
          rows.push_back(static_cast<std::int64_t>(tok.size()) - 1);
      }
    const cache_rows at{ids_tensor(be, slot), ids_tensor(be, pos)};
    take(net.forward_cached(ids_tensor(be, tok), at, cache, rows));
  }
  st.prefill_seconds = seconds_since(t0);

  // Decode: one row per running sequence, its last token at the next position.
  t0 = clock_type::now();
  while (!active.empty()) {
    std::vector<std::int32_t> tok, slot, pos;
    std::vector<std::int64_t> rows;
    for (int i : active) {
      tok.push_back(last[i]);
      slot.push_back(i);
      pos.push_back(length[i] + made[i] - 1);
      rows.push_back(static_cast<std::int64_t>(rows.size()));
    }
    const cache_rows at{ids_tensor(be, slot), ids_tensor(be, pos)};
    st.decode_tokens += static_cast<std::int64_t>(active.size());
    ++st.decode_steps;
    take(net.forward_cached(ids_tensor(be, tok), at, cache, rows));
  }
  st.decode_seconds = seconds_since(t0);
  return st;
}

}  // namespace troupe::model
