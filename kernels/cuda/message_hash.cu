// message_hash: the message logs' hash of a tensor (kernels/message_hash.hpp has the definition:
// XXH3-64 over 4 KiB blocks, level by level), computed on the GPU so that recording needs no copy
// of the tensor to the host. A level of n bytes gives n / 512 bytes of digests for the next, so a
// 500 MB gradient takes three launches (122,000 blocks, 239, then one). Where a level starts
// 16-byte aligned, four lanes hash each full block together (hash_blocks_kernel), so that a warp's
// loads cover whole 64-byte stripes; elsewhere one thread hashes one block with the header's XXH3
// code. The last launch writes the hash into page-locked host memory; an event after it tells the
// host when to read it.
#include <mutex>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/cuda_handoff.hpp"
#include "kernels/message_hash.hpp"

namespace troupe::kernels::cuda {

namespace {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

/// XXH3's default secret, read by every thread of a warp at the same offsets (a broadcast).
__constant__ xxh3::secret c_secret = xxh3::default_secret;

/// Little-endian words at any byte address, from the aligned words that hold them: each holds at
/// least one byte asked for, so no read leaves the (aligned) allocation.
__device__ __forceinline__ std::uint64_t load_u64(const unsigned char* a) {
  const unsigned s = static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(a) & 7);
  const auto* w = reinterpret_cast<const std::uint64_t*>(a - s);
  if (s == 0) return __ldg(w);
  return (__ldg(w) >> (8 * s)) | (__ldg(w + 1) << (64 - 8 * s));
}
__device__ __forceinline__ std::uint32_t load_u32(const unsigned char* a) {
  const unsigned s = static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(a) & 3);
  const auto* w = reinterpret_cast<const std::uint32_t*>(a - s);
  if (s == 0) return __ldg(w);
  return (__ldg(w) >> (8 * s)) | (__ldg(w + 1) << (32 - 8 * s));
}

/// A reader of bytes that start at any address: whole words where they are aligned.
struct word_reader {
  const unsigned char* p;
  __device__ __forceinline__ std::uint64_t u64(std::uint64_t off) const { return load_u64(p + off); }
  __device__ __forceinline__ std::uint32_t u32(std::uint64_t off) const { return load_u32(p + off); }
  __device__ __forceinline__ std::uint8_t u8(std::uint64_t off) const { return __ldg(p + off); }
  __device__ __forceinline__ void stripe(std::uint64_t off, std::uint64_t* w) const {
    for (int i = 0; i < 4; ++i) w[i] = load_u64(p + off + 8 * i);
  }
};

/// A reader of bytes that start 16-byte aligned: each 32-byte stripe (at multiples of 32) is two
/// 16-byte loads.
struct aligned_reader : word_reader {
  __device__ __forceinline__ void stripe(std::uint64_t off, std::uint64_t* w) const {
    const ulonglong2 a = __ldg(reinterpret_cast<const ulonglong2*>(p + off));
    const ulonglong2 b = __ldg(reinterpret_cast<const ulonglong2*>(p + off + 16));
    w[0] = a.x;
    w[1] = a.y;
    w[2] = b.x;
    w[3] = b.y;
  }
};

/// out[i] = XXH3-64(block i of in[0, n), seed) for i < blocks.
template <class Reader>
__global__ void hash_level_kernel(const unsigned char* in, std::uint64_t n, std::uint64_t seed,
                                  std::uint64_t blocks, std::uint64_t* out) {
  const std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const std::uint64_t off = i * message_hash_block;
  const std::uint64_t len = n - off < message_hash_block ? n - off : message_hash_block;
  out[i] = xxh3::xxh3_64(Reader{in + off}, len, seed, c_secret);
}

/// The lanes of a warp that hash one full block together, and the threads of a block of
/// hash_blocks_kernel.
constexpr unsigned lanes_per_block = 4;
constexpr unsigned hash_threads = 256;

