#include "transport/tcp_wire.hpp"

namespace troupe::transport {

std::uint64_t token_hash(std::string_view token) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](std::string_view s) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 0x100000001b3ull;
    }
  };
  // The prefix keeps the hash of an empty token away from the FNV offset basis.
  mix("troupe job token:");
  mix(token);
  return h;
}

std::vector<char> frame_header::encode() const {
  wire_writer w;
  w.put(magic);
  w.put(version);
  w.put(static_cast<std::uint16_t>(type));
  w.put(token);
  w.put(src);
  w.put(dst);
  w.put(tg.step);
  w.put(tg.kind);
  w.put(tg.chunk);
  w.put(tg.mb);
  w.put(tg.part);
  w.put(static_cast<std::uint8_t>(dt));
  w.put(static_cast<std::uint8_t>(shape.size()));
  w.put(std::uint16_t{0});
  w.put(std::uint32_t{0});
  for (int i = 0; i < max_dims; ++i)
    w.put(i < static_cast<int>(shape.size()) ? shape[i] : std::int64_t{0});
  w.put(payload_bytes);
  return std::move(w.bytes());
}

std::string frame_header::decode(const char* bytes) {
  wire_reader r(bytes, size);
  auto m = r.get<std::uint32_t>();
  if (m != magic) return "bad magic (not a troupe tcp transport peer)";
  auto v = r.get<std::uint16_t>();
  if (v != version)
    return "protocol version " + std::to_string(v) + ", expected " + std::to_string(version);
  auto ty = r.get<std::uint16_t>();
  if (ty < 1 || ty > 3) return "unknown frame type " + std::to_string(ty);
  type = static_cast<frame_type>(ty);
  token = r.get<std::uint64_t>();
  src = r.get<std::int32_t>();
  dst = r.get<std::int32_t>();
  tg.step = r.get<std::int64_t>();
  tg.kind = r.get<std::uint32_t>();
  tg.chunk = r.get<std::int32_t>();
  tg.mb = r.get<std::int32_t>();
  tg.part = r.get<std::int32_t>();
  auto d = r.get<std::uint8_t>();
  if (d > static_cast<std::uint8_t>(core::dtype::i64)) return "unknown dtype " + std::to_string(d);
  dt = static_cast<core::dtype>(d);
  auto ndim = r.get<std::uint8_t>();
  if (ndim > max_dims) return std::to_string(ndim) + " dimensions (at most 8)";
  r.get<std::uint16_t>();
  r.get<std::uint32_t>();
  shape.assign(ndim, 0);
  std::uint64_t numel = 1;
  for (int i = 0; i < max_dims; ++i) {
    auto x = r.get<std::int64_t>();
    if (i >= ndim) continue;
    if (x < 0) return "negative dimension " + std::to_string(x);
    shape[i] = x;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(x), &numel))
      return "shape " + core::shape_string(shape) + " overflows";
  }
  payload_bytes = r.get<std::uint64_t>();
  if (type != frame_type::tensor) {
    if (payload_bytes != 0) return "a control frame with a payload";
    return {};
  }
  std::uint64_t expect = 0;
  if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(core::dtype_size(dt)), &expect))
    return "shape " + core::shape_string(shape) + " overflows";
  if (expect != payload_bytes)
    return "payload of " + std::to_string(payload_bytes) + " bytes for a " +
           core::shape_string(shape) + " " + core::dtype_name(dt) + " tensor (" +
           std::to_string(expect) + " bytes)";
  return {};
}

}  // namespace troupe::transport
