// A Hugging Face tokenizer.json read into troupe's own BPE (model/text_tokenizer.hpp says what is
// supported). Encoding follows the `tokenizers` library's pipeline: added tokens are cut out of
// the raw text first (leftmost, then longest), each remaining segment is normalized, split into
// pre-tokens, and each pre-token is merged by BPE. Merges run as in that library and in the npm
// reference encoders: a priority queue of adjacent pairs ordered by (merge rank, position), a
// popped pair applied only if both symbols are still there. Pre-tokens up to 256 bytes are cached
// (SentencePiece-style files have no pre-tokenizer: a whole segment is one BPE word).
#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <unordered_map>

#include "model/text_tokenizer.hpp"
#include "model/text_util.hpp"

namespace troupe::model {

namespace {

using json = nlohmann::json;

constexpr const char* kHint =
    "a tokenizer.json comes from a Hugging Face model directory; scripts/setup.sh writes "
    "data/llama3, data/llama2 and data/gpt2";

struct added_token {
  int id = 0;
  std::string content;
  bool lstrip = false, rstrip = false, single_word = false, special = false;
};

struct normalize_step {
  enum kind_t { prepend, replace } kind;
  std::string from, to;  // prepend: `to` is the text put before; replace: `from` -> `to`
};

struct pre_step {
  enum kind_t { split_isolated, split_removed, byte_level, metaspace } kind;
  std::shared_ptr<const text::pattern> re;  // split (regex) and byte_level with use_regex
  std::string literal;                      // split with a String pattern
  bool add_prefix_space = false;            // byte_level
  std::string replacement;                  // metaspace
  enum scheme_t { always, first, never } scheme = always;
  bool split = true;  // metaspace
};

struct decode_step {
  enum kind_t { byte_level, replace, byte_fallback, fuse, strip, metaspace } kind;
  std::string from, to;  // replace; strip: `from` is the content
  int start = 0, stop = 0;
  bool prepend = true;  // metaspace: strip the space its prepend added
};

// A pre-token on its way through the pre-tokenizers; `first` marks the one at the text's start
// (Metaspace's prepend_scheme "first").
struct piece {
  std::string text;
  bool first = false;
};

std::uint64_t pair_key(int a, int b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
         static_cast<std::uint32_t>(b);
}

struct merge_rule {
  int rank;
  int result;
};

// Reads "<0xNN>" as the byte NN.
std::optional<unsigned char> byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<unsigned char>(hi * 16 + lo);
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  out.reserve(s.size());
  std::size_t pos = 0;
  for (std::size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out += to;
  }
  out.append(s, pos, std::string::npos);
  s.swap(out);
}

bool is_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool is_word(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }

class json_tokenizer final : public text_tokenizer {
 public:
  static core::result<std::unique_ptr<text_tokenizer>> load(const std::string& path);

  std::vector<int> encode(std::string_view text, specials_in_text specials) const override;
  std::string decode(std::span<const int> ids) const override;
  int vocab_size() const override { return static_cast<int>(token_of_.size()); }
  std::optional<int> bos_id() const override { return bos_; }
  std::optional<int> eos_id() const override { return eos_; }
  std::optional<int> pad_id() const override { return pad_; }
  bool add_bos() const override { return add_bos_; }
  std::optional<int> token_id(std::string_view token) const override {
    auto it = id_of_.find(std::string(token));
    if (it == id_of_.end()) return std::nullopt;
    return it->second;
  }
  std::string describe() const override {
    return std::string(byte_level_ ? "byte-level BPE" : "BPE") +
           (byte_fallback_ ? " with byte fallback" : "") + " from " + path_ + " (" +
           std::to_string(vocab_size()) + " ids)";
  }

 private:
  // Appends the ids of one segment of text that holds no added token.
  void encode_segment(std::string_view segment, bool at_start, std::vector<int>& out) const;
  void bpe(const std::string& word, std::vector<int>& out) const;
  std::vector<int> merge(std::vector<int> symbols) const;

