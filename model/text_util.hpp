// What the tokenizers share: UTF-8 decoding by Unicode's table 3-7, GPT-2's byte-to-character
// alphabet, tokenizer file reading, and a PCRE2 pattern that cuts text into pre-tokens. Internal to
// model/ (tokenizer.cpp, tokenizer_json.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace troupe::model::text {

/// Length of the well-formed UTF-8 sequence at s[0..n) (Unicode table 3-7), or 0 when ill-formed;
/// then `bad` is the length of the maximal ill-formed subpart (at least 1), the unit that Python
/// replaces by one U+FFFD. `cp` (if given) receives the code point.
int utf8_sequence(const unsigned char* s, std::size_t n, int* bad, char32_t* cp = nullptr);
bool is_valid_utf8(std::string_view text);
/// `text` with every maximal ill-formed subsequence replaced by U+FFFD; `replaced` gets the count.
std::string valid_utf8(std::string_view text, std::size_t* replaced = nullptr);
/// `text` itself when it is valid UTF-8, else its repair (valid_utf8) kept in `storage`.
std::string_view as_valid_utf8(std::string_view text, std::string& storage);
void append_utf8(std::string& out, char32_t c);
/// Code points of `s`; `ok` is false (and the result partial) when `s` is not well-formed UTF-8.
std::vector<char32_t> code_points(std::string_view s, bool* ok);

/// GPT-2's byte-level alphabet: every byte as a printable code point (printable Latin-1 bytes as
/// themselves, the other 68 as 256, 257, ...), so BPE strings hold no whitespace or controls.
std::array<char32_t, 256> byte_to_unicode();

/// GPT-2's pre-tokenizer pattern (encoder.py's, with the two PCRE2 adjustments explained in
/// text_util.cpp), also Hugging Face's ByteLevel pre-tokenizer with use_regex.
extern const char* const gpt2_pattern;

/// A tokenizer file read whole (at most 256 MiB), or an error naming it with `hint`.
core::result<std::string> read_tokenizer_file(const std::string& path, const std::string& hint);
/// 1-based line and column of byte `pos` in `text`.
std::pair<int, int> line_column(const std::string& text, std::size_t pos);

/// A compiled PCRE2 pattern (UTF + Unicode properties, JIT where available). Move-only.
class pattern {
 public:
  /// Compiles `re`; an error names `where` (file and key) and PCRE2's message and offset.
  static core::result<pattern> compile(std::string_view re, const std::string& where);
  pattern(pattern&&) noexcept;
  pattern& operator=(pattern&&) noexcept;
  ~pattern();
  /// Calls `on_match(begin, end)` for each successive non-overlapping match in `text`, which must
  /// be valid UTF-8. An empty match advances by one character. Safe from several threads.
  void for_each_match(std::string_view text,
                      const std::function<void(std::size_t, std::size_t)>& on_match) const;

 private:
  struct impl;
  explicit pattern(std::unique_ptr<impl> p);
  std::unique_ptr<impl> p_;
};

}  // namespace troupe::model::text
