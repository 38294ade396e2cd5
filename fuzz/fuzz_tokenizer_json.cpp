// A tokenizer.json file, loaded as `data.tokenizer` loads it, then used: a fixed text with
// special tokens and the input itself encoded, and the ids decoded back.
#include "fuzz/fuzz_input.hpp"
#include "model/text_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::model;
  auto t = load_tokenizer_json(troupe::fuzz::as_file(data, size, ".json"));
  if (!t.ok()) return 0;
  const text_tokenizer& tok = *t.value();
  for (std::string_view text : {std::string_view("Hello, world! <|endoftext|> 123 \xc3\xa9\xff"),
                                troupe::fuzz::as_text(data, size > 256 ? 256 : size)}) {
    const std::vector<int> ids = tok.encode_for_model(text);
    for (int id : ids)
      if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
    (void)tok.decode(ids);
  }
  return 0;
}