  std::string path_;
  std::vector<std::string> token_of_;  // id -> token string as written in the file
  std::unordered_map<std::string, int> id_of_;
  std::unordered_map<std::string, int> vocab_;  // model.vocab only
  std::unordered_map<std::uint64_t, merge_rule> merges_;
  std::vector<added_token> added_;  // longest content first
  std::vector<normalize_step> normalizers_;
  std::vector<pre_step> pre_;
  std::vector<decode_step> decoders_;
  bool byte_level_ = false;  // a ByteLevel pre-tokenizer maps bytes to GPT-2's alphabet
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  bool fuse_unk_ = false;
  std::optional<int> unk_;
  std::array<int, 256> byte_id_{};       // byte_level: byte -> id of its character token
  std::array<int, 256> fallback_id_{};   // byte_fallback: byte -> id of <0xNN>
  std::array<char32_t, 256> b2u_{};
  std::unordered_map<char32_t, unsigned char> u2b_;
  std::optional<int> bos_, eos_, pad_;
  bool add_bos_ = false;

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int>> cache_;
};

// A JSON-reading context: errors name the file and the key path.
struct reader {
  const std::string& path;
  core::error fail(const std::string& key, const std::string& msg) const {
    return core::error::at_key(path, key, 0, 0, msg, kHint);
  }
  core::error unsupported(const std::string& key, const std::string& what,
                          const std::string& supported) const {
    return core::error::at_key(path, key, 0, 0, what + " is not supported (supported: " +
                                                    supported + ")",
                               "troupe reads BPE tokenizers such as GPT-2's, LLaMA-2's and "
                               "LLaMA-3's tokenizer.json");
  }
};

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                      : std::string();
}

bool flag(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

// The string of a {"String": s} or {"Regex": r} pattern.
core::status read_pattern(const reader& r, const json& j, const std::string& key, std::string* text,
                          bool* regex) {
  if (j.is_object() && j.contains("String") && j["String"].is_string()) {
    *text = j["String"].get<std::string>();
    *regex = false;
    return {};
  }
  if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
    *text = j["Regex"].get<std::string>();
    *regex = true;
    return {};
  }
  return r.fail(key, "expected {\"String\": ...} or {\"Regex\": ...}");
}

core::status read_normalizer(const reader& r, const json& j, const std::string& key,
                             std::vector<normalize_step>& out) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  if (t == "Sequence") {
    if (!j.contains("normalizers") || !j["normalizers"].is_array())
      return r.fail(key + ".normalizers", "expected an array");
    for (std::size_t i = 0; i < j["normalizers"].size(); ++i)
      if (auto s = read_normalizer(r, j["normalizers"][i],
                                   key + ".normalizers[" + std::to_string(i) + "]", out);
          !s)
        return s;
    return {};
  }
  if (t == "Prepend") {
    if (!j.contains("prepend") || !j["prepend"].is_string())
      return r.fail(key + ".prepend", "expected a string");
    out.push_back({normalize_step::prepend, "", j["prepend"].get<std::string>()});
    return {};
  }
  if (t == "Replace") {
    std::string text;
    bool regex = false;
    if (auto s = read_pattern(r, j.value("pattern", json()), key + ".pattern", &text, &regex); !s)
      return s;
    if (regex)
      return r.unsupported(key + ".pattern", "a Replace normalizer with a Regex pattern",
                           "String patterns");
    if (!j.contains("content") || !j["content"].is_string())
      return r.fail(key + ".content", "expected a string");
    out.push_back({normalize_step::replace, text, j["content"].get<std::string>()});
    return {};
  }
  return r.unsupported(key + ".type", "normalizer '" + t + "'",
                       "null, Sequence, Prepend, Replace with a String pattern");
}

