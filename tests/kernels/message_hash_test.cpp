// The message hash (kernels/message_hash.hpp): the XXH3-64 core the CUDA kernel runs, compiled for
// the host here, against libxxhash on every length of every path; the CPU twin against the
// definition written out again below (both leaf hashes: XXH3 for the logs written now, XXH64 for
// logs of format 2); and, with a GPU, the CUDA backend's message_hash_async against the CPU twin
// bit for bit (sizes around every level boundary, odd lengths, unaligned views, hashes queued
// behind the writes they must see).
#include <doctest/doctest.h>
#include <xxhash.h>

#include <cstring>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "kernels/message_hash.hpp"
#include "kernels/select.hpp"
#include "tests/kernels/cuda_test_util.hpp"
#include "tests/kernels/norm_blocks_fixture.hpp"

namespace troupe::kernels {
namespace {

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> v(n);
  core::rng_stream r(core::stream_key(seed, 0x4a5));
  for (auto& b : v) b = static_cast<unsigned char>(r.below(256));
  return v;
}

/// The definition, level by level, with libxxhash only.
std::uint64_t reference_hash(std::vector<unsigned char> data, message_hash_def def) {
  auto leaf = [def](const unsigned char* p, std::size_t n, std::uint64_t seed) {
    return def == message_hash_def::xxh64 ? XXH64(p, n, seed) : XXH3_64bits_withSeed(p, n, seed);
  };
  std::uint64_t seed = 0;
  while (data.size() > 4096) {
    std::vector<unsigned char> next;
    for (std::size_t off = 0; off < data.size(); off += 4096) {
      const std::uint64_t d = leaf(data.data() + off, std::min<std::size_t>(4096, data.size() - off), seed);
      for (int k = 0; k < 8; ++k) next.push_back(static_cast<unsigned char>(d >> (8 * k)));
    }
    seed = data.size();
    data.swap(next);
  }
  return leaf(data.data(), data.size(), seed);
}

/// The current definition as the CUDA kernel computes it (its XXH3 core over a byte reader, level
/// by level), run on the host.
std::uint64_t kernel_code_hash(const unsigned char* p, std::size_t n) {
  std::uint64_t seed = 0;
  std::vector<std::uint64_t> level;
  while (n > 4096) {
    std::vector<std::uint64_t> next;
    for (std::size_t off = 0; off < n; off += 4096)
      next.push_back(xxh3::xxh3_64(xxh3::byte_reader{p + off}, std::min<std::size_t>(4096, n - off),
                                   seed, xxh3::default_secret));
    seed = n;
    level.swap(next);
    p = reinterpret_cast<const unsigned char*>(level.data());
    n = level.size() * 8;
  }
  return xxh3::xxh3_64(xxh3::byte_reader{p}, n, seed, xxh3::default_secret);
}

core::tensor host_bytes(const std::vector<unsigned char>& b) {
  // u16 elements; an odd byte count cannot be a tensor, so callers pass even sizes
  core::tensor t = core::tensor::zeros({static_cast<std::int64_t>(b.size() / 2)}, core::dtype::u16);
  if (!b.empty()) std::memcpy(t.raw(), b.data(), b.size());
  return t;
}

}  // namespace

TEST_CASE("message hash: the XXH3 core the GPU runs equals libxxhash on every length 0..5000") {
  // Every path of XXH3-64: 0, 1-3, 4-8, 9-16, 17-128, 129-240 bytes and long inputs (one to four
  // 1024-byte blocks and a partial one); seed 0 (the default secret), small and large seeds (a
  // long input derives its secret from the seed), from aligned and unaligned starts.
  const auto data = random_bytes(5000 + 3, 1);
  core::rng_stream r(core::stream_key(2, 3));
  const std::uint64_t seeds[] = {0, 1, 4096 * 3 + 5, r.next_u64(), ~0ull};
  int equal = 0, compared = 0;
  std::string first_difference;
  for (std::size_t n = 0; n <= 5000; ++n) {
    for (int k = 0; k < 5; ++k) {
      const std::size_t at = (n + static_cast<std::size_t>(k)) % 4;  // starts 0..3 bytes in
      const std::uint64_t seed = seeds[k];
      const std::uint64_t want = XXH3_64bits_withSeed(data.data() + at, n, seed);
      const std::uint64_t got = xxh3::xxh3_64(xxh3::byte_reader{data.data() + at}, n, seed,
                                              xxh3::default_secret);
      ++compared;
      if (got == want)
        ++equal;
      else if (first_difference.empty())
        first_difference = "n = " + std::to_string(n) + ", seed = " + std::to_string(seed) +
                           ", offset " + std::to_string(at);
    }
  }
  INFO("first difference: " << first_difference);
  CHECK(compared == 5001 * 5);
  CHECK(equal == compared);
  CHECK(xxh3::xxh3_64(xxh3::byte_reader{data.data()}, 0, 0, xxh3::default_secret) == XXH3_64bits(data.data(), 0));
}

