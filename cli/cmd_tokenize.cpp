// `troupe tokenize`: token ids of text files (or --text) with any tokenizer troupe reads
// (model/text_tokenizer.hpp), one JSON line per input: {"input", "ids", "round_trip"}, where
// round_trip says whether decoding the ids gives back the input's bytes. For checking a tokenizer
// against another implementation (tests/model/tokenizer_reference_test.mjs,
// bench/gpu/tokenizer_check.py) and for looking at how text is cut.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/files.hpp"
#include "model/text_tokenizer.hpp"

namespace troupe::cli {
namespace {

struct tokenize_args {
  std::string tokenizer = "data/gpt2";
  std::vector<std::string> files;
  std::vector<std::string> texts;
  std::string specials = "match";
  bool bos = false;
};

int run_tokenize(const tokenize_args& a) {
  auto tok = model::load_tokenizer(a.tokenizer);
  if (!tok) {
    print_error(tok.err().to_string());
    return 1;
  }
  if (a.files.empty() && a.texts.empty()) {
    print_error(core::error::make("nothing to tokenize", "pass text files, or --text STRING")
                    .to_string());
    return 2;
  }
  const auto mode =
      a.specials == "plain" ? model::specials_in_text::plain : model::specials_in_text::match;
  std::fprintf(stderr, "troupe tokenize: %s\n", (*tok)->describe().c_str());
  auto emit = [&](const std::string& name, const std::string& text) {
    std::vector<int> ids = a.bos ? (*tok)->encode_for_model(text, mode) : (*tok)->encode(text, mode);
    std::vector<int> body = ids;
    if (a.bos && (*tok)->add_bos() && !body.empty()) body.erase(body.begin());
    nlohmann::json line = {{"input", name},
                           {"ids", ids},
                           {"round_trip", (*tok)->decode(body) == text}};
    std::printf("%s\n", line.dump().c_str());
  };
  for (std::size_t i = 0; i < a.texts.size(); ++i) emit("--text " + std::to_string(i), a.texts[i]);
  for (const auto& f : a.files) {
    core::input_spec spec;
    spec.what = "text file";
    spec.max_bytes = std::uint64_t(1) << 31;
    spec.hint = "troupe tokenize takes UTF-8 text files";
    auto text = core::read_input(f, spec);
    if (!text) {
      print_error(text.err().to_string());
      return 1;
    }
    emit(f, text.value());
  }
  return 0;
}

const command_registrar registrar{command{
    "tokenize", "Print the token ids of text with a tokenizer (tokenizer.json or GPT-2 files)",
    [](CLI::App& app) {
      auto args = std::make_shared<tokenize_args>();
      app.add_option("files", args->files, "Text files to tokenize");
      app.add_option("--text", args->texts, "Text to tokenize (repeatable)");
      app.add_option("--tokenizer", args->tokenizer,
                     "A tokenizer.json, a folder holding one, or a folder with GPT-2's "
                     "encoder.json and vocab.bpe")
          ->capture_default_str();
      app.add_option("--specials", args->specials,
                     "Special tokens written in the text: 'match' makes them their ids, 'plain' "
                     "reads them as text")
          ->capture_default_str()
          ->check(CLI::IsMember({"match", "plain"}));
      app.add_flag("--bos", args->bos, "Put BOS first when the tokenizer's post-processor does");
      return std::function<int()>([args] { return run_tokenize(*args); });
    }}};

}  // namespace
}  // namespace troupe::cli
