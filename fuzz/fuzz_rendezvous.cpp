// The bytes a rendezvous peer sends (transport/rendezvous.cpp): frames of a 12-byte header and a
// body, the body read by every decoder (a server reads registrations, a worker tables and
// reasons). A body that decodes must encode back to the same bytes: each decoder accepts only
// what its encoder writes.
#include <algorithm>

#include "fuzz/fuzz_input.hpp"
#include "transport/rendezvous.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace tr = troupe::transport;
  using frame = tr::rendezvous_frame;
  const char* p = reinterpret_cast<const char*>(data);
  std::size_t left = size;
  while (left >= frame::header_size) {
    const char* start = p;
    std::uint16_t type = 0;
    std::uint32_t length = 0;
    // The server's limit (rendezvous_server_options::max_frame_bytes).
    if (!frame::decode_head(p, 1u << 20, type, length).empty()) return 0;
    p += frame::header_size;
    left -= frame::header_size;
    const std::size_t n = std::min<std::size_t>(length, left);
    const std::vector<char> body(p, p + n);
    p += n;
    left -= n;
    if (n == length &&
        frame::encode(static_cast<frame::type>(type), body) != std::vector<char>(start, p))
      __builtin_trap();
    if (auto reg = tr::decode_registration(body.data(), body.size()))
      if (tr::encode_registration(*reg) != body) __builtin_trap();
    if (auto table = tr::decode_table(body.data(), body.size())) {
      if (tr::encode_table(table->first, table->second) != body) __builtin_trap();
      (void)table->second.data_endpoints();
    }
    (void)tr::decode_reason(body.data(), body.size());
  }
  return 0;
}