TEST_CASE("message hash: the CPU twin follows the definition at every level boundary") {
  for (std::size_t n : {0ul, 1ul, 32ul, 241ul, 4095ul, 4096ul, 4097ul, 8192ul, 100000ul, 4096ul * 512,
                        4096ul * 512 + 1, 4096ul * 512 * 3 + 17}) {
    INFO("n = " << n);
    const auto data = random_bytes(n, n);
    const std::uint64_t h = message_hash(data.data(), n);
    CHECK(h == reference_hash(data, message_hash_def::xxh3));
    CHECK(h == kernel_code_hash(data.data(), n));
    if (n <= 4096) CHECK(h == XXH3_64bits(data.data(), n));  // small tensors: the plain XXH3
    const std::uint64_t old = message_hash(data.data(), n, message_hash_def::xxh64);
    CHECK(old == reference_hash(data, message_hash_def::xxh64));
    if (n <= 4096) CHECK(old == XXH64(data.data(), n, 0));
    CHECK(old != h);
    if (n > 0) {
      auto changed = data;
      changed[n / 2] ^= 1;  // one bit anywhere changes the hash
      CHECK(message_hash(changed.data(), n) != h);
      CHECK(message_hash(changed.data(), n, message_hash_def::xxh64) != old);
    }
  }
}

TEST_CASE("message hash: finished from its first level, equal to the whole hash") {
  for (std::size_t n : {0ul, 1ul, 4095ul, 4096ul, 4097ul, 8192ul, 4096ul * 512, 4096ul * 512 + 1,
                        4096ul * 512 * 3 + 17}) {
    INFO("n = " << n);
    const auto data = random_bytes(n, 200 + n);
    std::vector<std::uint64_t> blocks(message_hash_blocks_of(n));
    CHECK(blocks.size() == (n + 4095) / 4096);
    message_hash_blocks(data.data(), n, blocks.data());
    for (std::size_t i = 0; i < blocks.size(); ++i)
      CHECK(blocks[i] == XXH3_64bits(data.data() + 4096 * i, std::min<std::size_t>(4096, n - 4096 * i)));
    CHECK(message_hash_of_blocks(blocks.data(), n) == message_hash(data.data(), n));
  }
}

