// The coordinator's engine driven directly, without CAF (as the stage actor's engine is driven by
// its host): its phases through a step, the run policy's cadence of checkpoints and metrics, and
// every way it stops a job — a non-finite loss, an actor's failure, a lost process, the watchdog,
// and an evaluation whose validation shard holds a token id outside the vocabulary — and step
// forensics: the shards forget a suspicious step, it runs again, and the same or other bits decide.
#include "actors/coordinator_engine.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <variant>

#include "model/params.hpp"
#include "model/shards.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace {

using namespace troupe;
using namespace troupe::actors;
using model::testing::scratch_dir;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

core::config engine_config(const scratch_dir& tmp) {
  auto cfg = model::testing::tiny_run(tmp);
  cfg.parallel.pipeline_stage = 2;
  cfg.train.steps = 2;
  cfg.train.eval_interval = 0;
  return cfg;
}

coordinator_plan steps(int first, int end) {
  coordinator_plan p;
  p.first_step = first;
  p.end_step = end;
  return p;
}

job_layout two_stages() {
  job_layout l;
  l.pp = 2;
  l.microbatches = 2;
  return l;
}

std::vector<std::int64_t> norm_words(double sumsq) {
  core::exact_sum s;
  s.add(sumsq);
  return {std::begin(s.words), std::end(s.words)};
}

// One step's messages from every stage and shard of the two-stage layout, up to the decision.
void gather(coordinator_engine& e, std::int64_t step, std::vector<double> losses) {
  e.on_loss(loss_report{step, 0, std::move(losses)});
  e.on_norm(norm_part{step, 0, 0, norm_words(0.25), ""});
  e.on_norm(norm_part{step, 1, 0, norm_words(0.75), ""});
}

void report(coordinator_engine& e, std::int64_t step) {
  for (int p = 0; p < 2; ++p) {
    stage_report r;
    r.step = step;
    r.pp = p;
    r.events = {trace_event{"0F0", event_cat::compute, 0, 10}};
    e.on_stage_report(std::move(r));
    e.on_shard_report(shard_report{step, p, 0, 1024, 0});
  }
}

template <class T>
const T* command(const std::vector<coordinator_command>& cs, std::size_t i) {
  REQUIRE(i < cs.size());
  return std::get_if<T>(&cs[i]);
}

std::string error_of(const coordinator_engine& e) {
  REQUIRE(e.phase() == coordinator_phase::stopped);
  REQUIRE(e.outcome().has_value());
  REQUIRE_FALSE(e.outcome()->ok());
  return e.outcome()->err().to_string();
}

}  // namespace