core::status read_pre(const reader& r, const json& j, const std::string& key,
                      std::vector<pre_step>& out) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  if (t == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array())
      return r.fail(key + ".pretokenizers", "expected an array");
    for (std::size_t i = 0; i < j["pretokenizers"].size(); ++i)
      if (auto s = read_pre(r, j["pretokenizers"][i],
                            key + ".pretokenizers[" + std::to_string(i) + "]", out);
          !s)
        return s;
    return {};
  }
  if (t == "Split") {
    pre_step p{};
    const std::string behavior = j.value("behavior", std::string());
    if (behavior == "Isolated")
      p.kind = pre_step::split_isolated;
    else if (behavior == "Removed")
      p.kind = pre_step::split_removed;
    else
      return r.unsupported(key + ".behavior", "Split behavior '" + behavior + "'",
                           "Isolated, Removed");
    if (flag(j, "invert", false))
      return r.unsupported(key + ".invert", "an inverted Split", "invert: false");
    std::string text;
    bool regex = false;
    if (auto s = read_pattern(r, j.value("pattern", json()), key + ".pattern", &text, &regex); !s)
      return s;
    if (regex) {
      auto re = text::pattern::compile(text, r.path + ": " + key + ".pattern");
      if (!re) return re.err();
      p.re = std::make_shared<const text::pattern>(std::move(re.value()));
    } else {
      if (text.empty()) return r.fail(key + ".pattern", "an empty String pattern cuts nothing");
      p.literal = text;
    }
    out.push_back(std::move(p));
    return {};
  }
  if (t == "ByteLevel") {
    pre_step p{};
    p.kind = pre_step::byte_level;
    p.add_prefix_space = flag(j, "add_prefix_space", true);
    if (flag(j, "use_regex", true)) {
      auto re = text::pattern::compile(text::gpt2_pattern, "GPT-2's pre-tokenizer pattern");
      if (!re) return re.err();
      p.re = std::make_shared<const text::pattern>(std::move(re.value()));
    }
    out.push_back(std::move(p));
    return {};
  }
  if (t == "Metaspace") {
    pre_step p{};
    p.kind = pre_step::metaspace;
    p.replacement = j.value("replacement", std::string("\u2581"));
    if (p.replacement.empty()) return r.fail(key + ".replacement", "must not be empty");
    const std::string scheme =
        j.value("prepend_scheme", std::string(flag(j, "add_prefix_space", true) ? "always" : "never"));
    if (scheme == "always")
      p.scheme = pre_step::always;
    else if (scheme == "first")
      p.scheme = pre_step::first;
    else if (scheme == "never")
      p.scheme = pre_step::never;
    else
      return r.fail(key + ".prepend_scheme", "expected always, first or never, found '" + scheme + "'");
    p.split = flag(j, "split", true);
    out.push_back(std::move(p));
    return {};
  }
  return r.unsupported(key + ".type", "pre-tokenizer '" + t + "'",
                       "null, Sequence, Split (Isolated or Removed), ByteLevel, Metaspace");
}

core::status read_decoder(const reader& r, const json& j, const std::string& key,
                          std::vector<decode_step>& out) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  if (t == "Sequence") {
    if (!j.contains("decoders") || !j["decoders"].is_array())
      return r.fail(key + ".decoders", "expected an array");
    for (std::size_t i = 0; i < j["decoders"].size(); ++i)
      if (auto s = read_decoder(r, j["decoders"][i], key + ".decoders[" + std::to_string(i) + "]",
                                out);
          !s)
        return s;
    return {};
  }
  decode_step d{};
  if (t == "ByteLevel") {
    d.kind = decode_step::byte_level;
  } else if (t == "ByteFallback") {
    d.kind = decode_step::byte_fallback;
  } else if (t == "Fuse") {
    d.kind = decode_step::fuse;
  } else if (t == "Replace") {
    d.kind = decode_step::replace;
    bool regex = false;
    if (auto s = read_pattern(r, j.value("pattern", json()), key + ".pattern", &d.from, &regex); !s)
      return s;
    if (regex)
      return r.unsupported(key + ".pattern", "a Replace decoder with a Regex pattern",
                           "String patterns");
    d.to = j.value("content", std::string());
  } else if (t == "Strip") {
    d.kind = decode_step::strip;
    d.from = j.value("content", std::string(" "));
    d.start = j.value("start", 0);
    d.stop = j.value("stop", 0);
  } else if (t == "Metaspace") {
    d.kind = decode_step::metaspace;
    d.from = j.value("replacement", std::string("\u2581"));
    d.prepend = j.value("prepend_scheme", std::string(flag(j, "add_prefix_space", true) ? "always" : "never")) != "never";
  } else {
    return r.unsupported(key + ".type", "decoder '" + t + "'",
                         "null, Sequence, ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace");
  }
  out.push_back(std::move(d));
  return {};
}

