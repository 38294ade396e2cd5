// The actor runtime's determinism promises (docs/design.md, Determinism contract), each as a
// bit-for-bit comparison of the per-step losses and of every saved tensor (parameters and AdamW
// moments, by name).
#include "runtime/runtime.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/checkpoint.hpp"
#include "model/instruction_shards.hpp"
#include "runtime/preflight.hpp"
#include "schedules/registry.hpp"
#include "schedules/schedule_file.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using namespace troupe::runtime_test;

void check_identical(const outcome& a, const outcome& b) {
  check_same_losses_and_tensors(a, b);
  REQUIRE(a.val.has_value() == b.val.has_value());
  if (a.val) CHECK(std::memcmp(&*a.val, &*b.val, sizeof(double)) == 0);
}

}  // namespace

TEST_CASE("the same config twice gives bit-identical losses and weights") {
  scratch_dir tmp("rt_twice");
  auto cfg = pipeline_config(tmp, 2, 2);
  check_identical(actors_run(cfg), actors_run(cfg));
}

TEST_CASE("pipeline_stage 1, 2 and 4 are bit-identical to the single-rank loop") {
  scratch_dir tmp("rt_split");
  auto oracle = oracle_run(pipeline_config(tmp, 1));
  for (int pp : {1, 2, 4}) {
    INFO("pipeline_stage ", pp);
    check_identical(actors_run(pipeline_config(tmp, pp)), oracle);
  }
}

TEST_CASE("recompute.keep_gelu through the actors, split and with the split backward, gives the bits "
          "of recomputing GELU") {
  // On the CPU the kept output and the recomputed one are the same op on the same input.
  scratch_dir tmp("rt_keep_gelu");
  auto oracle = oracle_run(pipeline_config(tmp, 1));
  for (int pp : {1, 2})
    for (std::string schedule : {"1f1b", "zb_h1"}) {
      if (pp == 1 && schedule == "zb_h1") continue;
      INFO("pipeline_stage ", pp, ", ", schedule);
      auto cfg = pipeline_config(tmp, pp);
      cfg.schedule.name = schedule;
      cfg.recompute.keep_gelu = 2;
      check_identical(actors_run(cfg), oracle);
    }
}

TEST_CASE("gpipe, 1f1b, interleaved_1f1b and zb_h1 are bit-identical") {
  scratch_dir tmp("rt_sched");
  auto base = pipeline_config(tmp, 2);
  base.schedule.name = "1f1b";
  auto ref = actors_run(base);
  for (std::string name : {"gpipe", "interleaved_1f1b", "zb_h1"}) {
    INFO("schedule ", name);
    auto cfg = base;
    cfg.schedule.name = name;
    if (name == "interleaved_1f1b") cfg.parallel.virtual_pipeline = 2;
    check_identical(actors_run(cfg), ref);
  }
}

TEST_CASE("zb_v (two chunks per rank in a V) is bit-identical to 1f1b at pp 2 and 4, gpt2 and llama") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    scratch_dir tmp(arch == core::arch_kind::gpt2 ? "rt_zbv_gpt2" : "rt_zbv_llama");
    for (int pp : {2, 4}) {
      const std::string family = arch == core::arch_kind::gpt2 ? "gpt2" : "llama";
      INFO(family, " pipeline_stage ", pp);
      auto base = pipeline_config(tmp, pp);
      base.model.arch = arch;
      if (arch == core::arch_kind::llama) {
        base.model.num_kv_heads = 2;
        base.model.ffn_hidden_size = 48;
        base.model.tie_embeddings = false;
      }
      base.model.num_layers = 2 * pp;  // one layer per chunk under zb_v
      base.schedule.name = "1f1b";
      auto ref = actors_run(base);
      auto cfg = base;
      cfg.schedule.name = "zb_v";
      cfg.parallel.virtual_pipeline = 2;
      check_identical(actors_run(cfg), ref);
    }
  }
}