TEST_CASE("a step goes gathering, updating, then the next step; the last waits for its checkpoint") {
  scratch_dir tmp("ce_steps");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr);
  CHECK(e.phase() == coordinator_phase::idle);
  e.start();
  auto cs = e.take_commands();
  REQUIRE(cs.size() == 1);
  REQUIRE(command<begin_step_cmd>(cs, 0));
  CHECK(command<begin_step_cmd>(cs, 0)->step == 0);
  CHECK(e.phase() == coordinator_phase::gathering);

  // The decision needs every replica's losses and every chunk's norm sum.
  e.on_loss(loss_report{0, 0, {64.0, 32.0}});
  e.on_norm(norm_part{0, 0, 0, norm_words(0.25), ""});
  CHECK(e.take_commands().empty());
  e.on_norm(norm_part{0, 1, 0, norm_words(0.75), ""});
  cs = e.take_commands();
  REQUIRE(cs.size() == 1);
  const clip_decision* d = command<clip_decision>(cs, 0);
  REQUIRE(d);
  CHECK(d->step == 0);
  CHECK(d->lr == model::learning_rate(cfg.optimizer, cfg.train, 0));
  CHECK(d->adam_step == 1);
  CHECK_FALSE(d->skip);
  CHECK(e.phase() == coordinator_phase::updating);

  report(e, 0);
  cs = e.take_commands();  // step 1 of 2: no checkpoint (checkpoint.interval 0), no evaluation
  REQUIRE(cs.size() == 1);
  REQUIRE(command<begin_step_cmd>(cs, 0));
  CHECK(command<begin_step_cmd>(cs, 0)->step == 1);
  CHECK(e.phase() == coordinator_phase::gathering);

  gather(e, 1, {16.0, 16.0});
  e.take_commands();
  report(e, 1);
  cs = e.take_commands();  // the last step: a checkpoint, the stages' snapshot first
  REQUIRE(cs.size() == 2);
  REQUIRE(command<snapshot_cmd>(cs, 0));
  CHECK(command<snapshot_cmd>(cs, 0)->dests == to_writer);
  REQUIRE(command<checkpoint_cmd>(cs, 1));
  CHECK(command<checkpoint_cmd>(cs, 1)->step == 1);
  CHECK(e.phase() == coordinator_phase::finishing);
  CHECK_FALSE(e.outcome().has_value());

  e.on_checkpoint(checkpoint_written{1, tmp / "ckpt", ""});
  REQUIRE(e.phase() == coordinator_phase::stopped);
  REQUIRE(e.outcome().has_value());
  REQUIRE(e.outcome()->ok());
  const auto& s = e.outcome()->value();
  const double tokens = 2.0 * cfg.parallel.micro_batch_size * cfg.model.seq_length;
  REQUIRE(s.losses.size() == 2);
  CHECK(s.losses[0] == 96.0 / tokens);
  CHECK(s.losses[1] == 32.0 / tokens);
  CHECK(s.grad_norms[0] == std::sqrt(1.0));
  CHECK(s.checkpoint == tmp / "ckpt");
  CHECK(s.end_step == 2);
  // One metrics line per step, with the stages' fields.
  const auto metrics = model::testing::file_bytes(cfg.runtime.run_dir + "/metrics.jsonl");
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 2);
  CHECK(has(metrics, "\"bubble\":"));
  CHECK(has(metrics, "\"stages\":[{"));
}

TEST_CASE("a failed checkpoint write stops the job naming the step") {
  scratch_dir tmp("ce_ckpt");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(1, 2), nullptr);
  e.start();
  gather(e, 1, {1.0, 1.0});
  report(e, 1);
  e.on_checkpoint(checkpoint_written{1, "", "disk full"});
  const auto m = error_of(e);
  CHECK(has(m, "the checkpoint of step 2 could not be written: disk full"));
}

TEST_CASE("a non-finite loss stops the job before any decision is sent") {
  scratch_dir tmp("ce_nan");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr);
  e.start();
  e.take_commands();
  gather(e, 0, {1.0, std::nan("")});
  CHECK(e.take_commands().empty());
  const auto m = error_of(e);
  CHECK(has(m, "the loss is NaN at step 0, micro-batch 1 (replica 0)"));
  CHECK(has(m, "not updated"));
}

TEST_CASE("an actor's failure stops the job naming actor, rank, step and instruction") {
  scratch_dir tmp("ce_fail");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr);
  e.start();
  CHECK_FALSE(e.on_failure(actor_failure{"stage(dp=0, pp=1)", 1, 0, "1B1", "boom"}, false));
  const auto m = error_of(e);
  CHECK(has(m, "stage(dp=0, pp=1) (rank 1) at step 0, instruction 1B1 failed: boom"));
  CHECK(e.outcome()->err().where.rank == 1);
}

TEST_CASE("across processes a survivor's failure waits for the dead process's down message") {
  scratch_dir tmp("ce_lost");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr);
  e.start({{0, "hostA"}, {1, "hostB"}});
  e.on_heartbeat(worker_heartbeat{1, 4242, "stage(dp=0, pp=1) (rank 1) step 0 at 1F0: computing"});
  CHECK(e.on_failure(actor_failure{"stage(dp=0, pp=0)", 0, 0, "0RECV_B0", "connection lost"}, true));
  CHECK(e.phase() == coordinator_phase::gathering);
  e.on_down(address{role::stage, 0, 1}, true, "remote_link_unreachable");
  e.on_deferred_timeout();
  const auto m = error_of(e);
  CHECK(has(m, "worker rank 1 (host hostB, pid 4242) died or became unreachable during step 0"));
  CHECK(has(m, "its last report"));
  CHECK(has(m, "1F0: computing"));
  CHECK_FALSE(has(m, "connection lost"));
}

