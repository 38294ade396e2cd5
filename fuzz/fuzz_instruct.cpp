// One line of instruction data (JSONL: prompt/response or chat), parsed and rendered in both
// templates as `troupe data prepare --instructions` does.
#include "fuzz/fuzz_input.hpp"
#include "model/instruct.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::model;
  const parsed_record r = parse_record(troupe::fuzz::as_text(data, size));
  if (r.ok())
    for (chat_template t : {chat_template::plain, chat_template::llama3}) (void)render(t, r.chat);
  return 0;
}
