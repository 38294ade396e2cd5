#include "model/tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <climits>
#include <cstdint>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include "core/files.hpp"
#include <sstream>
#include <unordered_map>

namespace troupe::model {

namespace {

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
constexpr const char* kPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?(?:[^\s\p{L}\p{N}]|\x{180E})++)"
    R"(|[^\S\x{180E}]+(?![\S\x{180E}])|[^\S\x{180E}]+)";

constexpr const char* kSetupHint =
    "run scripts/setup.sh to fetch the GPT-2 vocabulary into data/gpt2, or point --tokenizer / "
    "data.tokenizer_dir at a folder holding encoder.json and vocab.bpe";

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

// Length of the well-formed UTF-8 sequence at s[0..n) (Unicode table 3-7), or 0 when ill-formed;
// then `bad` is the length of the maximal ill-formed subpart (at least 1), the unit that Python
// replaces by one U+FFFD.
int utf8_sequence(const unsigned char* s, std::size_t n, int* bad, char32_t* cp = nullptr) {
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

// Decodes UTF-8 that is known to be well formed (JSON strings, vocab.bpe lines).
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

std::uint64_t pair_key(int a, int b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
         static_cast<std::uint32_t>(b);
}

core::result<std::string> read_file(const std::string& path) {
  core::input_spec spec;
  spec.what = "tokenizer file";
  spec.max_bytes = std::uint64_t(1) << 28;  // GPT-2's encoder.json is 1 MB, LLaMA-3's ~10 MB
  spec.hint = kSetupHint;
  return core::read_input(path, spec);
}

// 1-based line and column of byte `pos` in `text`.
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

struct merge_rule {
  int rank;
  int result;
};

}  // namespace

struct tokenizer::impl {
  std::vector<std::string> bytes_of;  // id -> the bytes it stands for
  std::array<int, 256> byte_id{};     // byte -> id of its one-byte token
  std::unordered_map<std::uint64_t, merge_rule> merges;
  pcre2_code* re = nullptr;

  // BPE result per distinct pre-token; encode is const and may run on several threads.
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int>> cache;

  ~impl() {
    if (re) pcre2_code_free(re);
  }

  // Applies merges lowest rank first; each round merges every non-overlapping occurrence of the
  // best pair left to right, exactly as encoder.py's bpe() does with strings.
  std::vector<int> bpe(std::string_view piece) const {
    std::vector<int> word;
    word.reserve(piece.size());
    for (unsigned char b : piece) word.push_back(byte_id[b]);
    std::vector<int> next;
    while (word.size() >= 2) {
      int best_rank = INT_MAX, first = -1, second = -1, merged = -1;
      for (std::size_t i = 0; i + 1 < word.size(); ++i) {
        auto it = merges.find(pair_key(word[i], word[i + 1]));
        if (it != merges.end() && it->second.rank < best_rank) {
          best_rank = it->second.rank;
          first = word[i];
          second = word[i + 1];
          merged = it->second.result;
        }
      }
      if (merged < 0) break;
      next.clear();
      for (std::size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
          next.push_back(merged);
          i += 2;
        } else {
          next.push_back(word[i]);
          i += 1;
        }
      }
      word.swap(next);
    }
    return word;
  }
};

tokenizer::tokenizer(std::unique_ptr<impl> p) : p_(std::move(p)) {}
tokenizer::tokenizer(tokenizer&&) noexcept = default;
tokenizer& tokenizer::operator=(tokenizer&&) noexcept = default;
tokenizer::~tokenizer() = default;

