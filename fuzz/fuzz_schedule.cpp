// A schedule file (text or CSV, chosen by the first byte), parsed and validated as
// `troupe schedule check` does, and printed back.
#include "fuzz/fuzz_input.hpp"
#include "schedules/schedule_file.hpp"
#include "schedules/validate.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool csv = data[0] & 1;
  auto s = troupe::schedules::parse_schedule_text(troupe::fuzz::as_text(data + 1, size - 1),
                                                  "fuzz", csv);
  if (s.ok()) {
    (void)troupe::schedules::validate(s.value());
    (void)troupe::schedules::format_schedule_text(s.value());
  }
  return 0;
}