TEST_CASE("an actor that stops without a report is named") {
  scratch_dir tmp("ce_down");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr);
  e.start();
  e.on_down(address{role::shard, 1, 0}, false, "runtime_error");
  CHECK(has(error_of(e), "optimizer_shard(pp=1, part=0) stopped unexpectedly during step 0"));
}

TEST_CASE("the watchdog asks the stages after the limit and then stops with their answers") {
  scratch_dir tmp("ce_watch");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr,
                       std::chrono::seconds(60));
  e.start();
  const auto now = coordinator_engine::clock::now();
  CHECK(e.on_tick(now + std::chrono::seconds(1)) == watchdog_action::wait);
  CHECK(e.on_tick(now + std::chrono::seconds(61)) == watchdog_action::ask);
  CHECK(e.phase() == coordinator_phase::gathering);
  e.hang_line("stage(dp=0, pp=1) (rank 1) step 0 at 1RECV_F0: waiting for 1RECV_F0<-0");
  e.on_tick(now + std::chrono::seconds(64));
  const auto m = error_of(e);
  CHECK(has(m, "at step 0; who waits on whom:"));
  CHECK(has(m, "\n    stage(dp=0, pp=1) (rank 1) step 0 at 1RECV_F0"));
}

TEST_CASE("evaluation: zero weights give ln(vocab); a token id out of range stops the job naming the shard") {
  scratch_dir tmp("ce_eval");
  auto cfg = engine_config(tmp);
  cfg.train.steps = 1;
  // Every snapshot parameter zero: every logit is 0, so the loss is ln(V) at every position.
  auto run_eval = [&](const std::string& val_path) {
    coordinator_plan plan = steps(0, 1);
    auto val = model::loader::open(val_path, model::loader_options::from(cfg));
    REQUIRE(val.ok());
    plan.val = std::make_shared<model::loader>(std::move(val.value()));
    auto e = std::make_unique<coordinator_engine>(cfg, two_stages(), plan, nullptr);
    e->start();
    gather(*e, 0, {1.0, 1.0});
    report(*e, 0);
    auto cs = e->take_commands();
    REQUIRE(command<snapshot_cmd>(cs, cs.size() - 2));
    CHECK(command<snapshot_cmd>(cs, cs.size() - 2)->dests == (to_writer | to_coordinator));
    CHECK(e->phase() == coordinator_phase::evaluating);
    const auto specs = model::partition(cfg.model, 2);
    for (int c = 0; c < 2; ++c)
      e->on_snapshot(c, core::tensor::zeros({model::flat_numel(model::define_params(cfg.model, specs[c]))}));
    return e;
  };
  {
    auto e = run_eval(cfg.data.val);
    CHECK(e->phase() == coordinator_phase::finishing);  // the checkpoint is still being written
    e->on_checkpoint(checkpoint_written{0, tmp / "ckpt", ""});
    REQUIRE(e->outcome().has_value());
    REQUIRE(e->outcome()->ok());
    REQUIRE(e->outcome()->value().final_val_loss.has_value());
    CHECK(*e->outcome()->value().final_val_loss == doctest::Approx(std::log(64.0)).epsilon(1e-6));
  }
  {
    const std::string bad = tmp / "val_bad.bin";
    REQUIRE(model::write_shard(bad, std::vector<std::uint16_t>(4000, 99)).ok());
    auto e = run_eval(bad);
    const auto m = error_of(*e);
    CHECK(has(m, "coordinator (rank 0) at step 0, instruction evaluation failed: token id 99"));
    CHECK(has(m, "val_bad.bin"));
    CHECK(has(m, "model.vocab_size 64"));
  }
}

namespace {

std::string read_log(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  for (int c; (c = std::fgetc(f)) != EOF;) out += static_cast<char>(c);
  return out;
}

const char* const culprit =
    "NaN in the gradient of h.1.mlp.c_fc.weight (element 3 of it; chunk 1) from stage(dp=0, pp=1) (rank 1)";

}  // namespace

