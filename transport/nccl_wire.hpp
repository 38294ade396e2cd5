// The byte formats of the nccl transport (docs/networking.md, "nccl transport"): the control record
// that announces every transfer on the control channel, and the NCCL unique id in the rendezvous
// blob. Plain C++ without CUDA or NCCL, so the CPU build compiles and tests them.
//
// NCCL matches sends and receives by order, not by tag, and the actor runtime takes tensors in no
// fixed order. So a sender announces each device tensor with a control record (tag, dtype, shape,
// and a per-(sender, receiver) sequence number) on the tcp transport between the same ranks, under
// the transfer's own tag; the receiver posts its ncclRecv calls in sequence order, whatever order
// the records arrive or the tensors are asked for in. Host tensors travel inside their record.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace troupe::transport {

using core::tensor;

/// How a transfer's bytes travel.
enum class control_kind : std::uint8_t {
  device = 1,  // ncclSend/ncclRecv on the pair's communicator, in sequence order
  host = 2,    // inside the control record, after its header
};

/// One transfer's metadata. On the wire it is a host uint16 tensor (a tcp frame) holding a
/// 128-byte header, then for host transfers the tensor's bytes:
///   u32 magic "TRNC" | u16 version | u8 kind | u8 dtype | u8 ndim | 7 bytes zero | u64 seq |
///   i64 dims[8] | u64 payload bytes | 32 bytes zero
struct control_record {
  static constexpr std::uint32_t magic = 0x434e5254;  // "TRNC" in little-endian byte order
  static constexpr std::uint16_t version = 1;
  static constexpr std::size_t header_size = 128;
  static constexpr int max_dims = 8;

  control_kind kind = control_kind::device;
  core::dtype dt = core::dtype::f32;
  core::shape_t shape;
  /// Device transfers from this sender to this receiver before this one (0 for host transfers).
  std::uint64_t seq = 0;

  /// Bytes of the tensor the record describes.
  std::uint64_t payload_bytes() const;

  /// The record announcing device tensor `t` as transfer `seq`. REQUIRES: t.rank() <= max_dims.
  static tensor encode_device(const tensor& t, std::uint64_t seq);
  /// The record carrying host tensor `t` (its bytes are copied in). REQUIRES: t.rank() <= max_dims.
  static tensor encode_host(const tensor& t);
  /// Parses a received record and checks it (magic, version, kind, dtype, dims, sizes). Returns
  /// why it is malformed, or an empty string; for a host record `*payload` becomes a view of the
  /// tensor inside `frame` (no copy).
  std::string decode(const tensor& frame, tensor* payload);
};

/// Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
inline constexpr std::size_t nccl_id_bytes = 128;
using nccl_id = std::array<char, nccl_id_bytes>;

/// "nccl_id=<256 lowercase hex digits>": the id as a word of a rendezvous blob. Blobs are
/// space-separated key=value words, so other layers may add their own.
std::string nccl_id_word(const nccl_id& id);
/// The id in the nccl_id word of `blob` (rank 0's). Fails saying what is missing or malformed.
core::result<nccl_id> nccl_id_from_blob(const std::string& blob);

}  // namespace troupe::transport
