// Step forensics in the actor runtime (runtime.forensics, model/forensics.hpp): a suspicious step
// is executed again from the state before it. A bad sequence injected with TROUPE_FAULT's poison
// (every execution of its step) is found deterministic and named by its position in the token
// shard — checked against the shard file's own bytes — and the job stops or skips the step; a
// one-off NaN (TROUPE_FAULT's nan, which fires once) is found transient, the step is retried, and
// the run ends with the bits of a clean run. Real actors in one process, real files.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fault.hpp"
#include "model/loader.hpp"
#include "model/shards.hpp"
#include "tests/runtime/forensics_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

using namespace troupe;
using namespace troupe::runtime_test;
using model::testing::scratch_dir;

namespace {

/// Where global sequence k of `step` lies by the shard file's own bytes: the loader's cut of its
/// micro-batch must hold, in its row, the T tokens that follow `offset` in `path`.
void check_position(const core::config& cfg, std::int64_t step, std::int64_t k,
                    const std::string& path, std::uint64_t offset) {
  auto data = model::loader::open(cfg.data.train, model::loader_options::from(cfg));
  REQUIRE(data.ok());
  const int B = cfg.parallel.micro_batch_size, M = data->options().micro_batches;
  const int T = cfg.model.seq_length;
  const model::batch b = data->cut(static_cast<std::uint64_t>(step), static_cast<int>(k / B / M),
                                   static_cast<int>(k / B % M));
  auto file = model::shard::open(path);
  REQUIRE(file.ok());
  for (int t = 0; t < T; ++t) {
    INFO("token ", t);
    CHECK(b.tokens.data<std::int32_t>()[(k % B) * T + t] ==
          static_cast<std::int32_t>(file->id(offset + static_cast<std::uint64_t>(t))));
  }
}

}  // namespace

TEST_CASE("forensics: a poisoned sequence is deterministic, named by micro-batch and shard "
          "position, and stops the job") {
  scratch_dir tmp("fx_stop");
  auto cfg = pipeline_config(tmp, 2, 2);  // B = 2, 4 micro-batches per replica
  cfg.runtime.forensics = "stop";
  actors::run_options opt;
  opt.log = nullptr;
  opt.fault = fault("poison:2:11");  // replica 1 (sequences 8..15), micro-batch 1, row 1
  auto r = actors::run_actor_job(cfg, opt);
  REQUIRE_FALSE(r.ok());
  const std::string m = r.err().to_string();
  MESSAGE(m);
  CHECK(m.find("step forensics: step 2 is deterministic") != std::string::npos);
  CHECK(m.find("the loss is NaN at step 2, micro-batch 1 (replica 1)") != std::string::npos);
  CHECK(m.find("micro-batch 1 of replica 1, global sequence 11 (row 1 of the micro-batch): mean "
               "loss NaN") != std::string::npos);
  CHECK(m.find("the parameters were not updated") != std::string::npos);

  const auto records = forensics_records(cfg);
  REQUIRE(records.size() == 1);
  const auto& f = records[0];
  CHECK(f["step"] == 2);
  CHECK(f["verdict"] == "deterministic");
  CHECK(f["action"] == "stop");
  CHECK(f["executions"] == 2);
  CHECK(f["first"] == f["again"]);
  REQUIRE(f["sequences"].size() == 1);
  const auto& s = f["sequences"][0];
  CHECK(s["sequence"] == 11);
  CHECK(s["replica"] == 1);
  CHECK(s["micro_batch"] == 1);
  const std::string path = s["shard"];
  const std::uint64_t offset = s["offset"];
  CHECK(m.find("from " + path + " token offset " + std::to_string(offset)) != std::string::npos);
  check_position(cfg, 2, 11, path, offset);
}

