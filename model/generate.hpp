// Text generation with a key/value cache, as `troupe generate` runs it: one prefill of every
// prompt (their rows side by side, each prompt in its own cache slot), then one decode step per
// new token for the sequences still running, each step a single row per sequence that reads the
// keys and values of all earlier positions from the cache (chunk::forward_cached). The model maths
// is the training code's: the same layer ops, with attention reading the cache.
//
// Promises (tests/model/generate_test.cpp):
//  - greedy output equals the greedy output of recomputing the whole sequence for every token,
//    token for token, for any batch of prompts of different lengths;
//  - a draw depends on (seed, prompt index, position) and the logits only: the same seed gives the
//    same text, and top_k = 1 gives the greedy text;
//  - utf8_stream never lets part of a UTF-8 character out, whatever the token boundaries;
//  - token_text's pieces add up to the decoder's text (GPT-2, LLaMA-2 and LLaMA-3 tokenizers).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.hpp"
#include "core/rng.hpp"
#include "kernels/backend.hpp"
#include "model/chunk.hpp"
#include "model/text_tokenizer.hpp"

namespace troupe::model {

/// How the next token is chosen: from softmax(logits / temperature) restricted to the top_k most
/// likely tokens (0 = all) and then to the smallest set of the most likely whose probability
/// reaches top_p (1 = all), in that order (as Hugging Face's generate applies them).
/// temperature 0 is greedy: the largest logit, the lowest id on ties.
struct sampling {
  double temperature = 0.8;
  int top_k = 40;
  double top_p = 1.0;
  std::uint64_t seed = 0;
};

/// The token drawn from logits[0, vocab) by `s` with one uniform draw from `rng`. Ties in the
/// top-k order go to the lower id, so top_k = 1 is greedy whatever the temperature.
int sample_token(const float* logits, int vocab, const sampling& s, core::rng_stream& rng);

/// The random stream of the draw for prompt `prompt` (its index among all prompts) at sequence
/// position `position`.
core::rng_stream sample_stream(std::uint64_t seed, int prompt, std::int64_t position);

/// Bytes in, valid UTF-8 out: push() returns the longest prefix of what it has been given that
/// ends on a character boundary and holds back an incomplete character until its remaining bytes
/// arrive; bytes that can never become a character are replaced by U+FFFD, one per maximal
/// invalid subpart, exactly as Python's bytes.decode("utf-8", errors="replace") does. finish()
/// flushes a dangling incomplete character as one U+FFFD. The concatenation of every push() and
/// the finish() equals Python's decode of all the bytes.
class utf8_stream {
 public:
  std::string push(std::string_view bytes);
  std::string finish();

 private:
  std::string pending_;
};

/// The bytes each new token adds to a sequence's text, through the tokenizer's decoder. A decoder
/// may depend on what precedes a token (SentencePiece drops the space of a text's first word), so
/// each token is decoded after a few tokens of context whose own bytes are taken off. The pieces
/// of a sequence's tokens add up to the decoder's text of the whole sequence after the prompt.
class token_text {
 public:
  /// REQUIRES: prompt not empty; tok outlives this.
  token_text(const text_tokenizer& tok, std::vector<int> prompt);
  std::string next(int id);

 private:
  static constexpr std::size_t context = 4;
  const text_tokenizer* tok_;
  std::vector<int> ids_;
};

/// Why a sequence stopped.
enum class stop_reason {
  eos,             // the model produced the end-of-sequence token (not emitted)
  max_new_tokens,  // it produced max_new_tokens tokens
  positions,       // it filled the model's seq_length positions
};

const char* stop_name(stop_reason r);

struct generate_options {
  int max_new_tokens = 64;
  /// The end-of-sequence token; -1 = none.
  int eos = -1;
  /// Tokens that may be drawn: ids [0, vocab) (0 = the model's vocab_size; a tokenizer with fewer
  /// tokens than the model's padded vocabulary passes its own size).
  int vocab = 0;
  /// The index of the first prompt of this call among all prompts (a batch cut into several
  /// calls): draws are keyed by index_base + i, so cutting does not change them.
  int index_base = 0;
  sampling sample;
};

/// What a generate call did, for a tokens/s report. The prefill ends when the first new token of
/// every prompt is known (its logits on the host); the decode steps produce the rest.
struct generate_stats {
  std::int64_t prompt_tokens = 0;
  double prefill_seconds = 0;
  std::int64_t decode_tokens = 0;  // tokens produced by decode steps
  int decode_steps = 0;
  double decode_seconds = 0;
  std::int64_t new_tokens = 0;     // every token produced (EOS included), prefill's too
};

/// Receives new tokens (prompt index, token id) in the order they are produced, and the end of
/// each prompt's sequence.
struct generate_sink {
  std::function<void(int, int)> token;
  std::function<void(int, stop_reason)> stop;
};

/// Continues every prompt (token ids, 1..cfg.seq_length each) with a key/value cache on `net`
/// (the whole model in one chunk, on `be`). REQUIRES: prompts checked by check_prompts.
generate_stats generate(chunk& net, kernels::backend& be, const core::model_config& cfg,
                        const std::vector<std::vector<int>>& prompts, const generate_options& o,
                        const generate_sink& sink);

/// Refuses an empty prompt list, an empty prompt, a prompt longer than cfg.seq_length positions
/// and ids outside the vocabulary, naming the prompt (1-based) and what fits.
core::status check_prompts(const core::model_config& cfg,
                           const std::vector<std::vector<int>>& prompts);

}  // namespace troupe::model