// The post-processor's tokens before the text (`single` template), e.g. BOS.
core::status read_post(const reader& r, const json& j, const std::string& key,
                       std::vector<std::string>& before, std::vector<std::string>& after) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  if (t == "Sequence") {
    if (!j.contains("processors") || !j["processors"].is_array())
      return r.fail(key + ".processors", "expected an array");
    for (std::size_t i = 0; i < j["processors"].size(); ++i)
      if (auto s = read_post(r, j["processors"][i], key + ".processors[" + std::to_string(i) + "]",
                             before, after);
          !s)
        return s;
    return {};
  }
  if (t == "ByteLevel") return {};  // adjusts offsets only
  if (t == "TemplateProcessing") {
    if (!j.contains("single") || !j["single"].is_array())
      return r.fail(key + ".single", "expected an array");
    bool seen_text = false;
    for (std::size_t i = 0; i < j["single"].size(); ++i) {
      const json& item = j["single"][i];
      const std::string k = key + ".single[" + std::to_string(i) + "]";
      if (item.contains("Sequence")) {
        seen_text = true;
      } else if (item.contains("SpecialToken") && item["SpecialToken"].contains("id") &&
                 item["SpecialToken"]["id"].is_string()) {
        (seen_text ? after : before).push_back(item["SpecialToken"]["id"].get<std::string>());
      } else {
        return r.fail(k, "expected {\"Sequence\": ...} or {\"SpecialToken\": {\"id\": ...}}");
      }
    }
    return {};
  }
  return r.unsupported(key + ".type", "post-processor '" + t + "'",
                       "null, Sequence, ByteLevel, TemplateProcessing");
}

