#include "model/text_util.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/files.hpp"

namespace troupe::model::text {

// GPT-2's pre-tokenizer as in encoder.py:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// PCRE2 in UTF + UCP mode gives \s, \p{L} and \p{N} their Unicode meaning, as Python's `regex`
// does, with one exception found by comparing every code point: PCRE2's \s also matches U+180E
// (MONGOLIAN VOWEL SEPARATOR, a format character since Unicode 6.3), which Python's does not. So
// here whitespace is spelled [^\S\x{180E}] and U+180E joins the punctuation run.
//
// That run is a repeated group, which PCRE2's JIT matches with a stack frame per repetition: a
// line of ~1,500 dashes or emoji overflowed the default 32 KiB JIT stack (error -46). Nothing
// follows the group in its alternative, so a possessive repeat (`++`) matches exactly what the
// greedy one does and keeps no frames; the other repeats are of single character classes, which
// need none. Should a match still run out of stack, encode retries it without the JIT.
const char* const gpt2_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?(?:[^\s\p{L}\p{N}]|\x{180E})++)"
    R"(|[^\S\x{180E}]+(?![\S\x{180E}])|[^\S\x{180E}]+)";

// GPT-2 maps every byte to a printable code point so that BPE strings never hold whitespace or
// control characters: printable Latin-1 bytes map to themselves, the other 68 to 256, 257, ...
std::array<char32_t, 256> byte_to_unicode() {
  std::array<char32_t, 256> map{};
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
  }
  return map;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

int utf8_sequence(const unsigned char* s, std::size_t n, int* bad, char32_t* cp) {
  unsigned char b0 = s[0];
  if (b0 < 0x80) {
    if (cp) *cp = b0;
    return 1;
  }
  int len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *bad = 1;
    return 0;
  }
  char32_t c = b0 & (0xFF >> (len + 1));
  for (int k = 1; k < len; ++k) {
    unsigned char lower = k == 1 ? lo : 0x80, upper = k == 1 ? hi : 0xBF;
    if (static_cast<std::size_t>(k) >= n || s[k] < lower || s[k] > upper) {
      *bad = k;
      return 0;
    }
    c = (c << 6) | (s[k] & 0x3F);
  }
  if (cp) *cp = c;
  return len;
}

bool is_valid_utf8(std::string_view text) {
  auto* s = reinterpret_cast<const unsigned char*>(text.data());
  std::size_t i = 0, n = text.size();
  while (i < n) {
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    int bad = 0;
    int len = utf8_sequence(s + i, n - i, &bad);
    if (len == 0) return false;
    i += static_cast<std::size_t>(len);
  }
  return true;
}

// Decodes UTF-8 (JSON strings, vocab.bpe lines, tokens); `ok` says whether it was well formed.
std::vector<char32_t> code_points(std::string_view s, bool* ok) {
  std::vector<char32_t> out;
  auto* p = reinterpret_cast<const unsigned char*>(s.data());
  std::size_t i = 0;
  *ok = true;
  while (i < s.size()) {
    int bad = 0;
    char32_t c = 0;
    int len = utf8_sequence(p + i, s.size() - i, &bad, &c);
    if (len == 0) {
      *ok = false;
      return out;
    }
    out.push_back(c);
    i += static_cast<std::size_t>(len);
  }
  return out;
}

std::string_view as_valid_utf8(std::string_view text, std::string& storage) {
  if (is_valid_utf8(text)) return text;
  storage = valid_utf8(text);
  return storage;
}

std::string valid_utf8(std::string_view text, std::size_t* replaced) {
  std::string out;
  out.reserve(text.size());
  std::size_t count = 0;
  auto* s = reinterpret_cast<const unsigned char*>(text.data());
  std::size_t i = 0, n = text.size();
  while (i < n) {
    int bad = 0;
    int len = utf8_sequence(s + i, n - i, &bad);
    if (len > 0) {
      out.append(text.data() + i, static_cast<std::size_t>(len));
      i += static_cast<std::size_t>(len);
    } else {
      out += "\xEF\xBF\xBD";
      ++count;
      i += static_cast<std::size_t>(bad);
    }
  }
  if (replaced) *replaced = count;
  return out;
}

core::result<std::string> read_tokenizer_file(const std::string& path, const std::string& hint) {
  core::input_spec spec;
  spec.what = "tokenizer file";
  spec.max_bytes = std::uint64_t(1) << 28;  // GPT-2's encoder.json is 1 MB, LLaMA-3's tokenizer.json 9 MB
  spec.hint = hint;
  return core::read_input(path, spec);
}

std::pair<int, int> line_column(const std::string& text, std::size_t pos) {
  int line = 1, col = 1;
  for (std::size_t i = 0; i < pos && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

struct pattern::impl {
  pcre2_code* re = nullptr;
  ~impl() {
    if (re) pcre2_code_free(re);
  }
};

pattern::pattern(std::unique_ptr<impl> p) : p_(std::move(p)) {}
pattern::pattern(pattern&&) noexcept = default;
pattern& pattern::operator=(pattern&&) noexcept = default;
pattern::~pattern() = default;

core::result<pattern> pattern::compile(std::string_view re, const std::string& where) {
  auto p = std::make_unique<impl>();
  int err = 0;
  PCRE2_SIZE err_off = 0;
  p->re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(), PCRE2_UTF | PCRE2_UCP,
                        &err, &err_off, nullptr);
  if (!p->re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return core::error::make(where + ": cannot compile the pattern at offset " +
                                 std::to_string(err_off) + ": " +
                                 reinterpret_cast<char*>(msg),
                             "the pattern must be a regular expression PCRE2 accepts (Perl "
                             "syntax with Unicode properties)");
  }
  // JIT is an optimisation only; without it (some platforms) matching is slower but identical.
  pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE);
  return pattern(std::move(p));
}

void pattern::for_each_match(std::string_view text,
                             const std::function<void(std::size_t, std::size_t)>& on_match) const {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(p_->re, nullptr), &pcre2_match_data_free);
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE offset = 0;
  while (offset < text.size()) {
    // The caller validated the text, so PCRE2 need not re-check it on every call (which would
    // make the loop quadratic).
    int rc = pcre2_match(p_->re, subject, text.size(), offset, PCRE2_NO_UTF_CHECK, md.get(),
                         nullptr);
    // The interpreter keeps its backtracking frames on the heap: the same match, without a limit
    // of a few kilobytes of stack.
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(p_->re, subject, text.size(), offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       md.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw core::failure("cannot split the text into pre-tokens at byte " +
                          std::to_string(offset) + ": PCRE2 error " + std::to_string(rc) + " (" +
                          reinterpret_cast<char*>(msg) + ")");
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    if (ov[1] == ov[0]) {  // an empty match cuts nothing: step over one character
      int bad = 0;
      int len = utf8_sequence(reinterpret_cast<const unsigned char*>(text.data()) + ov[0],
                              text.size() - ov[0], &bad);
      offset = ov[0] + static_cast<PCRE2_SIZE>(len > 0 ? len : 1);
      continue;
    }
    on_match(ov[0], ov[1]);
    offset = ov[1];
  }
}

}  // namespace troupe::model::text
