// `troupe data prepare`: tokenizes text files into llm.c token shards, DIR/train.bin and
// DIR/val.bin, with the tokenizer --tokenizer or the config's data.tokenizer names (GPT-2's files
// by default; any model/text_tokenizer.hpp reads). Document text is ordinary text: special-token
// spellings in it are not matched. Every document (one file) is preceded by the tokenizer's BOS
// (GPT-2's <|endoftext|>, LLaMA-3's <|begin_of_text|>, LLaMA-2's <s>), or its EOS if it has no
// BOS. Shards hold uint16 ids up to 65,536 ids and uint32 above (model/shards.hpp). The token
// stream is cut into chunks of --chunk-tokens and a --val-fraction share of the chunks, spread
// evenly through the stream, forms the validation split. Validation text is therefore drawn from
// the same mix of documents as training text: a split taken from a different text measures
// something else (docs/data.md: such a split stays near loss 7.2 while training loss falls).
//
// JSONL input (*.jsonl files) is instruction data instead: records rendered by a chat template
// into rows of model.seq_length + 1 tokens with a loss mask (model/instruct.hpp), written as
// instruction shards DIR/train.bin and DIR/val.bin (model/instruction_shards.hpp). The config
// (--config, --set) gives model.seq_length, model.vocab_size, data.template and data.packing; a
// --val-fraction share of the records, spread evenly, forms the validation split. Bad records
// are dropped, each reported with its file and line, and counted by reason.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/files.hpp"
#include "core/config.hpp"
#include "model/instruct.hpp"
#include "model/instruction_shards.hpp"
#include "model/shards.hpp"
#include "model/text_tokenizer.hpp"
#include "model/tokenizer.hpp"

namespace troupe::cli {
namespace {

namespace fs = std::filesystem;

struct prepare_args {
  std::vector<std::string> inputs;
  std::string out;
  double val_fraction = 0.05;
  std::string tokenizer;  // "" = the config's data.tokenizer, else data/gpt2
  std::string config;
  int chunk_tokens = 1024;
  std::vector<std::string> sets;  // --set overrides of the config (JSONL input needs a config)
  bool chunk_tokens_given = false;
};

// Files named by the inputs, in a deterministic order: arguments as given, each folder's *.txt
// files (recursively) sorted by path.
core::result<std::vector<fs::path>> collect_inputs(const std::vector<std::string>& inputs) {
  std::vector<fs::path> files;
  for (const auto& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(in, ec); !ec && it != fs::end(it);
           it.increment(ec))
        if (it->is_regular_file() && it->path().extension() == ".txt") found.push_back(it->path());
      if (ec) return core::error::at_file(in, "cannot list folder: " + ec.message());
      if (found.empty())
        return core::error::at_file(in, "folder holds no *.txt files",
                                    "pass text files or folders of *.txt files to --input");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(in, ec)) {
      files.emplace_back(in);
    } else {
      return core::error::at_file(in, "input not found",
                                  "--input takes text files or folders of *.txt files (run "
                                  "scripts/setup.sh for the corpus in data/raw)");
    }
  }
  return files;
}

core::result<std::string> read_text(const fs::path& p) {
  core::input_spec spec;
  spec.what = "text file";
  // Tokens are counted in an int32 per shard, and a token takes at least one byte of text.
  spec.max_bytes = std::uint64_t(1) << 31;
  spec.hint = "--input takes UTF-8 text files; split a larger corpus into several files";
  return core::read_input(p.string(), spec);
}

// A progress bar on stderr: redrawn in place on a terminal, one line per tenth otherwise (logs).
class progress {
 public:
  explicit progress(std::uint64_t total) : total_(total), tty_(::isatty(2) == 1) {}

