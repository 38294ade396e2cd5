// GPT-2's tokenizer on arbitrary bytes, as `troupe data prepare` and `troupe generate` run it: the
// vocabulary of data/gpt2 (scripts/setup.sh; TROUPE_GPT2_DIR names another folder) through both
// readers, encoder.json + vocab.bpe (model/tokenizer.hpp) and its tokenizer.json
// (model/tokenizer_json.cpp). For every input the ids are in range, decode(encode(x)) gives x back
// (x with ill-formed UTF-8 replaced by U+FFFD), and both readers give the same ids and bytes.
#include "fuzz/fuzz_input.hpp"
#include "model/text_tokenizer.hpp"
#include "model/tokenizer.hpp"

namespace {

using troupe::model::text_tokenizer;
using troupe::model::tokenizer;

struct vocabularies {
  tokenizer files;
  std::unique_ptr<text_tokenizer> json;
};

vocabularies load() {
  const char* env = std::getenv("TROUPE_GPT2_DIR");
  const std::string dir = env && *env ? env : tokenizer::default_dir;
  auto files = tokenizer::load(dir);
  auto json = troupe::model::load_tokenizer_json(dir + "/tokenizer.json");
  if (!files.ok() || !json.ok()) {
    std::fprintf(stderr, "fuzz_tokenizer: %s\n",
                 (!files.ok() ? files.err() : json.err()).to_string().c_str());
    std::abort();
  }
  return {std::move(files.value()), std::move(json.value())};
}

const vocabularies* vocab = nullptr;

}  // namespace

// Loading both readers' vocabularies takes seconds under AddressSanitizer: done once, before
// libFuzzer starts timing inputs.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static const vocabularies v = load();
  vocab = &v;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const vocabularies& v = *vocab;
  const std::string_view x = troupe::fuzz::as_text(data, size);
  std::size_t replaced = 0;
  const std::string valid = tokenizer::valid_utf8(x, &replaced);
  if ((replaced == 0) != (valid == x) || tokenizer::valid_utf8(valid) != valid) __builtin_trap();

  const std::vector<int> ids = v.files.encode(x);
  for (int id : ids)
    if (id < 0 || id >= v.files.vocab_size()) __builtin_trap();
  if (v.files.decode(ids) != valid) __builtin_trap();

  const std::vector<int> json_ids = v.json->encode(x, troupe::model::specials_in_text::plain);
  if (json_ids != ids || v.json->decode(json_ids) != valid) __builtin_trap();
  return 0;
}