TEST_CASE("forensics: with runtime.forensics = \"skip\" the poisoned step is skipped and the run "
          "goes on") {
  scratch_dir tmp("fx_skip");
  auto cfg = pipeline_config(tmp, 2, 1);
  cfg.runtime.forensics = "skip";
  actors::run_options opt;
  opt.log = nullptr;
  opt.fault = fault("poison:1:3");  // micro-batch 1, row 1
  auto skipped = actors_run(cfg, opt);
  REQUIRE(skipped.losses.size() == 4);
  CHECK(std::isnan(skipped.losses[1]));
  for (int s : {0, 2, 3}) CHECK(std::isfinite(skipped.losses[static_cast<std::size_t>(s)]));
  const auto records = forensics_records(cfg);
  REQUIRE(records.size() == 1);
  CHECK(records[0]["step"] == 1);
  CHECK(records[0]["verdict"] == "deterministic");
  CHECK(records[0]["action"] == "skip");
  CHECK(records[0]["sequences"][0]["sequence"] == 3);
  CHECK(records[0]["sequences"][0]["micro_batch"] == 1);
  // Skipped means no update: step 2 then starts from the parameters step 1 started from, so its
  // loss differs from a clean run's step 2 while step 0's is the same.
  scratch_dir tmp2("fx_skip_clean");
  auto clean_cfg = pipeline_config(tmp2, 2, 1);
  auto clean = actors_run(clean_cfg);
  CHECK(std::memcmp(&clean.losses[0], &skipped.losses[0], sizeof(double)) == 0);
  CHECK(clean.losses[2] != skipped.losses[2]);
}

TEST_CASE("forensics: a one-off NaN in one rank's gradient is transient, retried, and the run ends "
          "with a clean run's bits") {
  scratch_dir tmp("fx_transient");
  auto cfg = pipeline_config(tmp, 2, 2);
  auto clean = actors_run(cfg);  // runtime.forensics off
  scratch_dir tmp2("fx_transient_nan");
  auto faulty_cfg = pipeline_config(tmp2, 2, 2);
  faulty_cfg.runtime.forensics = "stop";
  actors::run_options opt;
  opt.fault = fault("nan:3:2");  // worker 3 = replica 1, pipeline rank 1, once
  auto faulty = actors_run(faulty_cfg, opt);
  check_same_losses_and_tensors(faulty, clean);
  const auto records = forensics_records(faulty_cfg);
  REQUIRE(records.size() == 1);
  CHECK(records[0]["step"] == 2);
  CHECK(records[0]["verdict"] == "transient");
  CHECK(records[0]["action"] == "retry");
  CHECK(records[0]["first"] != records[0]["again"]);
  CHECK(records[0]["why"].get<std::string>().find("the gradient is not finite at step 2") == 0);
}

TEST_CASE("forensics: a loss jump past runtime.forensics_loss_jump is looked into the same way") {
  scratch_dir tmp("fx_jump");
  auto cfg = pipeline_config(tmp, 2, 1);
  cfg.train.steps = 5;
  cfg.runtime.forensics = "skip";
  cfg.runtime.forensics_loss_jump = 3;
  actors::run_options opt;
  opt.log = nullptr;
  // A finite loss of 1e4 on one target: the step's mean loss jumps far above the median of the
  // three steps before it (the first step with a reference).
  opt.fault = fault("poison:3:6:1e4");
  auto r = actors_run(cfg, opt);
  REQUIRE(r.losses.size() == 5);
  const auto records = forensics_records(cfg);
  REQUIRE(records.size() == 1);
  const auto& f = records[0];
  CHECK(f["step"] == 3);
  CHECK(f["verdict"] == "deterministic");
  CHECK(f["action"] == "skip");
  CHECK(f["why"].get<std::string>().find("runtime.forensics_loss_jump = 3") != std::string::npos);
  REQUIRE(f["sequences"].size() == 1);
  CHECK(f["sequences"][0]["sequence"] == 6);
  CHECK(f["sequences"][0]["micro_batch"] == 3);
  check_position(cfg, 3, 6, f["sequences"][0]["shard"], f["sequences"][0]["offset"]);
  // Without the threshold the same run takes the step.
  scratch_dir tmp2("fx_nojump");
  auto plain = pipeline_config(tmp2, 2, 1);
  plain.train.steps = 5;
  plain.runtime.forensics = "skip";
  auto taken = actors_run(plain, opt);
  CHECK(forensics_records(plain).empty());
  CHECK(std::memcmp(&taken.losses[3], &r.losses[3], sizeof(double)) == 0);  // the same step 3
  CHECK(taken.losses[4] != r.losses[4]);  // but it was applied there, skipped here
}