// A token named in tokenizer_config.json: a string or {"content": string}.
std::optional<std::string> config_token(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

core::result<std::unique_ptr<text_tokenizer>> json_tokenizer::load(const std::string& path) {
  auto text = text::read_tokenizer_file(path, kHint);
  if (!text) return text.err();
  json doc;
  try {
    doc = json::parse(text.value());
  } catch (const json::parse_error& e) {
    auto [line, col] = text::line_column(text.value(), e.byte > 0 ? e.byte - 1 : 0);
    return core::error::at_key(path, "", line, col, "not valid JSON: " + std::string(e.what()),
                               kHint);
  } catch (const json::exception& e) {  // a number out of range, say
    return core::error::at_file(path, "not valid JSON: " + std::string(e.what()), kHint);
  }
  const reader r{path};
  if (!doc.is_object() || !doc.contains("model") || !doc["model"].is_object())
    return r.fail("model", "expected a tokenizer.json object with a \"model\" object");
  const json& model = doc["model"];
  const std::string mtype = type_of(model);
  if (mtype != "BPE" && !(mtype.empty() && model.contains("merges")))
    return r.unsupported("model.type", "model type '" + mtype + "'", "BPE");
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    return r.unsupported("model.dropout", "BPE dropout", "null");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(k) && !model[k].is_null() &&
        !(model[k].is_string() && model[k].get<std::string>().empty()))
      return r.unsupported(std::string("model.") + k, std::string("a ") + k, "null or \"\"");

  auto t = std::make_unique<json_tokenizer>();
  t->path_ = path;
  t->byte_fallback_ = flag(model, "byte_fallback", false);
  t->ignore_merges_ = flag(model, "ignore_merges", false);
  t->fuse_unk_ = flag(model, "fuse_unk", false);

  // Vocabulary and added tokens: ids must be distinct and together fill [0, n).
  if (!model.contains("vocab") || !model["vocab"].is_object() || model["vocab"].empty())
    return r.fail("model.vocab", "expected a non-empty object mapping token strings to ids");
  std::map<int, std::string> by_id;
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 0 ||
        it->get<std::int64_t>() >= INT_MAX)
      return r.fail("model.vocab." + it.key(), "id must be a non-negative integer");
    const int id = it->get<int>();
    if (!by_id.emplace(id, it.key()).second)
      return r.fail("model.vocab." + it.key(),
                    "id " + std::to_string(id) + " is also used by '" + by_id[id] + "'");
    t->vocab_.emplace(it.key(), id);
  }
  if (doc.contains("added_tokens") && !doc["added_tokens"].is_null()) {
    if (!doc["added_tokens"].is_array()) return r.fail("added_tokens", "expected an array");
    for (std::size_t i = 0; i < doc["added_tokens"].size(); ++i) {
      const json& a = doc["added_tokens"][i];
      const std::string k = "added_tokens[" + std::to_string(i) + "]";
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          a["id"].get<std::int64_t>() < 0 || a["id"].get<std::int64_t>() >= INT_MAX ||
          !a.contains("content") || !a["content"].is_string() ||
          a["content"].get<std::string>().empty())
        return r.fail(k, "expected {\"id\": non-negative integer, \"content\": non-empty string, ...}");
      added_token tok;
      tok.id = a["id"].get<int>();
      tok.content = a["content"].get<std::string>();
      tok.lstrip = flag(a, "lstrip", false);
      tok.rstrip = flag(a, "rstrip", false);
      tok.single_word = flag(a, "single_word", false);
      tok.special = flag(a, "special", false);
      auto [pos, fresh] = by_id.emplace(tok.id, tok.content);
      if (!fresh && pos->second != tok.content)
        return r.fail(k, "id " + std::to_string(tok.id) + " is '" + pos->second +
                             "' in the vocabulary but '" + tok.content + "' here");
      t->added_.push_back(std::move(tok));
    }
  }
  const int n = by_id.rbegin()->first + 1;
  if (static_cast<std::size_t>(n) != by_id.size()) {
    int missing = 0;
    while (by_id.count(missing)) ++missing;
    return r.fail("model.vocab", "ids must run from 0 without gaps; id " + std::to_string(missing) +
                                     " is missing (the largest is " + std::to_string(n - 1) + ")");
  }
  t->token_of_.resize(static_cast<std::size_t>(n));
  for (auto& [id, s] : by_id) {
    t->token_of_[static_cast<std::size_t>(id)] = s;
    t->id_of_.emplace(s, id);
  }
  std::stable_sort(t->added_.begin(), t->added_.end(), [](const added_token& a, const added_token& b) {
    return a.content.size() > b.content.size();
  });

  if (auto s = read_normalizer(r, doc.value("normalizer", json()), "normalizer", t->normalizers_); !s)
    return s.err();
  if (auto s = read_pre(r, doc.value("pre_tokenizer", json()), "pre_tokenizer", t->pre_); !s)
    return s.err();
  if (auto s = read_decoder(r, doc.value("decoder", json()), "decoder", t->decoders_); !s)
    return s.err();
  std::vector<std::string> before, after;
  if (auto s = read_post(r, doc.value("post_processor", json()), "post_processor", before, after); !s)
    return s.err();
  t->byte_level_ = std::any_of(t->pre_.begin(), t->pre_.end(),
                               [](const pre_step& p) { return p.kind == pre_step::byte_level; });

  t->b2u_ = text::byte_to_unicode();
  for (int b = 0; b < 256; ++b) t->u2b_[t->b2u_[b]] = static_cast<unsigned char>(b);
  if (t->byte_level_) {
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      text::append_utf8(ch, t->b2u_[b]);
      auto it = t->vocab_.find(ch);
      if (it == t->vocab_.end())
        return r.fail("model.vocab", "a ByteLevel pre-tokenizer needs a token for every byte; '" +
                                         ch + "' (byte " + std::to_string(b) + ") is missing");
      t->byte_id_[b] = it->second;
    }
  }
  if (t->byte_fallback_) {
    static const char* hex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      const std::string name = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
      auto it = t->vocab_.find(name);
      if (it == t->vocab_.end())
        return r.fail("model.byte_fallback", "byte fallback needs the 256 tokens <0x00>..<0xFF>; '" +
                                                 name + "' is missing from model.vocab");
      t->fallback_id_[b] = it->second;
    }
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    auto it = t->id_of_.find(model["unk_token"].get<std::string>());
    if (it == t->id_of_.end())
      return r.fail("model.unk_token", "'" + model["unk_token"].get<std::string>() +
                                           "' is not in the vocabulary");
    t->unk_ = it->second;
  }

  // Merges: "left right" strings (older files) or ["left", "right"] pairs (newer ones).
  if (!model.contains("merges") || !model["merges"].is_array())
    return r.fail("model.merges", "expected an array of merges");
  const json& merges = model["merges"];
  for (std::size_t i = 0; i < merges.size(); ++i) {
    std::string a, b;
    const json& m = merges[i];
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      auto sp = s.find(' ', 1);
      if (sp == std::string::npos || sp + 1 >= s.size() || s.find(' ', sp + 1) != std::string::npos)
        return r.fail("model.merges[" + std::to_string(i) + "]",
                      "expected two tokens separated by one space, found '" + s + "'");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return r.fail("model.merges[" + std::to_string(i) + "]",
                    "expected \"left right\" or [\"left\", \"right\"]");
    }
    auto ia = t->vocab_.find(a), ib = t->vocab_.find(b), im = t->vocab_.find(a + b);
    if (ia == t->vocab_.end() || ib == t->vocab_.end() || im == t->vocab_.end())
      return r.fail("model.merges[" + std::to_string(i) + "]",
                    "merge '" + a + " " + b + "' uses or makes a token that model.vocab lacks");
    // The first listing of a pair is the one the library keeps.
    t->merges_.emplace(pair_key(ia->second, ib->second),
                       merge_rule{static_cast<int>(i), im->second});
  }

  // Special ids: tokenizer_config.json beside the file, else the template, else the usual names.
  json cfg = json::object();
  const auto cfg_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(cfg_path, ec)) {
    auto cfg_text = text::read_tokenizer_file(cfg_path.string(), kHint);
    if (!cfg_text) return cfg_text.err();
    try {
      cfg = json::parse(cfg_text.value());
    } catch (const json::exception& e) {
      return core::error::at_file(cfg_path.string(), "not valid JSON: " + std::string(e.what()), kHint);
    }
    if (!cfg.is_object())
      return core::error::at_file(cfg_path.string(), "expected a JSON object", kHint);
  }
  auto named = [&](const char* key, std::vector<std::string> fallbacks,
                   std::optional<int>* out) -> core::status {
    if (auto name = config_token(cfg, key)) {
      auto it = t->id_of_.find(*name);
      if (it == t->id_of_.end())
        return core::error::at_key(cfg_path.string(), key, 0, 0,
                                   "token '" + *name + "' is not in " + path, kHint);
      *out = it->second;
      return {};
    }
    for (const auto& f : fallbacks)
      if (auto it = t->id_of_.find(f); it != t->id_of_.end()) {
        *out = it->second;
        return {};
      }
    return {};
  };
  std::vector<std::string> bos_names = before;
  for (const char* s : {"<|begin_of_text|>", "<s>", "<|endoftext|>"}) bos_names.emplace_back(s);
  if (auto s = named("bos_token", bos_names, &t->bos_); !s) return s.err();
  if (auto s = named("eos_token", {"<|end_of_text|>", "</s>", "<|endoftext|>"}, &t->eos_); !s)
    return s.err();
  if (auto s = named("pad_token", {}, &t->pad_); !s) return s.err();
  for (const auto& name : before) {
    auto it = t->id_of_.find(name);
    if (it == t->id_of_.end())
      return r.fail("post_processor", "the template names '" + name +
                                          "', which is not in the vocabulary");
    if (!t->bos_ || it->second != *t->bos_ || before.size() != 1)
      return r.unsupported("post_processor", "a template that puts '" + name +
                                                 "' before the text when it is not the one BOS",
                           "a single BOS before the text");
    t->add_bos_ = true;
  }
  if (!after.empty())
    return r.unsupported("post_processor", "a template that adds '" + after.front() +
                                               "' after the text",
                         "a single BOS before the text");
  return std::unique_ptr<text_tokenizer>(std::move(t));
}

