// GPT-2's byte-level BPE tokenizer, reimplemented to give exactly the ids of OpenAI's encoder.py
// (and tiktoken's "gpt2"): text is cut into pre-tokens by GPT-2's regex, each pre-token's UTF-8
// bytes become byte symbols, and merges from vocab.bpe are applied lowest rank first. Merges run on
// token ids rather than strings (the vocabulary maps every merge result to an id, checked at load),
// and each distinct pre-token is merged once and cached, which is what makes a 12 MB corpus take
// seconds rather than minutes.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"

namespace troupe::model {

class tokenizer {
 public:
  /// Id of `<|endoftext|>`, which data preparation puts before every document.
  static constexpr int eot_id = 50256;
  /// Where `troupe data prepare` and the tests look for the vocabulary by default.
  static constexpr const char* default_dir = "data/gpt2";

  /// Reads `dir`/encoder.json and `dir`/vocab.bpe; missing or malformed files are errors naming the
  /// file (and line) with a hint to run scripts/setup.sh.
  static core::result<tokenizer> load(const std::string& dir);

  tokenizer(tokenizer&&) noexcept;
  tokenizer& operator=(tokenizer&&) noexcept;
  ~tokenizer();

  /// Token ids of `text`. Invalid UTF-8 is first replaced as `valid_utf8` does. `<|endoftext|>`
  /// written in the text is ordinary text here (as in encoder.py), not the special id. Safe to call
  /// from several threads.
  std::vector<int> encode(std::string_view text) const;
  /// The bytes the ids stand for (UTF-8 unless the ids split a character). REQUIRES: every id in
  /// [0, vocab_size()).
  std::string decode(const std::vector<int>& ids) const;
  /// The bytes of one token.
  const std::string& token_bytes(int id) const;
  /// Number of token ids (50257 for GPT-2).
  int vocab_size() const;

  /// `text` with every maximal ill-formed UTF-8 subsequence replaced by U+FFFD, the rule Python's
  /// `bytes.decode("utf-8", errors="replace")` follows; `replaced` (if given) receives the count.
  static std::string valid_utf8(std::string_view text, std::size_t* replaced = nullptr);

 private:
  struct impl;
  explicit tokenizer(std::unique_ptr<impl> p);
  std::unique_ptr<impl> p_;
};

}  // namespace troupe::model