TEST_CASE("forensics: the single-rank loop names the same sequences and positions as the actor "
          "runtime and stops") {
  scratch_dir tmp("fx_single");
  auto cfg = pipeline_config(tmp, 2, 1);
  cfg.runtime.forensics = "stop";
  actors::run_options opt;
  opt.log = nullptr;
  opt.fault = fault("poison:2:5");
  auto actors = actors::run_actor_job(cfg, opt);
  REQUIRE_FALSE(actors.ok());
  scratch_dir tmp2("fx_single_loop");
  auto single_cfg = pipeline_config(tmp2, 2, 1);
  single_cfg.runtime.forensics = "stop";
  model::train_options sopt;
  sopt.log = nullptr;
  sopt.fault = opt.fault;
  auto single = model::train_single_rank(single_cfg, sopt);
  REQUIRE_FALSE(single.ok());
  const std::string a = actors.err().to_string(), s = single.err().to_string();
  MESSAGE(s);
  CHECK(s.find("step forensics: step 2 is deterministic: the loss is NaN at step 2, micro-batch 2 "
               "(replica 0)") != std::string::npos);
  // The same sequences at the same positions (the fingerprints' gradient part differs: one hash
  // per shard slice there, per chunk here); the scratch directories differ only in their names.
  auto tail = [](const std::string& m, const std::string& dir) {
    std::string t = m.substr(m.find("the sequences:"));
    for (auto at = t.find(dir); at != std::string::npos; at = t.find(dir)) t.replace(at, dir.size(), "DIR");
    return t;
  };
  CHECK(tail(s, tmp2.path.string()) == tail(a, tmp.path.string()));
  const auto records = forensics_records(single_cfg);
  REQUIRE(records.size() == 1);
  CHECK(records[0]["verdict"] == "deterministic");
  CHECK(records[0]["sequences"][0]["sequence"] == 5);
  check_position(single_cfg, 2, 5, records[0]["sequences"][0]["shard"],
                 records[0]["sequences"][0]["offset"]);
}

TEST_CASE("forensics: the single-rank loop retries a one-off NaN as transient and ends with a clean "
          "run's bits") {
  scratch_dir tmp("fx_single_nan");
  auto cfg = pipeline_config(tmp, 1, 1);
  auto clean = oracle_run(cfg);  // forensics off: the device step
  scratch_dir tmp2("fx_single_nan2");
  auto faulty_cfg = pipeline_config(tmp2, 1, 1);
  faulty_cfg.runtime.forensics = "skip";
  model::train_options opt;
  opt.log = nullptr;
  opt.fault = fault("nan:0:1");
  auto faulty = collect(model::train_single_rank(faulty_cfg, opt), faulty_cfg);
  check_same_losses_and_tensors(faulty, clean);
  const auto records = forensics_records(faulty_cfg);
  REQUIRE(records.size() == 1);
  CHECK(records[0]["step"] == 1);
  CHECK(records[0]["verdict"] == "transient");
  CHECK(records[0]["action"] == "retry");
}

TEST_CASE("forensics: its keys are checked") {
  scratch_dir tmp("fx_keys");
  auto cfg = model::testing::tiny_run(tmp);
  auto parse = [&](const std::string& extra) {
    return core::parse_config(core::to_toml(cfg) + extra, "forensics.toml");
  };
  cfg.runtime.forensics = "skip";
  cfg.runtime.forensics_loss_jump = 2;
  CHECK(parse("").ok());
  cfg.runtime.forensics_loss_jump = 1;
  auto low = parse("");
  REQUIRE_FALSE(low.ok());
  CHECK(low.err().to_string().find("runtime.forensics_loss_jump") != std::string::npos);
  cfg.runtime.forensics_loss_jump = 2;
  cfg.runtime.forensics = "off";
  auto off = parse("");
  REQUIRE_FALSE(off.ok());
  CHECK(off.err().to_string().find("runtime.forensics is \"off\"") != std::string::npos);
  cfg.runtime.forensics = "maybe";
  CHECK_FALSE(parse("").ok());
}