/// out[i] = XXH3-64(block i of in[0, n), seed) for i < blocks, with `in` 16-byte aligned. Every
/// full 4096-byte block is hashed by four consecutive lanes: lane q loads bytes [16q, 16q + 16) of
/// each 64-byte stripe and keeps accumulators 2q and 2q + 1 (XXH3's accumulator i takes stripe word
/// i's product and word i ^ 1's value, so the pair needs no other lane's words); the four merge
/// terms are summed by shuffles. The same steps as xxh3::xxh3_64's long path for n = 4096: three
/// blocks of 16 stripes, each followed by the scramble, 15 stripes, then the stripe of the last 64
/// bytes with the secret at byte 121. A last, shorter block is hashed by its group's first lane
/// with xxh3::xxh3_64.
__global__ void __launch_bounds__(hash_threads)
    hash_blocks_kernel(const unsigned char* in, std::uint64_t n, std::uint64_t seed,
                       std::uint64_t blocks, std::uint64_t* out) {
  // The secret derived from the seed, as words (xxh3::key::word).
  __shared__ std::uint64_t kw[24];
  if (threadIdx.x < 24) {
    const unsigned i = threadIdx.x;
    kw[i] = c_secret.w[i] + ((i & 1) ? 0 - seed : seed);
  }
  __syncthreads();
  const std::uint64_t block = (static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) /
                              lanes_per_block;
  if (block >= blocks) return;
  const unsigned q = threadIdx.x % lanes_per_block;
  const std::uint64_t off = block * message_hash_block;
  if (n - off < message_hash_block) {
    if (q == 0) out[block] = xxh3::xxh3_64(aligned_reader{{in + off}}, n - off, seed, c_secret);
    return;
  }
  // Key words at any byte offset (xxh3::key::u64), from shared memory.
  auto key = [&](unsigned o) -> std::uint64_t {
    const unsigned i = o >> 3, b = o & 7;
    return b == 0 ? kw[i] : (kw[i] >> (8 * b)) | (kw[i + 1] << (64 - 8 * b));
  };
  const auto* p = reinterpret_cast<const ulonglong2*>(in + off) + q;  // 16 bytes per lane per stripe
  std::uint64_t a0 = q == 0 ? xxh3::p32_3 : q == 1 ? xxh3::p64_2 : q == 2 ? xxh3::p64_4 : xxh3::p64_5;
  std::uint64_t a1 = q == 0 ? xxh3::p64_1 : q == 1 ? xxh3::p64_3 : q == 2 ? xxh3::p32_2 : xxh3::p32_1;
  // Stripe s of the block (64 bytes = 4 ulonglong2) with the key words at 8 * ks.
  auto stripe = [&](ulonglong2 w, unsigned ks) {
    const std::uint64_t v0 = w.x ^ kw[ks + 2 * q];
    const std::uint64_t v1 = w.y ^ kw[ks + 2 * q + 1];
    a0 += w.y + (v0 & 0xFFFFFFFFull) * (v0 >> 32);
    a1 += w.x + (v1 & 0xFFFFFFFFull) * (v1 >> 32);
  };
  for (unsigned b = 0; b < 3; ++b) {
    ulonglong2 w[16];
#pragma unroll
    for (unsigned i = 0; i < 16; ++i) w[i] = __ldcs(p + 4 * (16 * b + i));
#pragma unroll
    for (unsigned i = 0; i < 16; ++i) stripe(w[i], i);
    a0 = xxh3::scramble(a0, kw[16 + 2 * q]);
    a1 = xxh3::scramble(a1, kw[17 + 2 * q]);
  }
  {
    ulonglong2 w[16];
#pragma unroll
    for (unsigned i = 0; i < 16; ++i) w[i] = __ldcs(p + 4 * (48 + i));
#pragma unroll
    for (unsigned i = 0; i < 15; ++i) stripe(w[i], i);
    // The last 64 bytes are stripe 15 itself, with the secret at byte 121.
    const std::uint64_t v0 = w[15].x ^ key(121 + 16 * q);
    const std::uint64_t v1 = w[15].y ^ key(129 + 16 * q);
    a0 += w[15].y + (v0 & 0xFFFFFFFFull) * (v0 >> 32);
    a1 += w[15].x + (v1 & 0xFFFFFFFFull) * (v1 >> 32);
  }
  std::uint64_t h = xxh3::mul_fold(a0 ^ key(11 + 16 * q), a1 ^ key(19 + 16 * q));
  const unsigned lane = threadIdx.x % 32;
  const unsigned mask = 0xFu << (lane & ~(lanes_per_block - 1));
  h += __shfl_xor_sync(mask, h, 1, lanes_per_block);
  h += __shfl_xor_sync(mask, h, 2, lanes_per_block);
  if (q == 0) out[block] = xxh3::avalanche(message_hash_block * xxh3::p64_1 + h);
}

