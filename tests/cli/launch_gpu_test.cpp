// `troupe launch` on GPUs: the worker processes move tensors with the nccl transport. The test must
// run on a machine with a single GPU, and NCCL refuses two ranks of one host on one GPU, so it
// gives each rank its own NCCL host id (TROUPE_NCCL_HOST_PER_RANK=1: NCCL then connects the ranks
// over sockets) and puts both pipeline stages on GPU 0. In fp32 the kernels are deterministic and
// each stage runs the same kernels in the same order whether it shares a process or not, so the
// launched job must equal `troupe train` in one process bit for bit; so must a tensor-parallel job,
// whose group sums in rank order on the GPU (actors/tp_group.cpp). Skips without a GPU or NCCL.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "kernels/backend.hpp"
#include "kernels/select.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using troupe::model::testing::file_bytes;

namespace {

int sh(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/// True where this build has NCCL and a GPU is visible; otherwise says why the test skips.
bool nccl_gpu_or_skip() {
#ifndef TROUPE_HAVE_NCCL
  MESSAGE("skipped: this build has no NCCL");
  return false;
#else
  if (troupe::kernels::cuda_available()) return true;
  MESSAGE("skipped: no GPU");
  return false;
#endif
}

/// `cfg` (runtime.device = "cuda") run by `troupe train` in one process and by `troupe launch`
/// with `workers` processes on GPU 0 (each its own NCCL host id): the final checkpoint files and
/// every loss must be the same bytes.
void check_launch_equals_train(const troupe::model::testing::scratch_dir& tmp,
                               const troupe::core::config& cfg, int workers, int port) {
  const std::string config = tmp / "gpu.toml";
  std::ofstream(config) << troupe::core::to_toml(cfg);
  // bench/gpu/tests.sh runs this test from a package, away from its build folder, and names the
  // package's binary.
  const char* packaged = std::getenv("TROUPE_TEST_BINARY");
  const std::string bin = packaged ? packaged : TROUPE_BINARY_DIR "/troupe";
  const std::string in_dir = tmp / "inproc", l_dir = tmp / "launched";
  const int train_code = sh("cd '" + tmp.path.string() + "' && '" + bin + "' train '" + config +
                            "' --set runtime.run_dir='" + in_dir + "' > train.out 2>&1");
  INFO(file_bytes(tmp / "train.out"));
  REQUIRE(train_code == 0);
  const int code = sh("cd '" + tmp.path.string() + "' && TROUPE_NCCL_HOST_PER_RANK=1 '" + bin +
                      "' launch --worker_num " + std::to_string(workers) + " --master_port " +
                      std::to_string(port) + " '" + config + "' --set runtime.run_dir='" + l_dir +
                      "' > launch.out 2> launch.err");
  const std::string launch_log = file_bytes(tmp / "launch.out") + file_bytes(tmp / "launch.err");
  INFO(launch_log);
  REQUIRE(code == 0);
  const std::string last = "step_" + std::string(6 - std::to_string(cfg.train.steps).size(), '0') +
                           std::to_string(cfg.train.steps);
  int files = 0;
  for (auto& e : fs::directory_iterator(fs::path(in_dir) / "checkpoints" / last)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    CHECK_MESSAGE(file_bytes(e.path().string()) ==
                      file_bytes((fs::path(l_dir) / "checkpoints" / last / e.path().filename()).string()),
                  e.path().filename().string());
  }
  CHECK(files > 0);
}

}  // namespace

TEST_CASE("gpu: a launched pipeline (2 worker processes, nccl) on one GPU equals troupe train bit for bit") {
  if (!nccl_gpu_or_skip()) return;
  troupe::model::testing::scratch_dir tmp("launch_gpu");
  auto cfg = troupe::model::testing::tiny_run(tmp);
  cfg.parallel.pipeline_stage = 2;
  cfg.train.steps = 4;
  cfg.runtime.device = "cuda";
  check_launch_equals_train(tmp, cfg, 2, 29731);
}

TEST_CASE("gpu: a launched model_parallel 2 × pipeline_stage 2 job (4 worker processes, nccl) on one "
          "GPU equals troupe train bit for bit") {
  if (!nccl_gpu_or_skip()) return;
  for (bool sp : {false, true}) {
    INFO("sequence_parallel ", sp);
    troupe::model::testing::scratch_dir tmp(std::string("launch_gpu_tp") + (sp ? "_sp" : ""));
    auto cfg = troupe::model::testing::tiny_run(tmp, troupe::core::arch_kind::llama);
    cfg.model.num_layers = 4;
    cfg.parallel.model_parallel = 2;
    cfg.parallel.sequence_parallel = sp;
    cfg.parallel.pipeline_stage = 2;
    cfg.train.steps = 4;
    cfg.runtime.device = "cuda";
    check_launch_equals_train(tmp, cfg, 4, sp ? 29733 : 29732);
  }
}
