// Backend selection, memory primitives and the thread pool of the CPU backend.
#include <cblas.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "kernels/cpu/blas_core.hpp"
#include "kernels/cpu/parallel.hpp"
#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {

TEST_CASE("make_backend gives a cpu backend for \"cpu\" and explains other devices") {
  auto be = make_backend("cpu");
  CHECK(be->name() == "cpu");
  CHECK(be->dev().is_cpu());
  CHECK(failure_message([] { make_backend("tpu"); }).find("unknown device \"tpu\"") !=
        std::string::npos);
  CHECK(failure_message([] { make_backend("cuda:x"); }).find("unknown device") !=
        std::string::npos);
  CHECK(failure_message([] { make_backend("cuda:-1"); }).find("unknown device") !=
        std::string::npos);
#ifndef TROUPE_HAVE_CUDA
  CHECK_FALSE(cuda_available());
  const std::string msg = failure_message([] { make_backend("cuda:1"); });
  CHECK(msg.find("this build has no CUDA backend") != std::string::npos);
  CHECK(msg.find("hint") != std::string::npos);
#endif
}

TEST_CASE("OpenBLAS stays single-threaded whatever set_cpu_threads says") {
  // Its threaded GEMM gives different bits for different thread counts; linear.cpp cuts GEMMs
  // into shape-determined blocks on the backend's own threads instead.
  auto be = make_backend("cpu");
  with_threads(2, [&] { CHECK(openblas_get_num_threads() == 1); });
  CHECK(openblas_get_num_threads() == 1);
}

TEST_CASE("OpenBLAS runs the kernels of the processor's instruction sets, not its SSE3 fallback") {
  // Debian's OpenBLAS 0.3.21 falls back to its SSE3 kernels on processors it does not know by
  // model (current Xeons); blas_core.cpp names the kernels by instruction set before main().
  auto be = make_backend("cpu");
  const std::string now = openblas_get_corename();
  MESSAGE("OpenBLAS kernels: " << cpu::blas_core());
  if (std::getenv("OPENBLAS_CORETYPE")) return;  // the user's choice wins
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512) {
    CHECK(now == "SkylakeX");
  } else if (avx2) {
    CHECK(now == "Haswell");
  } else {
    CHECK(cpu::blas_core_for_cpu() == nullptr);
  }
  // The GEMMs still give the same bits with 1 and 2 threads under the chosen kernels.
  tensor x = randn({256, 128}, 4), w = randn({3000, 128}, 5, 0.1f);
  tensor y1 = be->empty({256, 3000}, dtype::f32), y2 = be->empty({256, 3000}, dtype::f32);
  with_threads(1, [&] { be->linear_forward(x, w, tensor(), y1); });
  with_threads(2, [&] { be->linear_forward(x, w, tensor(), y2); });
  CHECK(std::memcmp(y1.raw(), y2.raw(), y1.bytes()) == 0);
}

TEST_CASE("cpu memory primitives: empty is zeroed, copy, zero, convert and host round trips") {
  auto be = make_backend("cpu");
  tensor e = be->empty({5, 3}, dtype::f32);
  for (int i = 0; i < 15; ++i) CHECK(e.data<float>()[i] == 0.0f);
  tensor x = randn({5, 3}, 1);
  be->copy(x, e);
  CHECK(same_bits(e, x));
  tensor back = be->from_host(x);
  CHECK(same_bits(be->to_host(back), x));
  CHECK(back.raw() != x.raw());
  be->zero(e);
  for (int i = 0; i < 15; ++i) CHECK(e.data<float>()[i] == 0.0f);
  tensor half = be->empty({5, 3}, dtype::bf16), again = be->empty({5, 3}, dtype::f32);
  be->convert(x, half);
  be->convert(half, again);
  for (int i = 0; i < 15; ++i)
    CHECK(again.data<float>()[i] == core::bf16_to_f32(core::f32_to_bf16(x.data<float>()[i])));
  tensor wrong = be->empty({4}, dtype::f32);
  CHECK(failure_message([&] {
          be->copy(x, wrong);
        }).find("copy: src and dst must have the same byte size") != std::string::npos);
  CHECK(failure_message([&] {
          be->convert(x, wrong);
        }).find("convert: src and dst must have the same shape") != std::string::npos);
}

TEST_CASE("parallel_tasks runs every task once, on two threads when allowed") {
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::vector<std::atomic<int>> runs(16);
  with_threads(2, [&] {
    cpu::parallel_tasks(16, [&](std::int64_t i) {
      runs[i]++;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::lock_guard<std::mutex> lk(mu);
      ids.insert(std::this_thread::get_id());
    });
  });
  for (auto& r : runs) CHECK(r.load() == 1);
  CHECK(ids.size() == 2);
  ids.clear();
  with_threads(1, [&] {
    cpu::parallel_tasks(4, [&](std::int64_t) {
      std::lock_guard<std::mutex> lk(mu);
      ids.insert(std::this_thread::get_id());
    });
  });
  CHECK(ids == std::set<std::thread::id>{std::this_thread::get_id()});
}

TEST_CASE("parallel_tasks called from several threads at once runs every task of every call once") {
  with_threads(2, [&] {
    std::vector<std::thread> callers;
    std::atomic<int> wrong{0};
    for (int c = 0; c < 4; ++c)
      callers.emplace_back([&] {
        for (int call = 0; call < 300; ++call) {
          std::vector<std::atomic<int>> runs(5);
          cpu::parallel_tasks(5, [&](std::int64_t i) { runs[i]++; });
          for (auto& r : runs)
            if (r.load() != 1) wrong++;
        }
      });
    for (auto& t : callers) t.join();
    CHECK(wrong.load() == 0);
  });
}

TEST_CASE("parallel_tasks rethrows a task's exception after all tasks finished") {
  std::atomic<int> done{0};
  with_threads(2, [&] {
    CHECK_THROWS_AS(cpu::parallel_tasks(8,
                                        [&](std::int64_t i) {
                                          done++;
                                          if (i == 3) throw std::runtime_error("task 3");
                                        }),
                    std::runtime_error);
  });
  CHECK(done.load() == 8);
}

TEST_CASE("parallel_for covers [0, n) once in contiguous ranges of at least the grain") {
  with_threads(2, [&] {
    std::vector<std::atomic<int>> hits(1000);
    std::atomic<int> short_ranges{0};
    cpu::parallel_for(1000, 300, [&](std::int64_t b, std::int64_t e) {
      if (e - b < 300) short_ranges++;
      for (std::int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (auto& h : hits) CHECK(h.load() == 1);
    CHECK(short_ranges.load() == 0);
  });
}

}  // namespace troupe::kernels::cpu_test
