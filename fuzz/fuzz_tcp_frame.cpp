// The bytes a tcp transport peer sends (transport/tcp.cpp): frames of a 128-byte header and the
// payload it announces, decoded one after the other as a receiving rank does, the payload read
// into a tensor allocated from the header's shape and dtype. A header that decodes must encode to
// a header that decodes to the same fields, and must announce exactly its tensor's bytes.
#include <cstring>

#include "fuzz/fuzz_input.hpp"
#include "transport/tcp_wire.hpp"

namespace {

using troupe::transport::frame_header;
using troupe::transport::frame_type;

bool same(const frame_header& a, const frame_header& b) {
  return a.type == b.type && a.token == b.token && a.src == b.src && a.dst == b.dst &&
         a.tg == b.tg && a.dt == b.dt && a.shape == b.shape && a.payload_bytes == b.payload_bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The receiver refuses larger payloads (tcp_options::max_frame_bytes); a small limit here keeps
  // the allocation of each input's tensors small.
  constexpr std::uint64_t max_payload = 1 << 20;
  const char* p = reinterpret_cast<const char*>(data);
  std::size_t left = size;
  while (left >= frame_header::size) {
    frame_header h;
    if (!h.decode(p).empty()) return 0;
    p += frame_header::size;
    left -= frame_header::size;
    frame_header again;
    const std::vector<char> bytes = h.encode();
    if (bytes.size() != frame_header::size || !again.decode(bytes.data()).empty() || !same(h, again))
      __builtin_trap();
    if (h.type != frame_type::tensor) {
      if (h.payload_bytes != 0) __builtin_trap();
      continue;
    }
    if (h.payload_bytes > max_payload) return 0;
    troupe::core::tensor t = troupe::core::tensor::zeros(h.shape, h.dt);
    if (t.bytes() != h.payload_bytes) __builtin_trap();
    const std::size_t n = left < t.bytes() ? left : t.bytes();
    if (n) std::memcpy(t.raw(), p, n);
    p += n;
    left -= n;
  }
  return 0;
}