// The head's weight gradient needs dlogits, as large as the logits. Under a split backward it is
// taken with the input gradient (model/chunk.hpp), so a zero-bubble schedule that defers weight
// phases holds no more of them than 1f1b does; before, zb_h1's last stage held one per deferred W.
TEST_CASE("zb_h1 and zb_v hold no more logits-sized gradients at the head than 1f1b") {
  scratch_dir tmp("rt_zb_head");
  auto base = pipeline_config(tmp, 4);
  base.model.num_layers = 8;
  base.model.vocab_size = 16384;  // the logits dominate the head's stage
  base.parallel.micro_batch_num = 8;
  base.train.steps = 1;
  // Peak saved activations of pipeline rank `pp` in the run's metrics.
  auto head_peak = [&](const core::config& cfg, int pp) {
    actors_run(cfg);
    std::ifstream in(cfg.runtime.run_dir + "/metrics.jsonl");
    std::string line, last;
    while (std::getline(in, line)) last = line;
    const nlohmann::json m = nlohmann::json::parse(last);
    for (const auto& st : m["stages"])
      if (st["pp"] == pp) return st["peak_activation_bytes"].get<double>();
    FAIL("no stage ", pp, " in the metrics");
    return 0.0;
  };
  base.schedule.name = "1f1b";
  const double one_f_one_b = head_peak(base, 3);
  auto zb = base;
  zb.schedule.name = "zb_h1";
  const double zb_h1 = head_peak(zb, 3);
  zb.schedule.name = "zb_v";
  zb.parallel.virtual_pipeline = 2;
  const double zb_v = head_peak(zb, 0);  // the V brings the head back to rank 0
  MESSAGE("peak activations of the head's rank: 1f1b ", one_f_one_b, ", zb_h1 ", zb_h1, ", zb_v ", zb_v);
  CHECK(zb_h1 < 1.5 * one_f_one_b);
  CHECK(zb_v < 1.5 * one_f_one_b);
}

TEST_CASE("zb_v with recompute full and ZeRO 1 over two replicas is bit-identical to 1f1b, and resumes") {
  scratch_dir tmp("rt_zbv_zero");
  auto base = pipeline_config(tmp, 2, 2);
  base.recompute.mode = core::recompute_mode::full;
  base.optimizer.zero_stage = 1;
  auto ref = actors_run(base);
  auto cfg = base;
  cfg.schedule.name = "zb_v";
  cfg.parallel.virtual_pipeline = 2;
  check_identical(actors_run(cfg), ref);
  // Its checkpoint (both ends written from rank 0) resumes to the same end.
  check_identical(resumed_run(cfg, tmp / "resumed", 2), ref);
}

TEST_CASE("a schedule file with 'placement v' runs its chunks in a V, bit-identical to 1f1b") {
  scratch_dir tmp("rt_zbv_file");
  auto base = pipeline_config(tmp, 2);
  auto ref = actors_run(base);
  schedules::schedule_options o;
  o.virtual_stages = 2;
  auto made = schedules::make_schedule("zb_v", 2, base.parallel.micro_batch_num, o);
  REQUIRE(made.ok());
  const std::string text = schedules::format_schedule_text(*made);
  REQUIRE(text.find("placement v") != std::string::npos);
  const std::string file = tmp / "zb_v.txt";
  std::ofstream(file) << text;
  auto cfg = base;
  cfg.schedule.file = file;
  cfg.parallel.virtual_pipeline = 2;
  check_identical(actors_run(cfg), ref);
}

TEST_CASE("recompute none, full and selective are bit-identical") {
  scratch_dir tmp("rt_recompute");
  auto base = pipeline_config(tmp, 2);
  auto ref = actors_run(base);
  for (auto mode : {core::recompute_mode::full, core::recompute_mode::selective}) {
    auto cfg = base;
    cfg.recompute.mode = mode;
    check_identical(actors_run(cfg), ref);
  }
}

