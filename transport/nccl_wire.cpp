#include "transport/nccl_wire.hpp"

#include <bit>
#include <cstring>
#include <sstream>

namespace troupe::transport {
namespace {

static_assert(std::endian::native == std::endian::little,
              "control records are raw little-endian bytes, like the tcp frames that carry them");

constexpr std::size_t off_magic = 0, off_version = 4, off_kind = 6, off_dtype = 7, off_ndim = 8,
                      off_seq = 16, off_dims = 24, off_payload = 88;
constexpr int last_dtype = static_cast<int>(core::dtype::i64);

template <class T>
void put(char* base, std::size_t off, T v) {
  std::memcpy(base + off, &v, sizeof(T));
}
template <class T>
T get(const char* base, std::size_t off) {
  T v{};
  std::memcpy(&v, base + off, sizeof(T));
  return v;
}

// A zeroed frame of header + `extra` bytes, viewed as uint16 (every dtype's size is even, so the
// bytes always fill whole elements).
tensor frame_of(const control_record& r, std::uint64_t payload, std::size_t extra) {
  TROUPE_CHECK(
      static_cast<int>(r.shape.size()) <= control_record::max_dims,
      "nccl transport: tensors of at most 8 dimensions, got " + core::shape_string(r.shape));
  tensor f = tensor::zeros({static_cast<std::int64_t>((control_record::header_size + extra) / 2)},
                           core::dtype::u16);
  char* b = static_cast<char*>(f.raw());
  put(b, off_magic, control_record::magic);
  put(b, off_version, control_record::version);
  put(b, off_kind, static_cast<std::uint8_t>(r.kind));
  put(b, off_dtype, static_cast<std::uint8_t>(r.dt));
  put(b, off_ndim, static_cast<std::uint8_t>(r.shape.size()));
  put(b, off_seq, r.seq);
  for (std::size_t d = 0; d < r.shape.size(); ++d) put(b, off_dims + 8 * d, r.shape[d]);
  put(b, off_payload, payload);
  return f;
}

}  // namespace

std::uint64_t control_record::payload_bytes() const {
  return static_cast<std::uint64_t>(core::numel_of(shape)) * core::dtype_size(dt);
}

tensor control_record::encode_device(const tensor& t, std::uint64_t seq) {
  control_record r{control_kind::device, t.type(), t.shape(), seq};
  return frame_of(r, t.bytes(), 0);
}

tensor control_record::encode_host(const tensor& t) {
  control_record r{control_kind::host, t.type(), t.shape(), 0};
  tensor f = frame_of(r, t.bytes(), t.bytes());
  if (t.bytes()) std::memcpy(static_cast<char*>(f.raw()) + header_size, t.raw(), t.bytes());
  return f;
}

std::string control_record::decode(const tensor& frame, tensor* payload) {
  if (!frame.dev().is_cpu()) return "a control record must be a host tensor";
  if (frame.bytes() < header_size)
    return "a control record of " + std::to_string(frame.bytes()) + " bytes, shorter than its " +
           std::to_string(header_size) + "-byte header";
  const char* b = static_cast<const char*>(frame.raw());
  if (get<std::uint32_t>(b, off_magic) != magic) return "bad magic (not a control record)";
  if (auto v = get<std::uint16_t>(b, off_version); v != version)
    return "control record version " + std::to_string(v) + ", expected " + std::to_string(version);
  auto k = get<std::uint8_t>(b, off_kind);
  if (k != static_cast<std::uint8_t>(control_kind::device) &&
      k != static_cast<std::uint8_t>(control_kind::host))
    return "unknown transfer kind " + std::to_string(k);
  auto dt = get<std::uint8_t>(b, off_dtype);
  if (dt > last_dtype) return "unknown dtype " + std::to_string(dt);
  auto nd = get<std::uint8_t>(b, off_ndim);
  if (nd > max_dims) return std::to_string(nd) + " dimensions (at most 8)";
  core::shape_t sh(nd);
  for (int d = 0; d < nd; ++d) {
    sh[d] = get<std::int64_t>(b, off_dims + 8 * d);
    if (sh[d] < 0) return "negative dimension " + std::to_string(sh[d]);
  }
  kind = static_cast<control_kind>(k);
  this->dt = static_cast<core::dtype>(dt);
  shape = std::move(sh);
  seq = get<std::uint64_t>(b, off_seq);
  auto announced = get<std::uint64_t>(b, off_payload);
  if (announced != payload_bytes())
    return "payload of " + std::to_string(announced) + " bytes for a " + core::shape_string(shape) +
           " " + core::dtype_name(this->dt) + " tensor";
  std::uint64_t inline_bytes = frame.bytes() - header_size;
  std::uint64_t expected = kind == control_kind::host ? announced : 0;
  if (inline_bytes != expected)
    return std::to_string(inline_bytes) + " bytes after the header, expected " +
           std::to_string(expected);
  if (kind == control_kind::host && payload)
    *payload = tensor::over(frame.store(), frame.byte_offset() + header_size, shape, this->dt);
  return {};
}

std::string nccl_id_word(const nccl_id& id) {
  static const char* digits = "0123456789abcdef";
  std::string s = "nccl_id=";
  for (char c : id) {
    auto u = static_cast<unsigned char>(c);
    s += digits[u >> 4];
    s += digits[u & 15];
  }
  return s;
}

core::result<nccl_id> nccl_id_from_blob(const std::string& blob) {
  const std::string key = "nccl_id=";
  std::istringstream words(blob);
  std::string w;
  while (words >> w) {
    if (w.rfind(key, 0) != 0) continue;
    std::string hex = w.substr(key.size());
    if (hex.size() != 2 * nccl_id_bytes)
      return core::error::make("the nccl_id in rank 0's rendezvous blob has " +
                               std::to_string(hex.size()) + " hex digits, expected " +
                               std::to_string(2 * nccl_id_bytes));
    nccl_id id{};
    auto val = [](char c) {
      return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    };
    for (std::size_t i = 0; i < nccl_id_bytes; ++i) {
      int hi = val(hex[2 * i]), lo = val(hex[2 * i + 1]);
      if (hi < 0 || lo < 0)
        return core::error::make("the nccl_id in rank 0's rendezvous blob is not lowercase hex");
      id[i] = static_cast<char>(hi << 4 | lo);
    }
    return id;
  }
  return core::error::make("rank 0's rendezvous blob has no nccl_id word (blob: \"" + blob + "\")",
                           "on the job's first rank (node 0, local rank 0), register with the "
                           "blob from make_nccl_blob()");
}

}  // namespace troupe::transport