  void update(std::uint64_t done, std::uint64_t tokens) {
    const double frac = total_ ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
    if (tty_) {
      constexpr int width = 30;
      int filled = static_cast<int>(frac * width);
      std::fprintf(stderr, "\rprepare [%s%s] %3d%%  %.1f/%.1f MB  %llu tokens",
                   std::string(static_cast<std::size_t>(filled), '#').c_str(),
                   std::string(static_cast<std::size_t>(width - filled), '.').c_str(),
                   static_cast<int>(frac * 100), static_cast<double>(done) / 1e6,
                   static_cast<double>(total_) / 1e6, static_cast<unsigned long long>(tokens));
      std::fflush(stderr);
    } else {
      int tenth = static_cast<int>(frac * 10);
      while (printed_ < tenth) {
        ++printed_;
        std::fprintf(stderr, "prepare: %3d%%  %.1f/%.1f MB  %llu tokens\n", printed_ * 10,
                     static_cast<double>(done) / 1e6, static_cast<double>(total_) / 1e6,
                     static_cast<unsigned long long>(tokens));
      }
    }
  }
  void finish() {
    if (tty_) std::fprintf(stderr, "\n");
  }

 private:
  std::uint64_t total_;
  bool tty_;
  int printed_ = 0;
};

std::string with_commas(std::int64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<std::size_t>(i), ",");
  return s;
}

bool is_jsonl(const std::string& path) { return fs::path(path).extension() == ".jsonl"; }

// Creates the output folder of `troupe data prepare`; false (reported) when it cannot.
bool make_output_folder(const std::string& out) {
  std::error_code ec;
  fs::create_directories(out, ec);
  if (!ec) return true;
  print_error(core::error::at_file(out, "cannot create output folder: " + ec.message()).to_string());
  return false;
}

/// A tokenizer as the templates see it. Text is encoded with special tokens read as plain text, so
/// a prompt that spells "<|eot_id|>" cannot end a turn; the template's own special tokens are
/// looked up by name. The end of a plain-template response is the tokenizer's EOS; padding is its
/// pad token, else EOS.
model::token_codec codec_of(std::shared_ptr<const model::text_tokenizer> tok) {
  model::token_codec c;
  c.encode = [tok](std::string_view text) {
    return tok->encode(text, model::specials_in_text::plain);
  };
  c.special = [tok](std::string_view text) { return tok->token_id(text); };
  c.eos = tok->eos_id().value_or(-1);
  c.pad = tok->pad_id().value_or(std::max(c.eos, 0));
  c.name = tok->describe();
  return c;
}

