// Byte-level pieces shared by the tcp transport and the rendezvous: addresses, the job-token hash,
// and little-endian encoding. Kept free of Boost.Asio so that headers including it stay cheap.
//
// Everything on the wire is little-endian, tensor payloads included (raw host bytes, no
// per-element encoding), so every process of a job must run on a little-endian host.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.hpp"
#include "transport/transport.hpp"

namespace troupe::transport {

static_assert(std::endian::native == std::endian::little,
              "the tcp transport sends raw tensor bytes and assumes little-endian hosts");

/// A host name or address and a TCP port.
struct endpoint {
  std::string host;
  std::uint16_t port = 0;
  bool operator==(const endpoint&) const = default;
  /// "host:port".
  std::string to_string() const { return host + ":" + std::to_string(port); }
};

/// 64-bit FNV-1a of the job token (domain-separated). Peers compare hashes so that the token
/// itself never crosses the network; it keeps strangers and other jobs out, it is not a secret
/// that survives someone reading the traffic.
std::uint64_t token_hash(std::string_view token);

/// Appends little-endian fields to a byte buffer.
class wire_writer {
 public:
  template <class T>
  void put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    bytes_.insert(bytes_.end(), b, b + sizeof(T));
  }
  /// u32 length, then the bytes.
  void put_bytes(std::string_view s) {
    put(static_cast<std::uint32_t>(s.size()));
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  std::vector<char>& bytes() { return bytes_; }

 private:
  std::vector<char> bytes_;
};

/// Reads little-endian fields; a read past the end sets failed() and yields zeros/empties, so a
/// truncated or garbled body is detected once, after parsing, rather than at every field.
class wire_reader {
 public:
  wire_reader(const char* data, std::size_t size) : p_(data), end_(data + size) {}
  template <class T>
  T get() {
    T v{};
    if (static_cast<std::size_t>(end_ - p_) < sizeof(T)) {
      failed_ = true;
      p_ = end_;
      return v;
    }
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string get_bytes() {
    auto n = get<std::uint32_t>();
    if (static_cast<std::size_t>(end_ - p_) < n) {
      failed_ = true;
      p_ = end_;
      return {};
    }
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  bool failed() const { return failed_; }
  bool at_end() const { return p_ == end_; }

 private:
  const char* p_;
  const char* end_;
  bool failed_ = false;
};

/// What a tcp transport frame carries.
enum class frame_type : std::uint16_t {
  hello = 1,   // first frame on a connection: who is calling (src) and whom (dst)
  tensor = 2,  // a tensor under a tag; the payload bytes follow the header
  bye = 3,     // the sender closes its transport on purpose (not a crash)
};

/// The fixed 128-byte header in front of every tcp transport frame:
///   u32 magic "TRPT" | u16 version | u16 type | u64 token hash | i32 src | i32 dst |
///   i64 step | u32 kind | i32 chunk | i32 mb | i32 part | u8 dtype | u8 ndim | 6 bytes zero |
///   i64 dims[8] | u64 payload bytes
struct frame_header {
  static constexpr std::uint32_t magic = 0x54505254;  // "TRPT" in little-endian byte order
  static constexpr std::uint16_t version = 1;
  static constexpr std::size_t size = 128;
  static constexpr int max_dims = 8;

  frame_type type = frame_type::tensor;
  std::uint64_t token = 0;
  std::int32_t src = -1;
  std::int32_t dst = -1;
  tag tg;
  core::dtype dt = core::dtype::f32;
  core::shape_t shape;
  std::uint64_t payload_bytes = 0;

  /// The 128 header bytes. REQUIRES: shape.size() <= max_dims.
  std::vector<char> encode() const;
  /// Parses and checks the structure (magic, version, type, dtype, dims, payload size matching
  /// shape × dtype, no payload on hello/bye). Returns an empty string on success, else why not.
  /// REQUIRES: `bytes` points at `size` bytes.
  std::string decode(const char* bytes);
};

}  // namespace troupe::transport
