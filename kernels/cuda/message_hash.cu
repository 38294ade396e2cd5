// message_hash: the message logs' hash of a tensor (kernels/message_hash.hpp has the definition:
// XXH3-64 over 4 KiB blocks, level by level), computed on the GPU so that recording needs no copy
// of the tensor to the host. One thread hashes one 4 KiB block of a level with the header's XXH3
// code; a level of n bytes gives n / 512 bytes of digests for the next, so a 500 MB gradient takes
// three launches (122,000 blocks, 239, then one). The last launch writes the hash into page-locked
// host memory; an event after it tells the host when to read it.
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

void launch_level(const unsigned char* in, std::uint64_t n, std::uint64_t seed,
                  std::uint64_t blocks, std::uint64_t* out, cudaStream_t s) {
  constexpr unsigned threads = 128;
  const auto grid = static_cast<unsigned>((blocks + threads - 1) / threads);
  if (reinterpret_cast<std::uintptr_t>(in) % 16 == 0)
    hash_level_kernel<aligned_reader><<<grid, threads, 0, s>>>(in, n, seed, blocks, out);
  else
    hash_level_kernel<word_reader><<<grid, threads, 0, s>>>(in, n, seed, blocks, out);
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

/// The message hash of x's bytes (kernels/message_hash.hpp), queued on ctx.stream; get() waits.
std::shared_ptr<pending_value> launch_message_hash(context& ctx, const tensor& x) {
  slot_pool& p = pool(ctx.device);
  slot_pool::slot s = p.take();
  auto result = std::make_shared<pending_hash>(p, s);
  auto* in = static_cast<const unsigned char*>(x.defined() ? x.raw() : nullptr);
  std::uint64_t n = x.defined() ? x.bytes() : 0;
  std::uint64_t seed = 0;
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

// ------------------------------------------------------------------------------------------------
// the backend's method

std::shared_ptr<pending_value> cuda_backend::message_hash_async(const tensor& x) {
  if (x.defined() && x.dev().is_cpu()) return backend::message_hash_async(x);
  activate();
  if (ctx_->capturing)
    throw core::failure("cuda message_hash_async: a hash read by the host cannot be recorded in a graph");
  auto h = launch_message_hash(*ctx_, x);
  // Whoever waits for x from now on also waits for the hash's reads of it.
  if (x.defined() && x.bytes() > 0) cuda::record_ready(ctx_->stream_owner, x);
  return h;
}

}  // namespace troupe::kernels::cuda