int run_prepare_instructions(const prepare_args& a) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& in : a.inputs)
    if (!is_jsonl(in)) {
      print_error(core::error::at_file(in, "JSONL instruction data and text cannot be prepared together",
                                       "give --input only *.jsonl files, or only text")
                      .to_string());
      return 2;
    }
  if (a.config.empty()) {
    print_error(core::error::make("JSONL instruction data needs --config CONFIG",
                                  "the rows are made for a run: model.seq_length, "
                                  "model.vocab_size, data.template and data.packing come from it")
                    .to_string());
    return 2;
  }
  if (a.chunk_tokens_given) {
    print_error(core::error::make("--chunk-tokens applies to text input",
                                  "instruction data is split into train and validation by record "
                                  "(--val-fraction)")
                    .to_string());
    return 2;
  }
  auto cfg = core::load_config(a.config, a.sets);
  if (!cfg) {
    print_error(cfg.err().to_string());
    return 1;
  }
  auto tmpl = model::parse_template(cfg->data.chat_template);
  if (!tmpl) {
    print_error(tmpl.err().to_string());
    return 1;
  }
  std::string tok_dir = a.tokenizer;
  if (tok_dir.empty()) tok_dir = cfg->data.tokenizer_spec();
  if (tok_dir.empty()) tok_dir = model::tokenizer::default_dir;
  auto tok = model::load_tokenizer(tok_dir);
  if (!tok) {
    print_error(tok.err().to_string());
    return 1;
  }
  const model::token_codec codec =
      codec_of(std::shared_ptr<const model::text_tokenizer>(std::move(tok.value())));
  model::instruct_options opt;
  opt.seq_length = cfg->model.seq_length;
  opt.tmpl = tmpl.value();
  opt.packing = cfg->data.packing;
  opt.val_fraction = a.val_fraction;
  opt.vocab_size = cfg->model.vocab_size;
  auto rows = model::prepare_instructions(a.inputs, opt, codec);
  if (!rows) {
    print_error(rows.err().to_string());
    return 1;
  }
  const model::prepare_counts& n = rows->counts;
  constexpr std::size_t shown = 20;
  for (std::size_t i = 0; i < rows->problems.size() && i < shown; ++i) {
    const auto& p = rows->problems[i];
    std::fprintf(stderr, "troupe: warning: %s:%lld: record dropped: %s\n", p.file.c_str(),
                 static_cast<long long>(p.line), p.reason.c_str());
  }
  if (rows->problems.size() > shown)
    std::fprintf(stderr, "troupe: warning: ... and %zu more dropped records\n",
                 rows->problems.size() - shown);
  const std::int64_t dropped = n.invalid_json + n.bad_fields + n.too_long;
  std::string why;
  auto reason = [&](std::int64_t k, const char* what) {
    if (k == 0) return;
    why += (why.empty() ? "" : ", ") + with_commas(k) + " " + what;
  };
  reason(n.invalid_json, "invalid JSON");
  reason(n.bad_fields, "missing or mistyped fields");
  reason(n.too_long, "prompt too long for seq_length");
  if (n.kept == 0) {
    print_error(core::error::make("no record of " + with_commas(n.records) +
                                      " could be used" + (why.empty() ? "" : ": " + why),
                                  "the warnings above name each record's file, line and problem")
                    .to_string());
    return 1;
  }
  if (!make_output_folder(a.out)) return 1;
  std::error_code ec;
  const model::row_layout layout{opt.seq_length + 1, opt.packing, static_cast<int>(opt.tmpl),
                                 codec.pad};
  const std::string train_path = (fs::path(a.out) / "train.bin").string();
  const std::string val_path = (fs::path(a.out) / "val.bin").string();
  for (auto [path, b] : {std::pair{&train_path, &rows->train}, std::pair{&val_path, &rows->val}})
    if (auto s = model::write_instruction_shard(*path, layout, b->ids(), b->mask(), b->starts()); !s) {
      print_error(s.err().to_string());
      return 1;
    }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("prepared %s records (template %s, %s, seq_length %d) in %.2f s: %s kept",
              with_commas(n.records).c_str(), model::template_name(opt.tmpl),
              opt.packing ? "packed" : "padded", opt.seq_length, seconds,
              with_commas(n.kept).c_str());
  if (n.truncated) std::printf(" (%s truncated to %d tokens)", with_commas(n.truncated).c_str(), opt.seq_length + 1);
  std::printf(", %s dropped%s\n", with_commas(dropped).c_str(), why.empty() ? "" : (" (" + why + ")").c_str());
  const auto L = static_cast<std::int64_t>(opt.seq_length) + 1;
  for (auto [name, path, b] : {std::tuple{"train:", &train_path, &rows->train},
                               std::tuple{"val:  ", &val_path, &rows->val}}) {
    std::int64_t trained = 0;
    for (std::size_t i = 0; i < b->mask().size(); ++i)
      trained += (static_cast<std::int64_t>(i) % L != 0) && b->mask()[i] != 0;
    std::printf("  %s %s  %s rows of %lld tokens, %s trained targets (%.1f%% of the targets)\n",
                name, path->c_str(),
                with_commas(b->rows()).c_str(), static_cast<long long>(L),
                with_commas(trained).c_str(),
                b->rows() ? 100.0 * static_cast<double>(trained) / static_cast<double>(b->rows() * (L - 1)) : 0.0);
  }
  if (rows->val.rows() == 0)
    std::fprintf(stderr, "troupe: warning: %s has no rows: set data.val = \"\" in the config, or "
                         "give a --val-fraction that keeps at least one record\n", val_path.c_str());
  return 0;
}

