#include "model/tokenizer.hpp"

#include <array>
#include <climits>
#include <cstdint>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "model/text_util.hpp"

namespace troupe::model {

namespace {

using text::append_utf8;
using text::byte_to_unicode;
using text::code_points;
using text::line_column;

constexpr const char* kSetupHint =
    "run scripts/setup.sh to fetch the GPT-2 vocabulary into data/gpt2, or point --tokenizer / "
    "data.tokenizer_dir at a folder holding encoder.json and vocab.bpe";

std::uint64_t pair_key(int a, int b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
         static_cast<std::uint32_t>(b);
}

core::result<std::string> read_file(const std::string& path) {
  return text::read_tokenizer_file(path, kSetupHint);
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
  std::optional<text::pattern> re;

  // BPE result per distinct pre-token; encode is const and may run on several threads.
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int>> cache;

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
  } catch (const nlohmann::json::exception& e) {  // a number out of range, say
    return core::error::at_file(enc_path, "not valid JSON: " + std::string(e.what()), kSetupHint);
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

  auto re = text::pattern::compile(text::gpt2_pattern, "GPT-2's pre-tokenizer pattern");
  if (!re) throw core::failure(re.err().to_string());
  p->re.emplace(std::move(re.value()));
  return tokenizer(std::move(p));
}

std::vector<int> tokenizer::encode(std::string_view text) const {
  std::string repaired;
  text = text::as_valid_utf8(text, repaired);
  std::vector<int> out;
  out.reserve(text.size() / 3);
  p_->re->for_each_match(text, [&](std::size_t begin, std::size_t end) {
    std::string_view piece = text.substr(begin, end - begin);
    {
      std::lock_guard<std::mutex> lock(p_->cache_mu);
      auto it = p_->cache.find(std::string(piece));
      if (it != p_->cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int> ids = p_->bpe(piece);
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(p_->cache_mu);
    // Bound the cache on unbounded input; the corpus has about 50k distinct pre-tokens.
    if (p_->cache.size() >= (1u << 20)) p_->cache.clear();
    p_->cache.emplace(std::string(piece), std::move(ids));
  });
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
  return text::valid_utf8(text, replaced);
}

}  // namespace troupe::model