TEST_CASE("a non-finite gradient norm stops the job naming whose gradient the shard found it in") {
  scratch_dir tmp("ce_nan_grad");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr);
  e.start();
  e.take_commands();
  e.on_loss(loss_report{0, 0, {1.0, 1.0}});
  e.on_norm(norm_part{0, 0, 0, norm_words(0.25), ""});
  e.on_norm(norm_part{0, 1, 0, norm_words(std::nan("")), culprit});
  CHECK(e.take_commands().empty());
  const auto m = error_of(e);
  CHECK(has(m, "the gradient norm is NaN at step 0: " + std::string(culprit) +
                   "; the parameters were not updated"));
}

TEST_CASE("under dynamic loss scaling a non-finite gradient skips the step, saying whose it was") {
  scratch_dir tmp("ce_nan_skip");
  auto cfg = engine_config(tmp);
  cfg.precision.dynamic_loss_scale = true;
  std::FILE* log = std::tmpfile();
  REQUIRE(log);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), log);
  e.start();
  e.take_commands();
  e.on_loss(loss_report{0, 0, {1.0, 1.0}});
  e.on_norm(norm_part{0, 0, 0, norm_words(0.25), ""});
  e.on_norm(norm_part{0, 1, 0, norm_words(std::nan("")), culprit});
  auto cs = e.take_commands();
  REQUIRE(cs.size() == 1);
  REQUIRE(command<clip_decision>(cs, 0));
  CHECK(command<clip_decision>(cs, 0)->skip);
  report(e, 0);
  CHECK(e.phase() == coordinator_phase::gathering);  // step 1 goes on
  const auto text = read_log(log);
  CHECK_MESSAGE(has(text, "the gradient is not finite at step 0: " + std::string(culprit) +
                              "; the step is skipped (dynamic loss scaling), loss scale 65536 -> 32768"),
                text);
  const auto metrics = model::testing::file_bytes(cfg.runtime.run_dir + "/metrics.jsonl");
  CHECK(has(metrics, "\"skipped\":true"));
  CHECK(has(metrics, "\"nonfinite\":\"" + std::string(culprit) + "\""));
  std::fclose(log);
}

TEST_CASE("the watchdog counts a stage that moved on as progress, and withdraws its question when something moved") {
  scratch_dir tmp("ce_watch_slow");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr, std::chrono::seconds(60));
  e.start({{0, "hostA"}, {1, "hostB"}});
  const auto t0 = coordinator_engine::clock::now();
  const std::string at_f0 = "stage(dp=0, pp=1) (rank 1) step 0 at 1F0: computing";
  const std::string at_f1 = "stage(dp=0, pp=1) (rank 1) step 0 at 1F1: computing";
  e.on_heartbeat(worker_heartbeat{1, 42, at_f0}, t0 + std::chrono::seconds(1));
  e.on_heartbeat(worker_heartbeat{1, 42, at_f1}, t0 + std::chrono::seconds(50));
  CHECK(e.on_tick(t0 + std::chrono::seconds(70)) == watchdog_action::wait);  // moved 20 s ago
  // The same line again is no progress: after 60 s the stages are asked...
  e.on_heartbeat(worker_heartbeat{1, 42, at_f1}, t0 + std::chrono::seconds(100));
  CHECK(e.on_tick(t0 + std::chrono::seconds(111)) == watchdog_action::ask);
  // ...and a stage that moves on before the answer is due withdraws the question.
  e.on_heartbeat(worker_heartbeat{1, 42, at_f0 + " "}, t0 + std::chrono::seconds(112));
  CHECK(e.on_tick(t0 + std::chrono::seconds(114)) == watchdog_action::wait);
  CHECK(e.phase() == coordinator_phase::gathering);
  // Nothing moves any more: asked again, then stopped with the answers of that question only.
  CHECK(e.on_tick(t0 + std::chrono::seconds(173)) == watchdog_action::ask);
  e.hang_line("stage(dp=0, pp=1) (rank 1) step 0 at 1RECV_F0: waiting for 1RECV_F0<-0");
  e.on_tick(t0 + std::chrono::seconds(176));
  const auto m = error_of(e);
  CHECK(has(m, "who waits on whom:\n    stage(dp=0, pp=1) (rank 1) step 0 at 1RECV_F0"));
}