std::vector<int> json_tokenizer::encode(std::string_view text, specials_in_text specials) const {
  std::string repaired;
  text = text::as_valid_utf8(text, repaired);
  std::vector<int> out;
  out.reserve(text.size() / 3);
  // Added tokens first: at each position the longest one that starts there (the list is sorted
  // longest first), the leftmost position winning, as the library's leftmost-longest automaton.
  std::size_t seg = 0, i = 0;
  while (i < text.size()) {
    const added_token* hit = nullptr;
    for (const auto& a : added_) {
      if (specials == specials_in_text::plain && a.special) continue;
      if (text.compare(i, a.content.size(), a.content) != 0) continue;
      if (a.single_word) {
        const std::size_t e = i + a.content.size();
        if ((i > 0 && is_word(static_cast<unsigned char>(text[i - 1]))) ||
            (e < text.size() && is_word(static_cast<unsigned char>(text[e]))))
          continue;
      }
      hit = &a;
      break;
    }
    if (!hit) {
      ++i;
      continue;
    }
    std::size_t begin = i, end = i + hit->content.size();
    if (hit->lstrip)
      while (begin > seg && is_space(static_cast<unsigned char>(text[begin - 1]))) --begin;
    if (hit->rstrip)
      while (end < text.size() && is_space(static_cast<unsigned char>(text[end]))) ++end;
    if (begin > seg) encode_segment(text.substr(seg, begin - seg), seg == 0, out);
    out.push_back(hit->id);
    seg = i = end;
  }
  if (seg < text.size()) encode_segment(text.substr(seg), seg == 0, out);
  return out;
}