int run_prepare(const prepare_args& a) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!(a.val_fraction >= 0.0 && a.val_fraction < 1.0)) {
    print_error(core::error::make("--val-fraction must be in [0, 1), got " +
                                  std::to_string(a.val_fraction),
                                  "0.05 keeps every twentieth chunk for validation")
                    .to_string());
    return 2;
  }
  if (std::any_of(a.inputs.begin(), a.inputs.end(), is_jsonl)) return run_prepare_instructions(a);
  if (!a.sets.empty() && a.config.empty()) {
    print_error(core::error::make("--set needs --config",
                                  "--set overrides keys of the config given with --config")
                    .to_string());
    return 2;
  }
  std::string spec = a.tokenizer;
  int model_vocab = 0;
  if (!a.config.empty()) {
    auto cfg = core::load_config(a.config, a.sets);
    if (!cfg) {
      print_error(cfg.err().to_string());
      return 2;
    }
    if (spec.empty()) spec = cfg->data.tokenizer_spec();
    model_vocab = cfg->model.vocab_size;
  }
  if (spec.empty()) spec = model::tokenizer::default_dir;
  auto loaded = model::load_tokenizer(spec);
  if (!loaded) {
    print_error(loaded.err().to_string());
    return 1;
  }
  const model::text_tokenizer& tok = *loaded.value();
  if (model_vocab > 0 && tok.vocab_size() > model_vocab) {
    print_error(core::error::at_key(a.config, "model.vocab_size", 0, 0,
                                    "the tokenizer " + spec + " has " +
                                        std::to_string(tok.vocab_size()) +
                                        " ids, more than model.vocab_size " +
                                        std::to_string(model_vocab),
                                    "set model.vocab_size to at least " +
                                        std::to_string(tok.vocab_size()) +
                                        ", or use the model's tokenizer")
                    .to_string());
    return 2;
  }
  const std::optional<int> separator = tok.bos_id() ? tok.bos_id() : tok.eos_id();
  if (!separator)
    std::fprintf(stderr, "troupe: warning: %s names neither BOS nor EOS: documents are joined "
                         "without a separator\n", spec.c_str());
  std::fprintf(stderr, "prepare: %s\n", tok.describe().c_str());
  auto files = collect_inputs(a.inputs);
  if (!files) {
    print_error(files.err().to_string());
    return 1;
  }
  if (!make_output_folder(a.out)) return 1;
  std::error_code ec;

  std::uint64_t total_bytes = 0;
  for (const auto& f : files.value()) {
    auto size = fs::file_size(f, ec);
    if (!ec) total_bytes += size;  // an unreadable file is reported when it is read
  }
  progress bar(total_bytes);
  std::vector<int> stream;
  std::uint64_t done_bytes = 0;
  for (const auto& f : files.value()) {
    auto text = read_text(f);
    if (!text) {
      bar.finish();
      print_error(text.err().to_string());
      return 1;
    }
    if (text->empty()) {
      bar.finish();
      print_error(core::error::at_file(f.string(), "the text file is empty: nothing to tokenize",
                                       "remove it from --input, or give it some text")
                      .to_string());
      return 1;
    }
    std::size_t replaced = 0;
    model::tokenizer::valid_utf8(text.value(), &replaced);
    if (replaced > 0)
      std::fprintf(stderr, "\ntroupe: warning: %s: %zu invalid UTF-8 sequences read as U+FFFD\n",
                   f.string().c_str(), replaced);
    if (separator) stream.push_back(*separator);
    std::vector<int> ids;
    try {
      ids = tok.encode(text.value(), model::specials_in_text::plain);
    } catch (const core::failure& e) {
      bar.finish();
      print_error(core::error::at_file(f.string(), e.what(), "please report this input").to_string());
      return 1;
    }
    stream.insert(stream.end(), ids.begin(), ids.end());
    done_bytes += text->size();
    bar.update(done_bytes, stream.size());
  }
  bar.finish();

  // Training predicts each token from those before it: with fewer than two tokens of text
  // there is nothing to learn, and no config's shard would be usable.
  const std::size_t text_tokens = stream.size() - (separator ? files->size() : 0);
  if (text_tokens < 2) {
    print_error(core::error::at_file(files->size() == 1 ? files->front().string() : "--input",
                                     "the input holds " + std::to_string(text_tokens) +
                                      " token" + (text_tokens == 1 ? "" : "s") +
                                      " of text; a training shard needs at least two (one to "
                                      "predict the next from), and a config's model.seq_length + 1",
                                  "give --input more text")
                    .to_string());
    return 1;
  }
  // Chunk c goes to validation when floor((c+1)·f) > floor(c·f): exactly the fraction f of the
  // chunks, one every 1/f, wherever f does not divide evenly.
  std::vector<int> train, val;
  const auto chunk = static_cast<std::size_t>(a.chunk_tokens);
  const auto& tokens = stream;
  for (std::size_t begin = 0, c = 0; begin < tokens.size(); begin += chunk, ++c) {
    std::size_t end = std::min(tokens.size(), begin + chunk);
    bool to_val = std::floor(static_cast<double>(c + 1) * a.val_fraction) >
                  std::floor(static_cast<double>(c) * a.val_fraction);
    auto& dst = to_val ? val : train;
    dst.insert(dst.end(), tokens.begin() + static_cast<std::ptrdiff_t>(begin),
               tokens.begin() + static_cast<std::ptrdiff_t>(end));
  }

  // uint16 shards (llm.c's GPT-2 format) up to 65,536 ids, uint32 above (model/shards.hpp).
  const std::string train_path = (fs::path(a.out) / "train.bin").string();
  const std::string val_path = (fs::path(a.out) / "val.bin").string();
  for (auto [path, data] : {std::pair{&train_path, &train}, std::pair{&val_path, &val}}) {
    if (auto s = model::write_tokens(*path, *data, tok.vocab_size()); !s) {
      print_error(s.err().to_string());
      return 1;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("prepared %zu documents (%.1f MB): %zu tokens in %.2f s (%.0f tokens/s)\n",
              files->size(), static_cast<double>(total_bytes) / 1e6, tokens.size(), seconds,
              static_cast<double>(tokens.size()) / std::max(seconds, 1e-9));
  std::printf("  train: %s  %zu tokens\n", train_path.c_str(), train.size());
  std::printf("  val:   %s  %zu tokens (%.1f%%: one %d-token chunk in %.0f)\n", val_path.c_str(),
              val.size(), tokens.empty() ? 0.0 : 100.0 * val.size() / tokens.size(),
              a.chunk_tokens, a.val_fraction > 0 ? 1.0 / a.val_fraction : 0.0);
  if (a.val_fraction > 0 && val.empty())
    std::fprintf(stderr,
                 "troupe: warning: %s is empty: %zu tokens make fewer than 1/%.3g chunks of %d\n"
                 "  hint: add text or pass a smaller --chunk-tokens\n",
                 val_path.c_str(), tokens.size(), a.val_fraction, a.chunk_tokens);
  return 0;
}

const command_registrar registrar{command{
    "data", "Prepare token shards from text (see docs/data.md)", [](CLI::App& app) {
      app.require_subcommand(1);
      auto args = std::make_shared<prepare_args>();
      CLI::App* prep = app.add_subcommand(
          "prepare", "Tokenize text files into llm.c shards DIR/train.bin and DIR/val.bin, or "
                     "JSONL instruction records into masked instruction shards");
      prep->add_option("--input", args->inputs,
                       "Text files, or folders searched recursively for *.txt (sorted); or "
                       "*.jsonl instruction records")
          ->required();
      prep->add_option("--out", args->out, "Output folder for train.bin and val.bin")->required();
      prep->add_option("--val-fraction", args->val_fraction,
                       "Share of the token chunks kept for validation, drawn evenly from the "
                       "whole stream")
          ->capture_default_str();
      prep->add_option("--tokenizer", args->tokenizer,
                       "A tokenizer.json, a folder holding one, or a folder with GPT-2's "
                       "encoder.json and vocab.bpe (default: the config's data.tokenizer, else "
                       "data/gpt2)");
      prep->add_option("--config", args->config,
                       "A run config: its data.tokenizer is the default tokenizer, and the "
                       "tokenizer must fit its model.vocab_size; JSONL input needs one (rows of "
                       "model.seq_length + 1 tokens, data.template, data.packing)");
      prep->add_option("--set", args->sets,
                       "Override a key of the --config config, e.g. --set data.packing=true "
                       "(repeatable)");
      auto* chunk = prep->add_option("--chunk-tokens", args->chunk_tokens,
                                     "Size of the chunks the train/validation split is made of")
                        ->capture_default_str()
                        ->check(CLI::PositiveNumber);
      return std::function<int()>([args, prep, chunk] {
        if (!prep->parsed()) return 1;
        args->chunk_tokens_given = chunk->count() > 0;
        return run_prepare(*args);
      });
    }}};

}  // namespace
}  // namespace troupe::cli
