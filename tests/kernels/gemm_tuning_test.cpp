// The GEMM tuning file (kernels/cuda/gemm_tuning.hpp): a choice is measured once, appended, and
// read back by later lookups and other processes; a malformed file is an error naming its line.
// The file logic needs no GPU (it runs wherever the CUDA backend is built); the last case checks on
// a GPU that tuned GEMMs still match the CPU and give the same bits when the file is read back.
#include <doctest/doctest.h>

#ifdef TROUPE_HAVE_CUDA
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "kernels/cuda/gemm_tuning.hpp"
#include "tests/kernels/cuda_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cuda_test {
namespace {

namespace tuning = cuda::gemm_tuning;

/// The tuning file set to a fresh file for the scope; the file and its lock removed after.
struct tune_file {
  std::filesystem::path path;
  explicit tune_file(const std::string& name)
      : path(std::filesystem::temp_directory_path() /
             ("troupe_" + name + "_" + std::to_string(::getpid()) + ".txt")) {
    std::filesystem::remove(path);
    tuning::set_file_path(path.string());
  }
  ~tune_file() {
    tuning::set_file_path("");
    std::filesystem::remove(path);
    std::filesystem::remove(path.string() + ".lock");
  }
  int lines() const {
    std::ifstream in(path);
    int n = 0;
    for (std::string l; std::getline(in, l);) n += !l.empty();
    return n;
  }
  void append(const std::string& line) const {
    std::ofstream out(path, std::ios::app);
    out << line << "\n";
  }
};

cublasLtMatmulAlgo_t algo_with(std::uint64_t v) {
  cublasLtMatmulAlgo_t a{};
  a.data[0] = v;
  a.data[7] = v * 3;
  return a;
}

/// The file form of algo_with(v) for v < 256 (little-endian bytes of data[0..7]).
std::string hex_of(std::uint64_t v) {
  const cublasLtMatmulAlgo_t a = algo_with(v);
  static const char digits[] = "0123456789abcdef";
  const auto* p = reinterpret_cast<const unsigned char*>(&a);
  std::string out;
  for (std::size_t i = 0; i < sizeof(a); ++i) {
    out.push_back(digits[p[i] >> 4]);
    out.push_back(digits[p[i] & 15]);
  }
  return out;
}

}  // namespace

TEST_CASE("gemm tuning: a choice is measured once, written, and read back instead of measured") {
  tune_file f("gemm_tune_once");
  int measured = 0;
  auto tune = [&]() -> std::optional<tuning::choice> {
    ++measured;
    return tuning::choice{algo_with(42), 0.25};
  };
  const auto a = tuning::lookup_or_tune("gpu|lt1|1,2,3", tune);
  REQUIRE(a.has_value());
  CHECK(a->data[0] == 42);
  CHECK(a->data[7] == 126);
  CHECK(measured == 1);
  CHECK(f.lines() == 1);
  const auto b = tuning::lookup_or_tune("gpu|lt1|1,2,3", tune);
  REQUIRE(b.has_value());
  CHECK(b->data[0] == 42);
  CHECK(measured == 1);
  CHECK(f.lines() == 1);

  // An entry another process appended after this one read the file is used, not re-measured.
  f.append("gpu|lt1|4,5,6 " + hex_of(7) + " 0.125");
  const auto c = tuning::lookup_or_tune("gpu|lt1|4,5,6", tune);
  REQUIRE(c.has_value());
  CHECK(c->data[0] == 7);
  CHECK(c->data[7] == 21);
  CHECK(measured == 1);

  // A GEMM with no runnable candidate is not recorded.
  const auto d = tuning::lookup_or_tune("gpu|lt1|7,8,9", [&]() -> std::optional<tuning::choice> {
    ++measured;
    return std::nullopt;
  });
  CHECK_FALSE(d.has_value());
  CHECK(measured == 2);
  CHECK(f.lines() == 2);
}

TEST_CASE("gemm tuning: off without a tuning file, and a malformed file names its line") {
  tuning::set_file_path("");
  int measured = 0;
  auto tune = [&]() -> std::optional<tuning::choice> {
    ++measured;
    return tuning::choice{algo_with(1), 1.0};
  };
  CHECK(tuning::file_path().empty());
  CHECK_FALSE(tuning::lookup_or_tune("k", tune).has_value());
  CHECK(measured == 0);

  tune_file f("gemm_tune_bad");
  f.append("# measured on the H200");
  f.append("gpu|lt1|1 " + hex_of(3) + " 0.5");
  f.append("gpu|lt1|2 not-hex 0.5");
  try {
    tuning::lookup_or_tune("gpu|lt1|1", tune);
    FAIL("a malformed line was accepted");
  } catch (const core::failure& e) {
    const std::string what = e.what();
    CHECK(what.find(f.path.string() + ":3") != std::string::npos);
    CHECK(what.find("hint") != std::string::npos);
  }
  CHECK(measured == 0);
}

TEST_CASE("cuda linear with a tuning file matches the CPU and gives the same bits when read back") {
  if (!gpu_or_skip()) return;
  tune_file f("gemm_tune_gpu");
  auto cpu = make_backend("cpu");
  const std::int64_t N = 512, IC = 256, OC = 384;
  const dtype t = dtype::bf16;
  tensor x = rounded(random_host({N, IC}, 31), t), w = rounded(random_host({OC, IC}, 32, 0.1f), t);
  tensor dy = rounded(random_host({N, OC}, 33), t);
  tensor y_ref = tensor::zeros({N, OC}), dw_ref = tensor::zeros({OC, IC}), db_ref = tensor::zeros({OC});
  cpu->linear_forward(x, w, tensor{}, y_ref);
  cpu->linear_backward_weight(dy, x, dw_ref, db_ref);
  tensor y_bits[2], dw_bits[2];
  for (int run = 0; run < 2; ++run) {  // run 0 measures and writes the file, run 1 reads it
    auto gpu = make_backend("cuda");  // a fresh context: no plans cached
    tensor gx = upload(*gpu, x, t), gw = upload(*gpu, w, t), gdy = upload(*gpu, dy, t);
    tensor gy = poisoned(*gpu, {N, OC}, t);
    gpu->linear_forward(gx, gw, tensor{}, gy);
    tensor gdw = upload(*gpu, tensor::zeros({OC, IC}), dtype::f32);
    tensor gdb = upload(*gpu, tensor::zeros({OC}), dtype::f32);
    gpu->linear_backward_weight(gdy, gx, gdw, gdb);  // accumulates: tuning must not add twice
    y_bits[run] = gpu->to_host(gy);
    dw_bits[run] = gpu->to_host(gdw);
    check_close(host_f32(y_bits[run]), y_ref, bf16_rtol, "y = x·wᵀ (tuned)");
    check_close(dw_bits[run], dw_ref, bf16_rtol, "dw += dyᵀ·x (tuned)");
  }
  const int lines = f.lines();
  CHECK(lines >= 1);  // GEMMs with one candidate are not measured
  CHECK(same_bits(y_bits[0], y_bits[1]));
  CHECK(same_bits(dw_bits[0], dw_bits[1]));
}

}  // namespace troupe::kernels::cuda_test
#endif
