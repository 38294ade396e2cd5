#include "model/text_tokenizer.hpp"

#include <filesystem>
#include <system_error>

#include "model/tokenizer.hpp"

namespace troupe::model {

namespace {

// GPT-2's encoder.json + vocab.bpe behind the common interface. <|endoftext|> is GPT-2's only
// special token; written in the text it is matched like Hugging Face's GPT-2 tokenizer.json does
// (specials_in_text::match) or read as text like encoder.py (plain).
class gpt2_files final : public text_tokenizer {
 public:
  gpt2_files(tokenizer t, std::string dir) : t_(std::move(t)), dir_(std::move(dir)) {}

  std::vector<int> encode(std::string_view text, specials_in_text specials) const override {
    if (specials == specials_in_text::plain) return t_.encode(text);
    static constexpr std::string_view eot = "<|endoftext|>";
    std::vector<int> out;
    std::size_t from = 0;
    for (std::size_t hit; (hit = text.find(eot, from)) != std::string_view::npos;
         from = hit + eot.size()) {
      auto ids = t_.encode(text.substr(from, hit - from));
      out.insert(out.end(), ids.begin(), ids.end());
      out.push_back(tokenizer::eot_id);
    }
    auto ids = t_.encode(text.substr(from));
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
  }
  std::string decode(std::span<const int> ids) const override {
    return t_.decode(std::vector<int>(ids.begin(), ids.end()));
  }
  int vocab_size() const override { return t_.vocab_size(); }
  std::optional<int> bos_id() const override { return tokenizer::eot_id; }
  std::optional<int> eos_id() const override { return tokenizer::eot_id; }
  std::optional<int> pad_id() const override { return std::nullopt; }
  bool add_bos() const override { return false; }
  std::optional<int> token_id(std::string_view token) const override {
    if (token == "<|endoftext|>") return tokenizer::eot_id;
    return std::nullopt;
  }
  std::string describe() const override {
    return "GPT-2 BPE from " + dir_ + " (encoder.json + vocab.bpe, " +
           std::to_string(vocab_size()) + " ids)";
  }

 private:
  tokenizer t_;
  std::string dir_;
};

}  // namespace

std::vector<int> text_tokenizer::encode_for_model(std::string_view text,
                                                  specials_in_text specials) const {
  std::vector<int> ids = encode(text, specials);
  if (add_bos() && bos_id()) ids.insert(ids.begin(), *bos_id());
  return ids;
}

core::result<std::unique_ptr<text_tokenizer>> load_tokenizer(const std::string& spec) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string hint =
      "name a tokenizer.json file, a folder holding tokenizer.json, or a folder holding GPT-2's "
      "encoder.json and vocab.bpe (scripts/setup.sh writes data/gpt2, data/llama2 and "
      "data/llama3)";
  if (spec.empty()) return core::error::make("no tokenizer given", hint);
  if (fs::is_directory(spec, ec)) {
    // GPT-2's own files first: data/gpt2 holds both, and its encoder.json path is the one checked
    // against OpenAI's ids on the whole corpus.
    const fs::path json = fs::path(spec) / "tokenizer.json";
    if (fs::exists(fs::path(spec) / "encoder.json", ec) ||
        (fs::exists(fs::path(spec) / "vocab.bpe", ec) && !fs::exists(json, ec))) {
      auto t = tokenizer::load(spec);
      if (!t) return t.err();
      return std::unique_ptr<text_tokenizer>(
          std::make_unique<gpt2_files>(std::move(t.value()), spec));
    }
    if (fs::exists(json, ec)) return load_tokenizer_json(json.string());
    return core::error::at_file(spec, "folder holds neither tokenizer.json nor encoder.json + "
                                      "vocab.bpe", hint);
  }
  if (!fs::exists(spec, ec)) return core::error::at_file(spec, "tokenizer not found", hint);
  return load_tokenizer_json(spec);
}

}  // namespace troupe::model