void json_tokenizer::encode_segment(std::string_view segment, bool at_start,
                                    std::vector<int>& out) const {
  std::string norm(segment);
  for (const auto& n : normalizers_) {
    if (n.kind == normalize_step::prepend) {
      if (!norm.empty()) norm = n.to + norm;
    } else {
      replace_all(norm, n.from, n.to);
    }
  }
  if (norm.empty()) return;
  std::vector<piece> pieces{{std::move(norm), at_start}};
  std::vector<piece> next;
  for (const auto& p : pre_) {
    next.clear();
    for (auto& pc : pieces) {
      switch (p.kind) {
        case pre_step::split_isolated:
        case pre_step::split_removed: {
          std::size_t last = 0;
          auto emit = [&](std::size_t b, std::size_t e, bool match) {
            if (e <= b) return;
            if (match && p.kind == pre_step::split_removed) return;
            next.push_back({pc.text.substr(b, e - b), pc.first && b == 0});
          };
          if (p.re) {
            p.re->for_each_match(pc.text, [&](std::size_t b, std::size_t e) {
              emit(last, b, false);
              emit(b, e, true);
              last = e;
            });
          } else {
            for (std::size_t hit; (hit = pc.text.find(p.literal, last)) != std::string::npos;) {
              emit(last, hit, false);
              emit(hit, hit + p.literal.size(), true);
              last = hit + p.literal.size();
            }
          }
          emit(last, pc.text.size(), false);
          break;
        }
        case pre_step::byte_level: {
          if (p.add_prefix_space && (pc.text.empty() || pc.text[0] != ' ')) pc.text = " " + pc.text;
          if (!p.re) {
            next.push_back(std::move(pc));
            break;
          }
          p.re->for_each_match(pc.text, [&](std::size_t b, std::size_t e) {
            next.push_back({pc.text.substr(b, e - b), pc.first && b == 0});
          });
          break;
        }
        case pre_step::metaspace: {
          replace_all(pc.text, " ", p.replacement);
          if (p.scheme == pre_step::always || (p.scheme == pre_step::first && pc.first))
            if (pc.text.compare(0, p.replacement.size(), p.replacement) != 0)
              pc.text = p.replacement + pc.text;
          if (!p.split) {
            next.push_back(std::move(pc));
            break;
          }
          // Each piece starts at a replacement character (merged with what follows it).
          std::size_t b = 0;
          for (std::size_t hit = pc.text.find(p.replacement, 1); hit != std::string::npos;
               hit = pc.text.find(p.replacement, hit + p.replacement.size())) {
            next.push_back({pc.text.substr(b, hit - b), pc.first && b == 0});
            b = hit;
          }
          next.push_back({pc.text.substr(b), pc.first && b == 0});
          break;
        }
      }
    }
    pieces.swap(next);
  }
  for (const auto& pc : pieces)
    if (!pc.text.empty()) bpe(pc.text, out);
}