core::result<tokenizer> tokenizer::load(const std::string& dir) {
  auto p = std::make_unique<impl>();
  const std::string enc_path = dir + "/encoder.json";
  const std::string bpe_path = dir + "/vocab.bpe";

  auto enc_text = read_file(enc_path);
  if (!enc_text) return enc_text.err();
  nlohmann::json enc;
  try {
    enc = nlohmann::json::parse(enc_text.value());
  } catch (const nlohmann::json::parse_error& e) {
    auto [line, col] = line_column(enc_text.value(), e.byte > 0 ? e.byte - 1 : 0);
    return core::error::at_key(enc_path, "", line, col, "not valid JSON: " + std::string(e.what()),
                               kSetupHint);
  }
  if (!enc.is_object() || enc.empty())
    return core::error::at_file(enc_path, "expected a JSON object mapping token strings to ids",
                                kSetupHint);

  const std::size_t n = enc.size();
  p->bytes_of.assign(n, std::string());
  std::vector<bool> seen(n, false);
  std::unordered_map<std::string, int> id_of;
  id_of.reserve(n * 2);
  std::unordered_map<char32_t, int> unicode_to_byte;
  auto b2u = byte_to_unicode();
  for (int b = 0; b < 256; ++b) unicode_to_byte[b2u[b]] = b;

  for (auto it = enc.begin(); it != enc.end(); ++it) {
    const std::string& key = it.key();
    if (!it->is_number_integer() || it->get<std::int64_t>() < 0 ||
        it->get<std::int64_t>() >= static_cast<std::int64_t>(n))
      return core::error::at_key(enc_path, key, 0, 0,
                                 "id must be an integer in [0, " + std::to_string(n) + ")",
                                 kSetupHint);
    int id = it->get<int>();
    if (seen[id])
      return core::error::at_key(enc_path, key, 0, 0,
                                 "id " + std::to_string(id) + " is used by two tokens", kSetupHint);
    seen[id] = true;
    id_of.emplace(key, id);
    bool ok = false;
    auto cps = code_points(key, &ok);
    std::string bytes;
    // `<|endoftext|>` is plain printable ASCII, so this rule decodes it like any other token.
    for (char32_t c : cps) {
      auto m = unicode_to_byte.find(c);
      if (m == unicode_to_byte.end()) {
        ok = false;
        break;
      }
      bytes += static_cast<char>(m->second);
    }
    if (!ok || bytes.empty())
      return core::error::at_key(enc_path, key, 0, 0,
                                 "token is not written in GPT-2's byte-to-unicode alphabet",
                                 kSetupHint);
    p->bytes_of[id] = std::move(bytes);
  }
  for (int b = 0; b < 256; ++b) {
    std::string key;
    append_utf8(key, b2u[b]);
    auto it = id_of.find(key);
    if (it == id_of.end())
      return core::error::at_file(enc_path,
                                  "the single-byte token for byte " + std::to_string(b) + " ('" +
                                      key + "') is missing",
                                  kSetupHint);
    p->byte_id[b] = it->second;
  }
  if (n <= static_cast<std::size_t>(eot_id) || p->bytes_of[eot_id] != "<|endoftext|>")
    return core::error::at_file(enc_path,
                                "expected <|endoftext|> at id " + std::to_string(eot_id) +
                                    " (a GPT-2 vocabulary has 50257 tokens; this one has " +
                                    std::to_string(n) + ")",
                                kSetupHint);

  auto bpe_text = read_file(bpe_path);
  if (!bpe_text) return bpe_text.err();
  std::istringstream lines(bpe_text.value());
  std::string line;
  int line_no = 0, rank = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line_no == 1) {
      if (line.rfind("#version", 0) != 0)
        return core::error::at_key(bpe_path, "", 1, 1,
                                   "expected the header '#version: 0.2', found '" +
                                       line.substr(0, 40) + "'",
                                   kSetupHint);
      continue;
    }
    std::istringstream fields(line);
    std::string a, b, extra;
    fields >> a >> b >> extra;
    if (a.empty()) continue;  // the trailing empty line
    if (b.empty() || !extra.empty())
      return core::error::at_key(bpe_path, "", line_no, 1,
                                 "expected a merge of two symbols separated by a space, found '" +
                                     line.substr(0, 60) + "'",
                                 kSetupHint);
    auto ia = id_of.find(a), ib = id_of.find(b), im = id_of.find(a + b);
    if (ia == id_of.end() || ib == id_of.end() || im == id_of.end())
      return core::error::at_key(bpe_path, "", line_no, 1,
                                 "merge '" + a + " " + b + "' uses a symbol that " +
                                     enc_path + " does not contain",
                                 "encoder.json and vocab.bpe must come from the same vocabulary; " +
                                     std::string(kSetupHint));
    // Python's dict(zip(merges, range)) keeps the last rank of a repeated pair; so do we.
    p->merges[pair_key(ia->second, ib->second)] = merge_rule{rank++, im->second};
  }
  if (rank == 0)
    return core::error::at_file(bpe_path, "contains no merges", kSetupHint);

  int err = 0;
  PCRE2_SIZE err_off = 0;
  p->re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                        PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (!p->re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw core::failure("PCRE2 rejected the GPT-2 pattern: " +
                        std::string(reinterpret_cast<char*>(msg)));
  }
  // JIT is an optimisation only; without it (some platforms) matching is slower but identical.
  pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE);
  return tokenizer(std::move(p));
}

std::vector<int> tokenizer::encode(std::string_view text) const {
  std::string repaired;
  if (!is_valid_utf8(text)) {
    repaired = valid_utf8(text);
    text = repaired;
  }
  std::vector<int> out;
  out.reserve(text.size() / 3);
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(p_->re, nullptr), &pcre2_match_data_free);
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE offset = 0;
  while (offset < text.size()) {
    // The text was validated above, so PCRE2 need not re-check it on every call (which would make
    // the loop quadratic).
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
    std::string_view piece = text.substr(ov[0], ov[1] - ov[0]);
    offset = ov[1];
    {
      std::lock_guard<std::mutex> lock(p_->cache_mu);
      auto it = p_->cache.find(std::string(piece));
      if (it != p_->cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        continue;
      }
    }
    std::vector<int> ids = p_->bpe(piece);
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(p_->cache_mu);
    // Bound the cache on unbounded input; the corpus has about 50k distinct pre-tokens.
    if (p_->cache.size() >= (1u << 20)) p_->cache.clear();
    p_->cache.emplace(std::string(piece), std::move(ids));
  }
  return out;
}

std::string tokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) out += token_bytes(id);
  return out;
}

const std::string& tokenizer::token_bytes(int id) const {
  TROUPE_CHECK(id >= 0 && id < vocab_size(),
               "token id " + std::to_string(id) + " is outside the vocabulary of " +
                   std::to_string(vocab_size()));
  return p_->bytes_of[static_cast<std::size_t>(id)];
}

int tokenizer::vocab_size() const { return static_cast<int>(p_->bytes_of.size()); }

std::string tokenizer::valid_utf8(std::string_view text, std::size_t* replaced) {
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

}  // namespace troupe::model