void launch_level(const unsigned char* in, std::uint64_t n, std::uint64_t seed,
                  std::uint64_t blocks, std::uint64_t* out, cudaStream_t s) {
  if (reinterpret_cast<std::uintptr_t>(in) % 16 == 0) {
    const std::uint64_t threads = blocks * lanes_per_block;
    const auto grid = static_cast<unsigned>((threads + hash_threads - 1) / hash_threads);
    hash_blocks_kernel<<<grid, hash_threads, 0, s>>>(in, n, seed, blocks, out);
  } else {
    constexpr unsigned threads = 128;
    const auto grid = static_cast<unsigned>((blocks + threads - 1) / threads);
    hash_level_kernel<word_reader><<<grid, threads, 0, s>>>(in, n, seed, blocks, out);
  }
  TROUPE_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------------------------------------
// page-locked result slots, shared by every backend of the process

/// Slots of mapped page-locked host memory and events, handed out one per pending hash and
/// returned when the hash has been read.
class slot_pool {
 public:
  struct slot {
    std::uint64_t* host = nullptr;
    std::uint64_t* device = nullptr;  // the same memory as the device sees it
    cudaEvent_t done = nullptr;
  };

  slot take() {
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.empty()) grow();
    slot s = free_.back();
    free_.pop_back();
    return s;
  }
  void give(const slot& s) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(s);
  }

 private:
  void grow() {
    constexpr int n = 256;
    void* mem = nullptr;
    TROUPE_CUDA_CHECK(cudaHostAlloc(&mem, n * sizeof(std::uint64_t), cudaHostAllocMapped |
                                                                         cudaHostAllocPortable));
    void* dev = nullptr;
    TROUPE_CUDA_CHECK(cudaHostGetDevicePointer(&dev, mem, 0));
    for (int i = 0; i < n; ++i) {
      slot s;
      s.host = static_cast<std::uint64_t*>(mem) + i;
      s.device = static_cast<std::uint64_t*>(dev) + i;
      TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
      free_.push_back(s);
    }
  }

  std::mutex mu_;
  std::vector<slot> free_;  // never freed: the pool lives as long as the process
};

/// The pool of `device` (an event belongs to one device): made the first time while that device is
/// current, and never freed (it outlives every backend and static destructor).
slot_pool& pool(int device) {
  static std::mutex mu;
  static std::vector<slot_pool*> pools;
  std::lock_guard<std::mutex> lk(mu);
  if (device >= static_cast<int>(pools.size())) pools.resize(static_cast<std::size_t>(device) + 1);
  if (!pools[static_cast<std::size_t>(device)]) pools[static_cast<std::size_t>(device)] = new slot_pool();
  return *pools[static_cast<std::size_t>(device)];
}

class pending_hash final : public pending_value {
 public:
  pending_hash(slot_pool& pool, slot_pool::slot s) : pool_(pool), s_(s) {}
  ~pending_hash() override {
    // The slot is reused only once its kernel has written it.
    if (!read_) cudaEventSynchronize(s_.done);
    pool_.give(s_);
  }
  std::uint64_t get() override {
    if (!read_) {
      TROUPE_CUDA_CHECK(cudaEventSynchronize(s_.done));
      value_ = *static_cast<volatile std::uint64_t*>(s_.host);
      read_ = true;
    }
    return value_;
  }

 private:
  slot_pool& pool_;
  slot_pool::slot s_;
  bool read_ = false;
  std::uint64_t value_ = 0;
};

}  // namespace

// ------------------------------------------------------------------------------------------------
// launchers