TEST_CASE("a heartbeat of a stage blocked in a tensor-parallel collective answers for it, with the time waited, "
          "while it is fresh; the same wait again is no progress") {
  scratch_dir tmp("ce_watch_tp");
  const auto cfg = engine_config(tmp);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr, std::chrono::seconds(60));
  e.start({{0, "hostA"}, {1, "hostB"}});
  const auto t0 = coordinator_engine::clock::now();
  const std::string blocked =
      "stage(dp=0, pp=1, tp=0) (rank 1): blocked in the tensor-parallel all_gather (collective 2 of "
      "forward) of layer 1, micro-batch 3, step 0: waiting to receive from rank 0 (stage(dp=0, pp=0, tp=0))";
  CHECK(e.blocked_line(1, t0).empty());  // no heartbeat yet
  e.on_heartbeat(worker_heartbeat{1, 42, "stage(dp=0, pp=1) (rank 1) step 0 at 1F0: computing"}, t0);
  CHECK(e.blocked_line(1, t0 + std::chrono::seconds(1)).empty());  // it answered itself
  e.on_heartbeat(worker_heartbeat{1, 42, blocked, 1500}, t0 + std::chrono::seconds(10));
  // Waited 1.5 s when its worker wrote, 2 s more since.
  CHECK(e.blocked_line(1, t0 + std::chrono::seconds(12)) == blocked + " for 3.5 s");
  // The same wait, a second later: no progress, so the watchdog asks after its limit.
  e.on_heartbeat(worker_heartbeat{1, 42, blocked, 2500}, t0 + std::chrono::seconds(11));
  CHECK(e.on_tick(t0 + std::chrono::seconds(71)) == watchdog_action::ask);
  // A heartbeat older than 3 s says nothing about now.
  CHECK(e.blocked_line(1, t0 + std::chrono::seconds(15)).empty());
  CHECK(e.blocked_line(0, t0 + std::chrono::seconds(12)).empty());  // another rank's
}

TEST_CASE("a replica computing far longer than the others of its pipeline stage is reported as a straggler with its skew") {
  scratch_dir tmp("ce_skew");
  const auto cfg = engine_config(tmp);
  job_layout two_replicas;
  two_replicas.dp = 2;
  two_replicas.microbatches = 2;
  std::FILE* log = std::tmpfile();
  REQUIRE(log);
  coordinator_engine e(cfg, two_replicas, steps(0, 2), log);
  e.start();
  for (std::int64_t step = 0; step < 2; ++step) {
    e.on_loss(loss_report{step, 0, {1.0, 1.0}});
    e.on_loss(loss_report{step, 1, {1.0, 1.0}});
    e.on_norm(norm_part{step, 0, 0, norm_words(0.25), ""});
    for (int d = 0; d < 2; ++d) {
      stage_report r;
      r.step = step;
      r.dp = d;
      r.busy_s = d == 1 ? 2.5 : 0.5;  // replica 1 is five times slower
      e.on_stage_report(std::move(r));
      e.on_shard_report(shard_report{step, 0, d, 1024, 0});
    }
    if (step == 1) e.on_checkpoint(checkpoint_written{1, tmp / "ckpt", ""});
  }
  REQUIRE(e.outcome().has_value());
  REQUIRE(e.outcome()->ok());
  const auto text = read_log(log);
  CHECK_MESSAGE(has(text, "straggler at step 0: stage(dp=1, pp=0) (rank 1) computed for 2.500 s, "
                          "5.0x the median 0.500 s of the other replicas of pipeline stage 0"),
                text);
  CHECK_FALSE(has(text, "straggler at step 1"));  // once per straggler
  const auto metrics = model::testing::file_bytes(cfg.runtime.run_dir + "/metrics.jsonl");
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 2);
  size_t n = 0;
  for (auto at = metrics.find("\"skew\":{\"rank\":1,\"ratio\":5.000,\"busy_s\":2.500000,\"median_busy_s\":0.500000}");
       at != std::string::npos; at = metrics.find("\"skew\":{\"rank\":1,", at + 1))
    ++n;
  CHECK(n == 2);
  std::fclose(log);
}

