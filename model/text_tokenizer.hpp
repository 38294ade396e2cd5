// The tokenizer interface every command uses (data prepare, generate, export, eval), whatever the
// vocabulary's kind:
//   - GPT-2's own files, encoder.json + vocab.bpe (model/tokenizer.hpp), ids identical to OpenAI's
//     encoder.py;
//   - a Hugging Face tokenizer.json (model/tokenizer_json.cpp) holding a BPE model: byte-level BPE
//     (GPT-2, LLaMA-3 with its Split regex and ignore_merges) or SentencePiece-style BPE with byte
//     fallback (LLaMA-2: U+2581 for spaces, one prepended, <0xNN> byte tokens), its added tokens
//     (matched in text by the file's rules: longest first, lstrip / rstrip / single_word), its
//     post-processor's BOS and its decoder.
// What a file asks for that is not implemented (another model type, a Unicode normalizer, an
// unknown pre-tokenizer) is refused at load, naming the file and the JSON key, never ignored.
//
// Special ids: BOS / EOS / pad come from tokenizer_config.json beside tokenizer.json when it names
// them (as Hugging Face's directories do), else BOS from the post-processor's template, else the
// well-known names (<|begin_of_text|> / <|end_of_text|>, <s> / </s>, <|endoftext|>).
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"

namespace troupe::model {

/// How special tokens written in the text are read by encode.
enum class specials_in_text {
  match,  // an added token's text becomes its id (Hugging Face's default)
  plain,  // special tokens are ordinary text (llm.c's and tiktoken's encode_ordinary)
};

class text_tokenizer {
 public:
  virtual ~text_tokenizer() = default;

  /// Token ids of `text`, without the post-processor's BOS (see add_bos). Invalid UTF-8 is first
  /// replaced by U+FFFD. Safe to call from several threads.
  virtual std::vector<int> encode(std::string_view text,
                                  specials_in_text specials = specials_in_text::match) const = 0;
  /// The bytes `ids` stand for, through the file's decoder (UTF-8 unless the ids split a
  /// character). REQUIRES: every id in [0, vocab_size()).
  virtual std::string decode(std::span<const int> ids) const = 0;
  /// Number of ids: one past the largest (LLaMA-3: 128,256).
  virtual int vocab_size() const = 0;

  virtual std::optional<int> bos_id() const = 0;
  virtual std::optional<int> eos_id() const = 0;
  virtual std::optional<int> pad_id() const = 0;
  /// Whether the model expects BOS before every sequence (the file's post-processor adds it).
  virtual bool add_bos() const = 0;
  /// Id of a token written as in the file (an added token such as "<|eot_id|>", or a vocabulary
  /// entry in the file's alphabet), if there is one.
  virtual std::optional<int> token_id(std::string_view token) const = 0;
  /// One line for logs: the kind, the source file and the vocabulary size.
  virtual std::string describe() const = 0;

  /// encode, with BOS first when add_bos().
  std::vector<int> encode_for_model(std::string_view text,
                                    specials_in_text specials = specials_in_text::match) const;
};

/// Loads the tokenizer `spec` names: a tokenizer.json file, a folder holding GPT-2's encoder.json
/// and vocab.bpe (preferred where both kinds are present), or a folder holding tokenizer.json.
/// Errors name the file (and key or line) and say how to get the files.
core::result<std::unique_ptr<text_tokenizer>> load_tokenizer(const std::string& spec);

/// Loads a Hugging Face tokenizer.json file (see the top of this header for what is supported).
core::result<std::unique_ptr<text_tokenizer>> load_tokenizer_json(const std::string& path);

}  // namespace troupe::model
