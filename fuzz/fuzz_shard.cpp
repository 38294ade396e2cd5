// A token shard (llm.c's format, uint16 or uint32 tokens), opened and read end to end as the
// data loader does.
#include "fuzz/fuzz_input.hpp"
#include "model/shards.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto s = troupe::model::shard::open(troupe::fuzz::as_file(data, size, ".bin"));
  if (s.ok()) {
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < s.value().size(); ++i) sum += s.value().id(i);
    if (s.value().size() > 0 && sum == 0xffffffffffffffffull) __builtin_trap();
  }
  return 0;
}
