// runtime.gemm_tune_file on the single-rank trainer: the first run measures its GEMMs and writes
// one line per GEMM plan, a second run reads them back (the file does not grow) and trains to the
// same bits, and a run without the key leaves the file alone. Skips without a GPU.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <string>

#include "kernels/select.hpp"
#include "model/trainer.hpp"
#include "tests/kernels/cuda_test_util.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace troupe::kernels::cuda_test {
namespace {

int lines_of(const std::string& path) {
  std::ifstream in(path);
  int n = 0;
  for (std::string l; std::getline(in, l);) n += !l.empty();
  return n;
}

}  // namespace

TEST_CASE("cuda trainer: runtime.gemm_tune_file is written once, read back, same bits") {
  if (!gpu_or_skip()) return;
  model::testing::scratch_dir tmp("gemm_tune_run");
  core::config cfg = model::testing::tiny_run(tmp);
  cfg.runtime.device = "cuda";
  cfg.precision.compute = core::precision_kind::bf16;
  cfg.train.steps = 2;
  cfg.train.eval_interval = 0;
  cfg.runtime.gemm_tune_file = tmp / "tune.txt";
  model::train_options opt;
  opt.log = nullptr;
  std::vector<double> losses[2];
  int lines[2] = {0, 0};
  for (int run = 0; run < 2; ++run) {
    cfg.runtime.run_dir = tmp / ("run" + std::to_string(run));
    auto r = model::train_single_rank(cfg, opt);
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
    losses[run] = r->losses;
    lines[run] = lines_of(cfg.runtime.gemm_tune_file);
  }
  CHECK(lines[0] > 0);
  CHECK(lines[1] == lines[0]);
  REQUIRE(losses[0].size() == losses[1].size());
  for (std::size_t i = 0; i < losses[0].size(); ++i)
    CHECK(std::memcmp(&losses[0][i], &losses[1][i], sizeof(double)) == 0);

  core::config off = cfg;
  off.runtime.gemm_tune_file.clear();
  off.runtime.run_dir = tmp / "run_off";
  REQUIRE(model::train_single_rank(off, opt).ok());
  CHECK(lines_of(cfg.runtime.gemm_tune_file) == lines[0]);
  set_gemm_tune_file("");
}

}  // namespace troupe::kernels::cuda_test