TEST_CASE("zero_stage 0, 1 and 2 are bit-identical") {
  scratch_dir tmp("rt_zero");
  auto base = pipeline_config(tmp, 2, 2);
  auto ref = actors_run(base);
  for (int z : {1, 2}) {
    INFO("zero_stage ", z);
    auto cfg = base;
    cfg.optimizer.zero_stage = z;
    check_identical(actors_run(cfg), ref);
  }
}

TEST_CASE("training 2k steps equals training k, resuming and training k more") {
  scratch_dir tmp("rt_resume");
  auto cfg = pipeline_config(tmp, 2, 2);
  cfg.optimizer.zero_stage = 1;
  auto whole = actors_run(cfg);
  check_identical(resumed_run(cfg, tmp / "run2", 2), whole);
}

TEST_CASE("data_parallel 1, 2 and 4 at the same global batch agree within 1e-5") {
  scratch_dir tmp("rt_dp");
  auto cfg1 = pipeline_config(tmp, 2, 1);
  cfg1.parallel.micro_batch_num = 4;
  auto ref = actors_run(cfg1);
  for (int dp : {2, 4}) {
    auto cfg = pipeline_config(tmp, 2, dp);
    cfg.parallel.micro_batch_num = 4 / dp;
    if (cfg.parallel.micro_batch_num < 2) cfg.schedule.name = "gpipe";
    auto o = actors_run(cfg);
    REQUIRE(o.losses.size() == ref.losses.size());
    for (std::size_t i = 0; i < o.losses.size(); ++i) {
      INFO("dp ", dp, " step ", i);
      CHECK(std::fabs(o.losses[i] - ref.losses[i]) <= 1e-5 * std::fabs(ref.losses[i]));
    }
  }
}

TEST_CASE("instruction data: splits and schedules stay bit-identical to the single-rank loop") {
  scratch_dir tmp("rt_masked");
  auto with_rows = [&](core::config c) {
    model::testing::use_instruction_data(c, tmp);
    c.train.eval_interval = 2;
    return c;
  };
  auto oracle = oracle_run(with_rows(pipeline_config(tmp, 1)));
  REQUIRE(oracle.val.has_value());
  for (int pp : {1, 2}) {
    INFO("pipeline_stage ", pp);
    check_identical(actors_run(with_rows(pipeline_config(tmp, pp))), oracle);
  }
  for (std::string name : {"gpipe", "zb_h1"}) {
    INFO("schedule ", name);
    auto cfg = with_rows(pipeline_config(tmp, 2));
    cfg.schedule.name = name;
    cfg.recompute.mode = core::recompute_mode::full;
    check_identical(actors_run(cfg), oracle);
  }
  auto z = with_rows(pipeline_config(tmp, 2, 2));
  z.parallel.micro_batch_num = 2;
  auto z0 = actors_run(z);
  z.optimizer.zero_stage = 2;
  check_identical(actors_run(z), z0);
  // data_parallel 2 at the same global batch: within 1e-5 of the single replica.
  REQUIRE(z0.losses.size() == oracle.losses.size());
  for (std::size_t i = 0; i < z0.losses.size(); ++i) {
    INFO("step ", i);
    CHECK(std::fabs(z0.losses[i] - oracle.losses[i]) <= 1e-5 * std::fabs(oracle.losses[i]));
  }
}