TEST_CASE("message_hash_sumsq_blocks on the CPU: the hash's first level and each tensor's norm "
          "blocks in place, bit for bit") {
  auto cpu = make_backend("cpu");
  for (std::int64_t tail : {0, 300}) {
    INFO("padding after the last tensor: " << tail);
    const testing::norm_layout l = testing::assorted_layout(23, tail);
    const tensor x = cuda_test::random_host({l.numel}, 210);
    const tensor counts = testing::counts_of(l);
    const std::int64_t nb = counts.numel();
    tensor blocks = tensor::zeros({nb}, core::dtype::i64);
    tensor sums = tensor::zeros({nb}, core::dtype::f64);
    for (std::int64_t b = 0; b < nb; ++b) sums.data<double>()[b] = -1.0;  // each must be written
    cpu->message_hash_sumsq_blocks(x, counts, blocks, sums);
    std::vector<std::uint64_t> want(static_cast<std::size_t>(nb));
    message_hash_blocks(x.raw(), x.bytes(), want.data());
    for (std::int64_t b = 0; b < nb; ++b) CHECK(blocks.data<std::uint64_t>()[b] == want[b]);
    // Each counted tensor's own sumsq_blocks, at its blocks; 0 wherever nothing is counted.
    std::vector<std::int64_t> first;
    const auto views = testing::counted_views(l, x, &first);
    std::vector<double> expect(static_cast<std::size_t>(nb), 0.0);
    for (std::size_t k = 0; k < views.size(); ++k) {
      const std::int64_t n = (views[k].numel() + norm_block - 1) / norm_block;
      tensor own = tensor::zeros({n}, core::dtype::f64);
      cpu->sumsq_blocks(views[k], own);
      for (std::int64_t i = 0; i < n; ++i) expect[first[k] + i] = own.data<double>()[i];
    }
    std::int64_t wrong = 0, nonzero = 0;
    for (std::int64_t b = 0; b < nb; ++b) {
      wrong += std::memcmp(&sums.data<double>()[b], &expect[b], sizeof(double)) != 0;
      nonzero += sums.data<double>()[b] != 0.0;
    }
    CHECK(wrong == 0);
    CHECK(nonzero > nb / 2);
  }
  // A count larger than its block (or than what is left of the buffer) is refused by name.
  const tensor x = cuda_test::random_host({1500}, 211);
  tensor counts = tensor::zeros({2}, core::dtype::i32);
  counts.data<std::int32_t>()[1] = 477;
  tensor blocks = tensor::zeros({2}, core::dtype::i64), sums = tensor::zeros({2}, core::dtype::f64);
  CHECK_THROWS_WITH(cpu->message_hash_sumsq_blocks(x, counts, blocks, sums),
                    doctest::Contains("counts[1] is 477, outside [0, 476]"));
}

TEST_CASE("message hash: the CPU twin leaves no wide vector state in use behind it") {
  // libxxhash's AVX2 / AVX-512 code returns without vzeroupper; left so, every legacy-SSE
  // instruction after it (glibc's exp among them) pays a transition penalty. XGETBV(1) tells which
  // register states are in use: bit 2 the upper halves of ymm0-15, bit 6 those of zmm0-15.
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(0xD, 1, &a, &b, &c, &d) || !(a & 4u)) {
    MESSAGE("XGETBV(1) is not available: nothing to check");
    return;
  }
  auto in_use = [] {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
    return lo;
  };
  std::vector<unsigned char> data(64 * 1024 + 123);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 31 + 7);
  for (std::size_t n : {std::size_t{100}, std::size_t{4096}, data.size()}) {
    const std::uint64_t h = message_hash(data.data(), n);
    const unsigned state = in_use();
    CHECK(h != 0);
    CHECK_MESSAGE((state & (1u << 2)) == 0, "ymm upper halves in use after hashing " << n << " bytes");
    CHECK_MESSAGE((state & (1u << 6)) == 0, "zmm upper halves in use after hashing " << n << " bytes");
  }
#else
  MESSAGE("not an x86-64 build: nothing to check");
#endif
}

TEST_CASE("cuda message hash: equal to the CPU twin bit for bit, aligned or not, after queued writes") {
  if (!cuda_test::gpu_or_skip()) return;
  auto be = make_backend("cuda");
  // Sizes around each level boundary (4096 bytes; 4096 * 512 bytes, where the digests outgrow one
  // block), one of 96 MiB, and lengths whose last block ends in each of XXH3's paths (2, 6, 10,
  // 18, 130, 242 and 1026 bytes past a full block: tails not a multiple of 8 or 16).
  for (std::size_t n : {0ul, 2ul, 6ul, 10ul, 14ul, 30ul, 32ul, 34ul, 130ul, 238ul, 242ul, 1026ul,
                        4094ul, 4096ul, 4098ul, 4096ul + 6, 4096ul + 18, 4096ul * 3 + 130,
                        4096ul * 7 + 242, 4096ul * 2 + 1026, 65536ul, 4096ul * 512,
                        4096ul * 512 + 2, 4096ul * 512 * 5 + 6, (96ul << 20) + 10}) {
    INFO("bytes = " << n);
    const auto data = random_bytes(n, 100 + n);
    const core::tensor host = host_bytes(data);
    const core::tensor dev = be->from_host(host);
    CHECK(be->message_hash_async(dev)->get() == message_hash(data.data(), n));
    if (n >= 16) {
      // Views that start 2, 4, 6, 8 and 14 bytes into the buffer (the kernel's unaligned reads).
      for (std::int64_t skip : {1, 2, 3, 4, 7}) {
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