void json_tokenizer::bpe(const std::string& word, std::vector<int>& out) const {
  constexpr std::size_t kCacheable = 256;
  if (word.size() <= kCacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int> symbols;
  symbols.reserve(word.size());
  std::vector<int> ids;
  if (byte_level_) {
    std::string key;
    if (ignore_merges_)
      for (unsigned char b : word) text::append_utf8(key, b2u_[b]);
    if (auto it = ignore_merges_ ? vocab_.find(key) : vocab_.end(); it != vocab_.end()) {
      ids.push_back(it->second);
    } else {
      for (unsigned char b : word) symbols.push_back(byte_id_[b]);
      ids = merge(std::move(symbols));
    }
  } else if (auto it = ignore_merges_ ? vocab_.find(word) : vocab_.end(); it != vocab_.end()) {
    ids.push_back(it->second);
  } else {
    const auto* s = reinterpret_cast<const unsigned char*>(word.data());
    bool last_unk = false;
    for (std::size_t i = 0; i < word.size();) {
      int bad = 0;
      int len = text::utf8_sequence(s + i, word.size() - i, &bad);
      if (len == 0) len = bad;  // cannot happen: the text was made valid
      auto v = vocab_.find(word.substr(i, static_cast<std::size_t>(len)));
      if (v != vocab_.end()) {
        symbols.push_back(v->second);
        last_unk = false;
      } else if (byte_fallback_) {
        for (int k = 0; k < len; ++k) symbols.push_back(fallback_id_[s[i + static_cast<std::size_t>(k)]]);
        last_unk = false;
      } else if (unk_) {
        if (!(fuse_unk_ && last_unk)) symbols.push_back(*unk_);
        last_unk = true;
      }
      i += static_cast<std::size_t>(len);
    }
    ids = merge(std::move(symbols));
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (word.size() <= kCacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= (1u << 20)) cache_.clear();
    cache_.emplace(word, std::move(ids));
  }
}

std::vector<int> json_tokenizer::merge(std::vector<int> symbols) const {
  const int n = static_cast<int>(symbols.size());
  if (n < 2) return symbols;
  std::vector<int> prev(static_cast<std::size_t>(n)), next(static_cast<std::size_t>(n));
  std::vector<char> alive(static_cast<std::size_t>(n), 1);
  for (int i = 0; i < n; ++i) {
    prev[static_cast<std::size_t>(i)] = i - 1;
    next[static_cast<std::size_t>(i)] = i + 1 < n ? i + 1 : -1;
  }
  struct cand {
    int rank, pos, result;
    bool operator>(const cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<cand, std::vector<cand>, std::greater<cand>> queue;
  auto offer = [&](int left) {
    const int right = next[static_cast<std::size_t>(left)];
    if (right < 0) return;
    auto it = merges_.find(pair_key(symbols[static_cast<std::size_t>(left)],
                                    symbols[static_cast<std::size_t>(right)]));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) offer(i);
  while (!queue.empty()) {
    const cand c = queue.top();
    queue.pop();
    const auto pos = static_cast<std::size_t>(c.pos);
    if (!alive[pos] || next[pos] < 0) continue;
    const auto right = static_cast<std::size_t>(next[pos]);
    // The pair may have changed since it was queued: apply it only if it still merges to `result`.
    auto it = merges_.find(pair_key(symbols[pos], symbols[right]));
    if (it == merges_.end() || it->second.rank != c.rank || it->second.result != c.result) continue;
    symbols[pos] = c.result;
    alive[right] = 0;
    next[pos] = next[right];
    if (next[pos] >= 0) prev[static_cast<std::size_t>(next[pos])] = c.pos;
    if (prev[pos] >= 0) offer(prev[pos]);
    offer(c.pos);
  }
  std::vector<int> out;
  for (int i = 0; i >= 0; i = next[static_cast<std::size_t>(i)]) out.push_back(symbols[static_cast<std::size_t>(i)]);
  return out;
}

std::string json_tokenizer::decode(std::span<const int> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int id : ids) {
    TROUPE_CHECK(id >= 0 && id < vocab_size(),
                 "token id " + std::to_string(id) + " is outside the vocabulary of " +
                     std::to_string(vocab_size()) + " (" + path_ + ")");
    tokens.push_back(token_of_[static_cast<std::size_t>(id)]);
  }
  for (const auto& d : decoders_) {
    switch (d.kind) {
      case decode_step::byte_level:
        for (auto& t : tokens) {
          bool ok = false;
          auto cps = text::code_points(t, &ok);
          std::string bytes;
          for (char32_t c : cps) {
            auto it = u2b_.find(c);
            if (it != u2b_.end())
              bytes += static_cast<char>(it->second);
            else
              text::append_utf8(bytes, c);
          }
          t = std::move(bytes);
        }
        break;
      case decode_step::replace:
        for (auto& t : tokens) replace_all(t, d.from, d.to);
        break;
      case decode_step::byte_fallback:
        for (auto& t : tokens)
          if (auto b = byte_token(t)) t = std::string(1, static_cast<char>(*b));
        break;
      case decode_step::fuse: {
        std::string all;
        for (auto& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case decode_step::strip:
        for (auto& t : tokens) {
          for (int k = 0; k < d.start && t.compare(0, d.from.size(), d.from) == 0; ++k)
            t.erase(0, d.from.size());
          for (int k = 0; k < d.stop && t.size() >= d.from.size() &&
                          t.compare(t.size() - d.from.size(), d.from.size(), d.from) == 0;
               ++k)
            t.erase(t.size() - d.from.size());
        }
        break;
      case decode_step::metaspace:
        for (std::size_t k = 0; k < tokens.size(); ++k) {
          replace_all(tokens[k], d.from, " ");
          if (k == 0 && d.prepend && !tokens[k].empty() && tokens[k][0] == ' ') tokens[k].erase(0, 1);
        }
        break;
    }
  }
  std::string out;
  for (auto& t : tokens) out += t;
  return out;
}

core::result<std::unique_ptr<text_tokenizer>> load_tokenizer_json(const std::string& path) {
  return json_tokenizer::load(path);
}

}  // namespace troupe::model