TEST_CASE("packed instruction rows: document starts reach every stage; splits, virtual stages, "
          "schedules and recompute stay bit-identical to the single-rank loop") {
  scratch_dir tmp("rt_packed");
  auto with_rows = [&](core::config c) {
    model::testing::use_instruction_data(c, tmp, true);
    c.train.eval_interval = 2;
    return c;
  };
  auto oracle = oracle_run(with_rows(pipeline_config(tmp, 1)));
  REQUIRE(oracle.val.has_value());
  // The documents matter: the same rows read as one document each train differently.
  {
    auto plain = with_rows(pipeline_config(tmp, 1));
    auto rows = model::instruction_shard::open(plain.data.train);
    REQUIRE(rows.ok());
    std::vector<std::int32_t> ids;
    std::vector<std::uint8_t> mask;
    const int L = rows->layout().row_tokens;
    for (std::size_t r = 0; r < rows->rows(); ++r)
      for (int t = 0; t < L; ++t) {
        ids.push_back(static_cast<std::int32_t>(rows->token(r, t)));
        mask.push_back(rows->mask(r)[static_cast<std::size_t>(t)]);
      }
    model::row_layout padded = rows->layout();
    padded.packing = false;
    REQUIRE(model::write_instruction_shard(tmp / "as_one.bin", padded, ids, mask).ok());
    plain.data.train = tmp / "as_one.bin";
    plain.data.val = "";
    auto one = oracle_run(plain);
    REQUIRE(one.losses.size() == oracle.losses.size());
    CHECK(one.losses.front() != oracle.losses.front());
  }
  for (int pp : {1, 2}) {
    INFO("pipeline_stage ", pp);
    check_identical(actors_run(with_rows(pipeline_config(tmp, pp))), oracle);
  }
  for (std::string name : {"interleaved_1f1b", "zb_h1", "zb_v"}) {
    INFO("schedule ", name);
    auto cfg = with_rows(pipeline_config(tmp, 2));
    cfg.schedule.name = name;
    if (name == "interleaved_1f1b" || name == "zb_v") cfg.parallel.virtual_pipeline = 2;
    cfg.recompute.mode = core::recompute_mode::full;
    check_identical(actors_run(cfg), oracle);
  }
  auto z = with_rows(pipeline_config(tmp, 2, 2));
  z.parallel.micro_batch_num = 2;
  auto z0 = actors_run(z);
  REQUIRE(z0.losses.size() == oracle.losses.size());
  for (std::size_t i = 0; i < z0.losses.size(); ++i) {
    INFO("step ", i);
    CHECK(std::fabs(z0.losses[i] - oracle.losses[i]) <= 1e-5 * std::fabs(oracle.losses[i]));
  }
  // The same on the GPU: tests/runtime/cuda_runtime_test.cpp.
}

TEST_CASE("a failing stage stops the job naming the actor, rank, step and instruction") {
  scratch_dir tmp("rt_fault");
  auto cfg = pipeline_config(tmp, 2, 2);
  cfg.runtime.fault_inject = "3:1:1B2";  // worker 3 = replica 1, pipeline rank 1
  actors::run_options opt;
  opt.log = nullptr;
  auto r = actors::run_actor_job(cfg, opt);
  REQUIRE_FALSE(r.ok());
  std::string m = r.err().to_string();
  CHECK(m.find("stage(dp=1, pp=1)") != std::string::npos);
  CHECK(m.find("rank 3") != std::string::npos);
  CHECK(m.find("step 1") != std::string::npos);
  CHECK(m.find("1B2") != std::string::npos);
  CHECK(m.find("injected fault") != std::string::npos);
}

TEST_CASE("a non-finite loss stops the job naming the step and micro-batch, before any update") {
  scratch_dir tmp("rt_nan");
  auto cfg = pipeline_config(tmp, 2, 1);
  cfg.optimizer.lr = 1e30;  // the first update sends the weights to infinity
  cfg.train.warmup_steps = 0;
  cfg.train.grad_clip = 0;
  actors::run_options opt;
  opt.log = nullptr;
  auto r = actors::run_actor_job(cfg, opt);
  REQUIRE_FALSE(r.ok());
  std::string m = r.err().to_string();
  CHECK((m.find("the loss is NaN") != std::string::npos ||
         m.find("the loss is infinite") != std::string::npos));
  CHECK(m.find("step 1, micro-batch 0") != std::string::npos);
  CHECK(m.find("not updated") != std::string::npos);
}
