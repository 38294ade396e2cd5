// Instruction records to training rows (docs/data.md, Instruction data): what `troupe data
// prepare` does with JSONL input before writing instruction shards (model/instruction_shards.hpp).
//
//  1. A record is one JSON object per line: {"prompt": ..., "response": ...}, or a chat
//     {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]} with at least one
//     assistant message. A prompt/response record is the chat [user: prompt, assistant: response].
//  2. A template renders the chat as segments — text, a named special token, or the tokenizer's
//     end-of-text token — each marked trained or not. Trained: the content of every assistant
//     message and the token that closes it (the response and its end). Everything else (system
//     and user turns, role headers, begin-of-text) is context, masked out of the loss.
//       plain:  user/system content + "\n" ... assistant content <eos>   (eos: the tokenizer's
//               end-of-text token, <|endoftext|> for GPT-2)
//       llama3: <|begin_of_text|> then per message <|start_header_id|>ROLE<|end_header_id|>\n\n
//               CONTENT<|eot_id|>, content trimmed of surrounding whitespace (Meta's LLaMA-3 chat
//               format, as its tokenizer_config.json chat_template writes it)
//     Text segments are encoded one by one; special tokens are looked up by their text, so the
//     template code is the same for every tokenizer that has them (GPT-2's has no LLaMA-3 ones:
//     the llama3 template then stops with an error naming the missing token).
//  3. An example longer than seq_length + 1 tokens is truncated to that length. One whose first
//     trained token lies past the row (a prompt that leaves the response no position) is dropped.
//  4. Rows of seq_length + 1 tokens: padded (one example per row, the rest pad tokens) or packed
//     (examples back to back in order; one that does not fit the rest of the row starts the next
//     row, the rest padded). Packed examples share the row's causal attention (no document mask).
//     Padding is masked.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"

namespace troupe::model {

enum class chat_template { plain = 0, llama3 = 1 };

/// "plain" / "llama3" (data.template); an error listing the names for anything else.
core::result<chat_template> parse_template(std::string_view name);
const char* template_name(chat_template t);

struct chat_message {
  std::string role;  // system, user or assistant
  std::string content;
};

/// One JSONL line read as a chat, or why it cannot be (a record that is dropped).
struct parsed_record {
  std::vector<chat_message> chat;
  std::string problem;        // empty when the record is good; without file and line
  bool invalid_json = false;  // the line is not JSON at all (else: fields are missing or wrong)
  bool ok() const { return problem.empty(); }
};
/// Reads one JSONL line (step 1 above).
parsed_record parse_record(std::string_view line);

/// A piece of a rendered chat.
struct segment {
  enum class kind { text, special, eos };
  kind what = kind::text;
  std::string text;  // the text, or the special token's text
  bool trained = false;
};

/// The segments of `chat` under `t` (step 2 above). REQUIRES: a valid chat (parse_record).
std::vector<segment> render(chat_template t, const std::vector<chat_message>& chat);

/// What rendering needs of a tokenizer.
struct token_codec {
  std::function<std::vector<int>(std::string_view)> encode;
  /// The id of a special token written as `text` (e.g. "<|eot_id|>"), if the vocabulary has one.
  std::function<std::optional<int>(std::string_view)> special;
  int eos = -1;          // closes a plain-template response (-1: the tokenizer has none)
  int pad = 0;           // fills padded rows
  std::string name;      // for messages, e.g. "the GPT-2 tokenizer in data/gpt2"
};

/// Tokens and loss mask (1 = trained target) of one rendered chat, untruncated. Errors when the
/// template needs a special token the codec lacks.
struct example {
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> mask;
};
core::result<example> encode_example(const std::vector<segment>& segs, const token_codec& codec);

/// Why records were dropped or changed, for the report.
struct prepare_counts {
  std::int64_t records = 0;     // lines holding a record (blank lines are skipped)
  std::int64_t kept = 0;
  std::int64_t truncated = 0;   // kept, cut to seq_length + 1 tokens
  std::int64_t invalid_json = 0;
  std::int64_t bad_fields = 0;  // missing or mistyped fields, unknown roles, no assistant turn
  std::int64_t too_long = 0;    // the prompt leaves the response no position
  std::int64_t rows = 0;
  std::int64_t trained = 0;     // trained targets over all rows
};

/// Rows of row_tokens ids and their mask, built from examples in order (step 3-4).
class row_builder {
 public:
  row_builder(int row_tokens, bool packing, int pad) : L_(row_tokens), packing_(packing), pad_(pad) {}
  /// Adds an example; returns false (and adds nothing) when none of its trained tokens is a
  /// target inside one row. Sets *truncated when it was cut.
  bool add(example e, bool* truncated = nullptr);
  /// Pads the open row (if any); call once after the last add.
  void finish();
  const std::vector<std::int32_t>& ids() const { return ids_; }
  const std::vector<std::uint8_t>& mask() const { return mask_; }
  /// 1 where an example begins (model/instruction_shards.hpp, version 2).
  const std::vector<std::uint8_t>& starts() const { return starts_; }
  std::int64_t rows() const { return static_cast<std::int64_t>(ids_.size()) / L_; }

 private:
  void pad_open_row();
  int L_;
  bool packing_;
  int pad_;
  int used_ = 0;  // tokens in the open row (0: none open)
  std::vector<std::int32_t> ids_;
  std::vector<std::uint8_t> mask_;
  std::vector<std::uint8_t> starts_;
};

/// A record dropped, where it was and why.
struct record_problem {
  std::string file;
  std::int64_t line = 0;  // 1-based
  std::string reason;
};

struct instruct_options {
  int seq_length = 0;  // rows of seq_length + 1 tokens
  chat_template tmpl = chat_template::plain;
  bool packing = false;
  double val_fraction = 0;  // kept record i goes to validation when ⌊(i+1)f⌋ > ⌊i·f⌋
  int vocab_size = 0;       // ids must be below it (model.vocab_size); 0 = not checked
};

/// Every record of `files` (JSONL) rendered, encoded and built into train and validation rows.
/// Bad records are dropped and listed in `problems`; an unreadable file, a template the tokenizer
/// cannot encode, or an id outside the vocabulary is an error.
struct prepared_rows {
  row_builder train, val;
  prepare_counts counts;
  std::vector<record_problem> problems;
};
core::result<prepared_rows> prepare_instructions(const std::vector<std::string>& files,
                                                 const instruct_options& opt,
                                                 const token_codec& codec);

}  // namespace troupe::model
