// The message hash (kernels/message_hash.hpp): the XXH64 core the CUDA kernel runs, compiled for
// the host here, against libxxhash; the CPU twin against the definition written out again below;
// and, with a GPU, the CUDA backend's message_hash_async against the CPU twin bit for bit (sizes
// around every level boundary, unaligned views, hashes queued behind the writes they must see).
#include <doctest/doctest.h>
#include <xxhash.h>

#include <cstring>
#include <vector>

#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "kernels/message_hash.hpp"
#include "kernels/select.hpp"
#include "tests/kernels/cuda_test_util.hpp"

namespace troupe::kernels {
namespace {

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> v(n);
  core::rng_stream r(core::stream_key(seed, 0x4a5));
  for (auto& b : v) b = static_cast<unsigned char>(r.below(256));
  return v;
}

/// The definition, level by level, with libxxhash only.
std::uint64_t reference_hash(std::vector<unsigned char> data) {
  std::uint64_t seed = 0;
  while (data.size() > 4096) {
    std::vector<unsigned char> next;
    for (std::size_t off = 0; off < data.size(); off += 4096) {
      const std::uint64_t d = XXH64(data.data() + off, std::min<std::size_t>(4096, data.size() - off), seed);
      for (int k = 0; k < 8; ++k) next.push_back(static_cast<unsigned char>(d >> (8 * k)));
    }
    seed = data.size();
    data.swap(next);
  }
  return XXH64(data.data(), data.size(), seed);
}

core::tensor host_bytes(const std::vector<unsigned char>& b) {
  // u16 elements; an odd byte count cannot be a tensor, so callers pass even sizes
  core::tensor t = core::tensor::zeros({static_cast<std::int64_t>(b.size() / 2)}, core::dtype::u16);
  if (!b.empty()) std::memcpy(t.raw(), b.data(), b.size());
  return t;
}

}  // namespace

TEST_CASE("message hash: the XXH64 core the GPU runs equals libxxhash on every tail length") {
  const auto data = random_bytes(9000 + 2, 1);  // n up to 8999 from offsets up to 2
  core::rng_stream r(core::stream_key(2, 3));
  for (std::size_t n : {0, 1, 3, 4, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100, 255, 256, 4095, 4096, 8999}) {
    for (int rep = 0; rep < 3; ++rep) {
      const std::uint64_t seed = rep == 0 ? 0 : r.next_u64();
      const std::size_t at = rep;  // unaligned starts too
      INFO("n = " << n << ", seed = " << seed << ", offset " << at);
      CHECK(xxh::xxh64(xxh::byte_reader{data.data() + at}, n, seed) == XXH64(data.data() + at, n, seed));
    }
  }
}

TEST_CASE("message hash: the CPU twin follows the definition at every level boundary") {
  for (std::size_t n : {0ul, 1ul, 32ul, 4095ul, 4096ul, 4097ul, 8192ul, 100000ul, 4096ul * 512,
                        4096ul * 512 + 1, 4096ul * 512 * 3 + 17}) {
    INFO("n = " << n);
    const auto data = random_bytes(n, n);
    const std::uint64_t h = message_hash(data.data(), n);
    CHECK(h == reference_hash(data));
    if (n <= 4096) CHECK(h == XXH64(data.data(), n, 0));  // small tensors: the plain XXH64
    if (n > 0) {
      auto changed = data;
      changed[n / 2] ^= 1;  // one bit anywhere changes the hash
      CHECK(message_hash(changed.data(), n) != h);
    }
  }
}

TEST_CASE("cuda message hash: equal to the CPU twin bit for bit, aligned or not, after queued writes") {
  if (!cuda_test::gpu_or_skip()) return;
  auto be = make_backend("cuda");
  // Sizes around each level boundary (4096 bytes; 4096 * 512 bytes, where the digests outgrow one
  // block), and one of 96 MiB.
  for (std::size_t n : {0ul, 2ul, 30ul, 32ul, 4094ul, 4096ul, 4098ul, 65536ul, 4096ul * 512,
                        4096ul * 512 + 2, 4096ul * 512 * 5 + 6, 96ul << 20}) {
    INFO("bytes = " << n);
    const auto data = random_bytes(n, 100 + n);
    const core::tensor host = host_bytes(data);
    const core::tensor dev = be->from_host(host);
    CHECK(be->message_hash_async(dev)->get() == message_hash(data.data(), n));
    if (n >= 8) {
      // Views that start 2 and 4 bytes into the buffer (the kernel's unaligned path).
      for (std::int64_t skip : {1, 2}) {
        const std::int64_t count = host.numel() - skip;
        const core::tensor view = dev.slice(skip, {count});
        CHECK(be->message_hash_async(view)->get() ==
              message_hash(data.data() + 2 * skip, static_cast<std::size_t>(count) * 2));
      }
    }
  }
  // Many hashes in flight at once (more than one block of result slots), each queued right after
  // the copy that writes its tensor, read in reverse order.
  const auto data = random_bytes(1 << 20, 7);
  const core::tensor src = be->from_host(host_bytes(data));
  std::vector<std::shared_ptr<pending_value>> pending;
  std::vector<std::uint64_t> want;
  std::vector<core::tensor> keep;
  for (int i = 0; i < 300; ++i) {
    const std::int64_t count = 1000 + 997 * i;
    core::tensor dst = be->empty({count}, core::dtype::u16);
    core::tensor part = src.slice(i, {count});
    be->copy(part, dst);
    pending.push_back(be->message_hash_async(dst));
    want.push_back(message_hash(data.data() + 2 * i, static_cast<std::size_t>(count) * 2));
    keep.push_back(dst);
  }
  for (int i = 299; i >= 0; --i) {
    INFO("hash " << i);
    CHECK(pending[static_cast<std::size_t>(i)]->get() == want[static_cast<std::size_t>(i)]);
  }
  // The CPU backend gives the same values.
  auto cpu = make_backend("cpu");
  CHECK(cpu->message_hash_async(host_bytes(data))->get() == message_hash(data.data(), data.size()));
}

}  // namespace troupe::kernels