TEST_CASE("step forensics: a step whose re-execution gives the same bits stops naming its sequence; "
          "shards forget first, then the step runs again") {
  scratch_dir tmp("ce_forensics_same");
  auto cfg = engine_config(tmp);
  cfg.runtime.forensics = "stop";
  coordinator_engine e(cfg, two_stages(), steps(0, 2), nullptr);
  e.start();
  e.take_commands();
  const double nan = std::nan("");
  auto execute = [&](std::vector<double> seqs) {
    e.on_loss(loss_report{0, 0, {nan, 1.0}, std::move(seqs)});
    e.on_norm(norm_part{0, 0, 0, norm_words(0.25), "", 7});
    e.on_norm(norm_part{0, 1, 0, norm_words(0.75), "", 9});
  };
  execute({});
  auto cs = e.take_commands();
  REQUIRE(cs.size() == 1);
  REQUIRE(command<forget_cmd>(cs, 0));
  CHECK(e.phase() == coordinator_phase::reexecuting);
  e.on_forgotten(0, 0, 0);
  CHECK(e.take_commands().empty());  // one shard of two
  e.on_forgotten(0, 1, 0);
  cs = e.take_commands();
  REQUIRE(cs.size() == 1);
  REQUIRE(command<reexecute_cmd>(cs, 0));
  CHECK(e.phase() == coordinator_phase::gathering);
  execute({0.5, nan, 0.5, 0.5});  // sequence 1 = row 1 of micro-batch 0
  CHECK(e.take_commands().empty());  // no decision: stopped
  const auto m = error_of(e);
  CHECK(has(m, "step forensics: step 0 is deterministic: the loss is NaN at step 0, micro-batch 0 "
               "(replica 0)"));
  CHECK(has(m, "micro-batch 0 of replica 0, global sequence 1 (row 1 of the micro-batch): mean loss NaN"));
}

TEST_CASE("step forensics: a step whose re-execution gives other bits is transient and decided from "
          "the re-execution") {
  scratch_dir tmp("ce_forensics_other");
  auto cfg = engine_config(tmp);
  cfg.runtime.forensics = "stop";
  std::FILE* log = std::tmpfile();
  REQUIRE(log);
  coordinator_engine e(cfg, two_stages(), steps(0, 2), log);
  e.start();
  e.take_commands();
  e.on_loss(loss_report{0, 0, {1.0, 1.0}});
  e.on_norm(norm_part{0, 0, 0, norm_words(0.25), "", 7});
  e.on_norm(norm_part{0, 1, 0, norm_words(nan("")), culprit, 9});
  REQUIRE(command<forget_cmd>(e.take_commands(), 0));
  e.on_forgotten(0, 0, 0);
  e.on_forgotten(0, 1, 0);
  REQUIRE(command<reexecute_cmd>(e.take_commands(), 0));
  e.on_loss(loss_report{0, 0, {1.0, 1.0}, {0.5, 0.5, 0.5, 0.5}});
  e.on_norm(norm_part{0, 0, 0, norm_words(0.25), "", 7});
  e.on_norm(norm_part{0, 1, 0, norm_words(0.75), "", 10});
  auto cs = e.take_commands();
  REQUIRE(cs.size() == 1);
  REQUIRE(command<clip_decision>(cs, 0));
  CHECK_FALSE(command<clip_decision>(cs, 0)->skip);
  CHECK(e.phase() == coordinator_phase::updating);
  const auto text = read_log(log);
  CHECK(has(text, "step forensics: step 0 is transient: the gradient is not finite at step 0: " +
                      std::string(culprit)));
  CHECK(has(text, "the re-execution's result stands"));
}