namespace {

/// The message hash (kernels/message_hash.hpp) from a level's data in[0, n) with its seed (0: a
/// tensor's own bytes; a tensor's byte count: its first level's digests), queued on ctx.stream;
/// get() waits.
std::shared_ptr<pending_value> launch_message_hash(context& ctx, const unsigned char* in,
                                                   std::uint64_t n, std::uint64_t seed) {
  slot_pool& p = pool(ctx.device);
  slot_pool::slot s = p.take();
  auto result = std::make_shared<pending_hash>(p, s);
  // Two scratch levels alternate; the first is the largest (n / 512 bytes).
  const std::uint64_t first = (n + message_hash_block - 1) / message_hash_block;
  std::unique_ptr<scratch> a, b;
  if (n > message_hash_block) {
    a = std::make_unique<scratch>(ctx, first * sizeof(std::uint64_t));
    const std::uint64_t second = (first * 8 + message_hash_block - 1) / message_hash_block;
    if (first * 8 > message_hash_block) b = std::make_unique<scratch>(ctx, second * sizeof(std::uint64_t));
  }
  scratch* levels[2] = {a.get(), b.get()};
  int next = 0;
  while (n > message_hash_block) {
    const std::uint64_t blocks = (n + message_hash_block - 1) / message_hash_block;
    auto* out = levels[next]->as<std::uint64_t>();
    launch_level(in, n, seed, blocks, out, ctx.stream);
    seed = n;
    n = blocks * sizeof(std::uint64_t);
    in = reinterpret_cast<const unsigned char*>(out);
    next ^= 1;
  }
  launch_level(in, n, seed, 1, s.device, ctx.stream);
  TROUPE_CUDA_CHECK(cudaEventRecord(s.done, ctx.stream));
  return result;
}

}  // namespace

void launch_message_hash_blocks(context& ctx, const void* in, std::uint64_t n, std::uint64_t* out) {
  if (n == 0) return;
  launch_level(static_cast<const unsigned char*>(in), n, 0, message_hash_blocks_of(n), out,
               ctx.stream);
}

// ------------------------------------------------------------------------------------------------
// the backend's methods

std::shared_ptr<pending_value> cuda_backend::message_hash_async(const tensor& x) {
  if (x.defined() && x.dev().is_cpu()) return backend::message_hash_async(x);
  activate();
  if (ctx_->capturing)
    throw core::failure("cuda message_hash_async: a hash read by the host cannot be recorded in a graph");
  auto h = launch_message_hash(*ctx_, static_cast<const unsigned char*>(x.defined() ? x.raw() : nullptr),
                               x.defined() ? x.bytes() : 0, 0);
  // Whoever waits for x from now on also waits for the hash's reads of it.
  if (x.defined() && x.bytes() > 0) cuda::record_ready(ctx_->stream_owner, x);
  return h;
}

std::shared_ptr<pending_value> cuda_backend::message_hash_of_blocks_async(const tensor& blocks,
                                                                          std::uint64_t bytes) {
  if (blocks.defined() && blocks.dev().is_cpu())
    return backend::message_hash_of_blocks_async(blocks, bytes);
  activate();
  const char* op = "cuda message_hash_of_blocks_async";
  require_type(blocks, dtype::i64, op, "blocks");
  require_numel(blocks, static_cast<std::int64_t>(message_hash_blocks_of(bytes)), op,
                "blocks (message_hash_blocks_of(bytes))");
  if (ctx_->capturing)
    throw core::failure(std::string(op) + ": a hash read by the host cannot be recorded in a graph");
  const auto* in = static_cast<const unsigned char*>(blocks.raw());
  if (bytes == 0) return launch_message_hash(*ctx_, nullptr, 0, 0);
  if (bytes <= message_hash_block) {
    // One block: the hash is its digest.
    slot_pool& p = pool(ctx_->device);
    slot_pool::slot sl = p.take();
    auto result = std::make_shared<pending_hash>(p, sl);
    TROUPE_CUDA_CHECK(cudaMemcpyAsync(sl.device, in, sizeof(std::uint64_t), cudaMemcpyDefault,
                                      ctx_->stream));
    TROUPE_CUDA_CHECK(cudaEventRecord(sl.done, ctx_->stream));
    return result;
  }
  return launch_message_hash(*ctx_, in, message_hash_blocks_of(bytes) * sizeof(std::uint64_t), bytes);
}

}  // namespace troupe::kernels::cuda
