// A TOML config, as `troupe config check` reads one: parse, validate, derive, print back.
#include "core/config.hpp"
#include "fuzz/fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto c = troupe::core::parse_config(std::string(troupe::fuzz::as_text(data, size)), "fuzz.toml");
  if (c.ok()) {
    (void)troupe::core::derive(c.value());
    // What a run directory gets must read back as the same config.
    auto again = troupe::core::parse_config(troupe::core::to_toml(c.value()), "again.toml");
    if (!again.ok() || !(again.value() == c.value())) __builtin_trap();
  }
  return 0;
}
