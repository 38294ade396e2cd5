// Recording and deterministic replay (docs/replay.md): a recorded run replays bit for bit, a
// corrupted log line is reported as exactly that message, --until-step and --dump-tensors, resumed
// runs, one worker replayed alone, and runs that cannot be replayed.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "runtime/build.hpp"
#include "actors/recorder.hpp"
#include "kernels/message_hash.hpp"
#include "replay/replay.hpp"
#include "runtime/runtime.hpp"
#include "model/safetensors.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "tests/runtime/runtime_fixture.hpp"

namespace {

using namespace troupe;
namespace fs = std::filesystem;
using model::testing::scratch_dir;

// The runtime tests' 4-layer job, pp=2 × dp=2 unless asked otherwise, recorded.
core::config recorded_config(const scratch_dir& tmp, int pp = 2, int dp = 2) {
  auto cfg = runtime_test::pipeline_config(tmp, pp, dp);
  cfg.runtime.record = true;
  return cfg;
}

void train(const core::config& cfg, actors::run_options opt = {}) {
  opt.log = nullptr;
  auto r = actors::run_actor_job(cfg, opt);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
}

actors::replay_report replay(const std::string& run_dir, actors::replay_options opt = {}) {
  opt.run_dir = run_dir;
  opt.log = nullptr;
  auto r = actors::replay_run(opt);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  return r.value();
}

/// Tensor records of every worker's log with step in [lo, hi).
std::vector<actors::message_record> records(const core::config& cfg, std::int64_t lo = 0,
                                            std::int64_t hi = 1 << 30) {
  std::vector<actors::message_record> out;
  const int workers =
      cfg.parallel.data_parallel * cfg.parallel.pipeline_stage * cfg.parallel.model_parallel;
  for (int w = 0; w < workers; ++w) {
    auto log = actors::read_log(actors::messages_dir(cfg.runtime.run_dir), w);
    REQUIRE_MESSAGE(log.ok(), (log.ok() ? "" : log.err().to_string()));
    for (auto& r : log->records)
      if (r.tag.step >= lo && r.tag.step < hi) out.push_back(r);
  }
  return out;
}

/// The log line of the input gradient worker 1 sent for micro-batch `mb` of `step` (0: none).
int gradient_line_of_worker_1(const core::config& cfg, std::int64_t step, int mb) {
  int line = 0;
  for (const auto& r : records(cfg))
    if (r.src == 1 && r.tag.step == step && r.tag.mb == mb &&
        r.tag.kind == static_cast<std::uint32_t>(actors::tensor_kind::gradient))
      line = r.line;
  return line;
}

/// Replays every worker of the recorded run in cfg alone: each must match and send as many
/// messages as its log holds (snapshots aside). Returns, per worker, how many of them were
/// tensor-parallel collective slices.
std::vector<std::int64_t> check_every_worker_replays_alone(const core::config& cfg) {
  const int workers =
      cfg.parallel.data_parallel * cfg.parallel.pipeline_stage * cfg.parallel.model_parallel;
  const auto all = records(cfg);
  std::vector<std::int64_t> slices(static_cast<std::size_t>(workers), 0);
  for (int rank = 0; rank < workers; ++rank) {
    INFO("rank ", rank);
    actors::replay_options opt;
    opt.rank = rank;
    auto rep = replay(cfg.runtime.run_dir, opt);
    CHECK_MESSAGE(rep.matched, rep.mismatch);
    std::int64_t own = 0;
    for (const auto& r : all)
      if (r.src == rank && r.op != "snapshot" && r.op != "shard snapshot") {
        ++own;
        if (actors::is_tp_kind(r.tag.kind)) ++slices[static_cast<std::size_t>(rank)];
      }
    CHECK(rep.messages == own);
  }
  return slices;
}

/// The activation and gradient records of the run's logs; each must name an instruction of its
/// sender's list in `sched` (the test fails otherwise).
int scheduled_transfers(const core::config& cfg, const schedules::schedule& sched, int pp) {
  int transfers = 0;
  for (const auto& r : records(cfg)) {
    const auto k = static_cast<actors::tensor_kind>(r.tag.kind);
    if (k != actors::tensor_kind::activation && k != actors::tensor_kind::gradient) continue;
    ++transfers;
    bool found = false;
    for (const auto& op : sched.ranks.at(r.src % pp)) found = found || schedules::to_string(op) == r.op;
    CHECK_MESSAGE(found, r.op);
  }
  return transfers;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Replaces the message hash of line `line` (1-based) of `path` by `fake`; returns the original hash.
std::string corrupt_hash(const std::string& path, int line, const std::string& fake) {
  std::istringstream in(slurp(path));
  std::string out, l, original;
  for (int n = 1; std::getline(in, l); ++n) {
    if (n == line) {
      auto at = l.find("\"hash\":\"");
      REQUIRE(at != std::string::npos);
      original = l.substr(at + 8, 16);
      l.replace(at + 8, 16, fake);
    }
    out += l + "\n";
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
  return original;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Sees every tensor a job sends and keeps its message hash under the XXH64 definition (that of
/// logs of format 2), by (sender, receiver, tag).
class xxh64_hashes final : public actors::message_sink {
 public:
  void sent(const actors::message_record& r, const core::tensor& bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    hashes[actors::key_of(r)] = actors::tensor_hash(bytes, kernels::message_hash_def::xxh64);
  }
  std::mutex mu_;
  std::map<actors::message_key, std::uint64_t> hashes;
};

/// Rewrites every worker's log of the run in cfg as a troupe of log format 2 wrote it: format 2
/// in the headers, each record's hash under XXH64 (from `old`, which must know every record).
void downgrade_to_format_2(const core::config& cfg, const xxh64_hashes& old) {
  const int workers = cfg.parallel.data_parallel * cfg.parallel.pipeline_stage;
  for (int w = 0; w < workers; ++w) {
    auto log = actors::read_log(actors::messages_dir(cfg.runtime.run_dir), w);
    REQUIRE(log.ok());
    std::map<int, std::uint64_t> by_line;
    for (const auto& r : log->records) {
      auto it = old.hashes.find(actors::key_of(r));
      REQUIRE_MESSAGE(it != old.hashes.end(), actors::describe(r));
      CHECK(it->second != r.hash);
      by_line[r.line] = it->second;
    }
    const std::string path = actors::messages_dir(cfg.runtime.run_dir) + "/rank_" + std::to_string(w) + ".log";
    std::istringstream in(slurp(path));
    std::string out, l;
    for (int n = 1; std::getline(in, l); ++n) {
      if (auto at = l.find("\"troupe_messages\":3"); at != std::string::npos)
        l.replace(at, 19, "\"troupe_messages\":2");
      if (auto it = by_line.find(n); it != by_line.end()) {
        auto at = l.find("\"hash\":\"");
        REQUIRE(at != std::string::npos);
        l.replace(at + 8, 16, model::safetensors::hex64(it->second));
      }
      out += l + "\n";
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
  }
}

}  // namespace

TEST_CASE("every worker logs one line per tensor it sends, with the instruction and the sampling key") {
  scratch_dir tmp("rp_log");
  auto cfg = recorded_config(tmp);
  train(cfg);
  auto all = records(cfg);
  REQUIRE_FALSE(all.empty());
  const int mbs = cfg.parallel.micro_batch_num, B = cfg.parallel.micro_batch_size;
  int tokens = 0, activations = 0, gradients = 0;
  for (const auto& r : all) {
    using actors::tensor_kind;
    switch (static_cast<tensor_kind>(r.tag.kind)) {
      case tensor_kind::tokens: {
        ++tokens;
        REQUIRE(r.sample.has_value());
        CHECK(r.op == "loader cut");
        CHECK(r.sample->seed == cfg.train.seed);
        CHECK(r.sample->step == r.tag.step);
        const int dp = r.src / cfg.parallel.pipeline_stage;
        CHECK(r.sample->first_seq == (dp * mbs + r.tag.mb) * B);
        CHECK(r.sample->count == B);
        break;
      }
      case tensor_kind::activation:
        ++activations;
        CHECK(r.op == "0SEND_F" + std::to_string(r.tag.mb) + "->1");
        CHECK(r.from == "stage(dp=" + std::to_string(r.src / 2) + ", pp=0)");
        CHECK(r.shape == core::shape_t{B * cfg.model.seq_length, cfg.model.hidden_size});
        break;
      case tensor_kind::gradient:
        ++gradients;
        CHECK(r.op == "1SEND_B" + std::to_string(r.tag.mb) + "->0");
        break;
      default: break;
    }
  }
  // 4 steps × 2 replicas × 4 micro-batches
  CHECK(tokens == 32);
  CHECK(activations == 32);
  CHECK(gradients == 32);
}

TEST_CASE("a recorded pp=2 × dp=2 run replays bit for bit") {
  scratch_dir tmp("rp_whole");
  auto cfg = recorded_config(tmp);
  train(cfg);
  auto rep = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(rep.matched, rep.mismatch);
  CHECK(rep.messages == static_cast<std::int64_t>(records(cfg).size()));
  CHECK(rep.first_step == 0);
  CHECK(rep.steps() == 4);
}

TEST_CASE("a corrupted hash in the log is reported as exactly that message") {
  scratch_dir tmp("rp_corrupt");
  auto cfg = recorded_config(tmp);
  train(cfg);
  // Worker 1 (replica 0, pipeline rank 1): its gradient of micro-batch 2 at step 2.
  const std::string log = actors::messages_dir(cfg.runtime.run_dir) + "/rank_1.log";
  const int line = gradient_line_of_worker_1(cfg, 2, 2);
  REQUIRE(line > 0);
  const std::string original = corrupt_hash(log, line, "0123456789abcdef");
  auto rep = replay(cfg.runtime.run_dir);
  CHECK_FALSE(rep.matched);
  INFO(rep.mismatch);
  CHECK(contains(rep.mismatch, "rank 1, step 2, micro-batch 2, instruction 1SEND_B2->0"));
  CHECK(contains(rep.mismatch, "recorded hash 0123456789abcdef"));
  CHECK(contains(rep.mismatch, "rank_1.log line " + std::to_string(line)));
  CHECK(contains(rep.mismatch, "replayed hash " + original));
}

TEST_CASE("--compare: two runs of one config send the same bits; a changed hash is named with both logs' lines") {
  scratch_dir tmp("rp_compare");
  auto cfg = recorded_config(tmp);
  train(cfg);
  const std::string a = cfg.runtime.run_dir;
  cfg.runtime.run_dir = tmp / "run_b";
  train(cfg);
  const std::string b = cfg.runtime.run_dir;
  auto same = actors::compare_runs(a, b);
  REQUIRE_MESSAGE(same.ok(), (same.ok() ? "" : same.err().to_string()));
  CHECK(same->same);
  CHECK_FALSE(same->configs_differ);
  CHECK(same->messages == static_cast<std::int64_t>(records(cfg).size()));
  CHECK(same->steps == 4);

  // Worker 1's gradient of micro-batch 2 at step 2, changed in run b only.
  const int line = gradient_line_of_worker_1(cfg, 2, 2);
  REQUIRE(line > 0);
  const std::string original =
      corrupt_hash(actors::messages_dir(b) + "/rank_1.log", line, "0123456789abcdef");
  auto diff = actors::compare_runs(a, b);
  REQUIRE(diff.ok());
  CHECK_FALSE(diff->same);
  CHECK(diff->first_step == 2);
  CHECK(diff->differing == 1);
  CHECK(diff->differing_in_first_step == 1);
  REQUIRE(diff->first_differences.size() == 1);
  const std::string& d = diff->first_differences[0];
  INFO(d);
  CHECK(contains(d, "rank 1, step 2, micro-batch 2, instruction 1SEND_B2->0"));
  CHECK(contains(d, "hash " + original));
  CHECK(contains(d, "vs 0123456789abcdef"));
  CHECK(contains(d, "rank_1.log line " + std::to_string(line)));

  // Not a recorded run: refused, naming it.
  auto bad = actors::compare_runs(a, tmp / "nowhere");
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.err().to_string(), "no such run directory"));
}

TEST_CASE("a record missing from the log, or a line the replay never sends, is a difference") {
  scratch_dir tmp("rp_missing");
  auto cfg = recorded_config(tmp, 2, 1);
  cfg.train.steps = 2;
  train(cfg);
  const std::string log = actors::messages_dir(cfg.runtime.run_dir) + "/rank_0.log";
  const std::string text = slurp(log);
  // Drop the line of chunk 0's activation for micro-batch 1 at step 1.
  const std::string needle = "\"step\":1,\"src\":0,\"dst\":1,\"from\":\"stage(dp=0, pp=0)\"";
  std::istringstream in(text);
  std::string kept, l;
  bool dropped = false;
  while (std::getline(in, l)) {
    if (!dropped && contains(l, needle) && contains(l, "\"kind\":\"activation\"") &&
        contains(l, "\"mb\":1,")) {
      dropped = true;
      continue;
    }
    kept += l + "\n";
  }
  REQUIRE(dropped);
  std::ofstream(log, std::ios::binary | std::ios::trunc) << kept;
  auto rep = replay(cfg.runtime.run_dir);
  CHECK_FALSE(rep.matched);
  CHECK(contains(rep.mismatch, "the replay sent a tensor the recorded run did not"));
  CHECK(contains(rep.mismatch, "rank 0, step 1, micro-batch 1, instruction 0SEND_F1->1"));

  // A line for a tensor that was never sent.
  std::ofstream(log, std::ios::binary | std::ios::trunc) << text;
  std::string extra = text.substr(text.find('\n') + 1);
  extra = extra.substr(0, extra.find('\n'));  // the first record line
  auto at = extra.find("\"part\":0");
  REQUIRE(at != std::string::npos);
  extra.replace(at, 8, "\"part\":7");
  std::ofstream(log, std::ios::binary | std::ios::app) << extra << "\n";
  auto rep2 = replay(cfg.runtime.run_dir);
  CHECK_FALSE(rep2.matched);
  CHECK(contains(rep2.mismatch, "the recorded run sent a tensor the replay did not"));
  CHECK(contains(rep2.mismatch, "part 7"));
}

TEST_CASE("--until-step stops after that step and compares only the steps up to it") {
  scratch_dir tmp("rp_until");
  auto cfg = recorded_config(tmp);
  train(cfg);
  // A corrupted line after the stop must not matter.
  int late = 0;
  for (const auto& r : records(cfg))
    if (r.src == 0 && r.tag.step == 3 && !late) late = r.line;
  REQUIRE(late > 0);
  corrupt_hash(actors::messages_dir(cfg.runtime.run_dir) + "/rank_0.log", late, "0000000000000000");
  actors::replay_options opt;
  opt.until_step = 1;
  auto rep = replay(cfg.runtime.run_dir, opt);
  CHECK_MESSAGE(rep.matched, rep.mismatch);
  CHECK(rep.steps() == 2);
  CHECK(rep.messages == static_cast<std::int64_t>(records(cfg, 0, 2).size()));

  opt.run_dir = cfg.runtime.run_dir;
  opt.until_step = 9;
  auto bad = actors::replay_run(opt);
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.err().to_string(), "--until-step 9 is outside the recorded steps 0..3"));
}

TEST_CASE("--dump-tensors writes the last step's tensors, named by tag, with their logged hashes") {
  scratch_dir tmp("rp_dump");
  auto cfg = recorded_config(tmp, 2, 1);
  cfg.train.steps = 2;
  train(cfg);
  actors::replay_options opt;
  opt.dump_dir = tmp / "dump";
  auto rep = replay(cfg.runtime.run_dir, opt);
  REQUIRE_MESSAGE(rep.matched, rep.mismatch);
  CHECK(rep.dump_file == tmp / "dump/step_1.safetensors");
  auto f = model::safetensors::file::open(rep.dump_file);
  REQUIRE_MESSAGE(f.ok(), (f.ok() ? "" : f.err().to_string()));
  auto last = records(cfg, 1, 2);
  CHECK(f->entries().size() == last.size());
  for (const auto& r : last) {
    const std::string name = actors::kind_name(r.tag.kind) + "/chunk" + std::to_string(r.tag.chunk) +
                             "/mb" + std::to_string(r.tag.mb) + "/part" + std::to_string(r.tag.part) +
                             "/rank" + std::to_string(r.src) + "->rank" + std::to_string(r.dst);
    INFO(name);
    const auto* e = f->find(name);
    REQUIRE(e != nullptr);
    auto [data, size] = f->bytes(*e);
    CHECK(kernels::message_hash(data, size) == r.hash);
  }
}

TEST_CASE("a run trained in two invocations (k steps, resume, k more) replays bit for bit") {
  scratch_dir tmp("rp_resume");
  auto cfg = recorded_config(tmp);
  cfg.optimizer.zero_stage = 1;
  actors::run_options first;
  first.max_steps = 2;
  train(cfg, first);
  actors::run_options second;
  second.resume = cfg.runtime.run_dir;
  train(cfg, second);
  auto log = actors::read_log(actors::messages_dir(cfg.runtime.run_dir), 0);
  REQUIRE(log.ok());
  REQUIRE(log->segments.size() == 2);
  CHECK(log->segments[1].first_step == 2);
  auto rep = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(rep.matched, rep.mismatch);
  CHECK(rep.steps() == 4);
  CHECK(rep.messages == static_cast<std::int64_t>(records(cfg).size()));
}

TEST_CASE("a resume from an earlier checkpoint drops the later steps' records and still replays") {
  scratch_dir tmp("rp_rewind");
  auto cfg = recorded_config(tmp, 2, 1);
  cfg.train.steps = 5;
  cfg.checkpoint.interval = 2;
  train(cfg);  // checkpoints after steps 1 and 3 (step_000002, step_000004) and at the end
  actors::run_options again;
  again.resume = cfg.runtime.run_dir + "/checkpoints/step_000002";
  train(cfg, again);  // as after a crash during step 2: steps 2..4 run a second time
  auto log = actors::read_log(actors::messages_dir(cfg.runtime.run_dir), 1);
  REQUIRE(log.ok());
  std::set<actors::message_key> keys;
  for (auto& r : log->records) CHECK(keys.insert(actors::key_of(r)).second);
  auto rep = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(rep.matched, rep.mismatch);
  CHECK(rep.steps() == 5);
}

TEST_CASE("one worker replays alone, fed by its neighbours' recorded tensors") {
  scratch_dir tmp("rp_rank");
  auto cfg = recorded_config(tmp);
  cfg.optimizer.zero_stage = 2;
  cfg.runtime.record_tensors = true;
  train(cfg);
  check_every_worker_replays_alone(cfg);
  // A difference in worker 3's own output is found by replaying worker 3 alone.
  int line = 0;
  for (const auto& r : records(cfg))
    if (r.src == 3 && r.tag.step == 1 && r.op == "shard update" && !line) line = r.line;
  REQUIRE(line > 0);
  corrupt_hash(actors::messages_dir(cfg.runtime.run_dir) + "/rank_3.log", line, "00000000000000aa");
  actors::replay_options opt;
  opt.rank = 3;
  auto rep = replay(cfg.runtime.run_dir, opt);
  CHECK_FALSE(rep.matched);
  CHECK(contains(rep.mismatch, "rank 3, step 1"));
  CHECK(contains(rep.mismatch, "instruction shard update"));
}

TEST_CASE("a tensor-parallel run logs its group's collectives; each rank replays alone bit for bit, and "
          "a tampered slice or stored tensor is found naming where") {
  scratch_dir tmp("rp_tp");
  auto base = recorded_config(tmp, 2, 1);  // model_parallel 2 × pipeline_stage 2: 4 workers
  base.parallel.model_parallel = 2;
  base.parallel.sequence_parallel = true;
  base.train.steps = 2;
  base.runtime.record_tensors = true;
  auto parsed = core::parse_config(core::to_toml(base), "rp_tp");
  REQUIRE_MESSAGE(parsed.ok(), (parsed.ok() ? "" : parsed.err().to_string()));
  const core::config cfg = parsed.value();
  train(cfg);

  // Every collective slice a rank sends is a record of its log, naming the collective.
  const std::set<std::string> collectives{"gather_rows", "reduce_rows", "all_reduce", "all_gather",
                                          "all_reduce_kv"};
  int tp_records = 0;
  for (const auto& r : records(cfg)) {
    if (!actors::is_tp_kind(r.tag.kind)) continue;
    ++tp_records;
    CHECK_MESSAGE(collectives.count(r.op) == 1, r.op);
    CHECK(r.src / 2 == r.dst / 2);  // within the group: the two tp ranks of one pipeline rank
    CHECK(r.src != r.dst);
    CHECK(actors::kind_name(r.tag.kind).rfind("tp_", 0) == 0);
  }
  CHECK(tp_records > 0);
  const auto whole = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(whole.matched, whole.mismatch);
  CHECK(whole.messages == static_cast<std::int64_t>(records(cfg).size()));

  check_every_worker_replays_alone(cfg);

  // A slice rank 1 sent in a forward collective of step 1, its hash changed in rank 1's log:
  // replaying rank 1 alone names that slice.
  const actors::message_record* slice = nullptr;
  const auto all = records(cfg);
  for (const auto& r : all)
    if (!slice && r.src == 1 && r.tag.step == 1 && r.tag.chunk >= 0 &&
        actors::kind_name(r.tag.kind).rfind("tp_forward_", 0) == 0)
      slice = &r;
  REQUIRE(slice != nullptr);
  const std::string mdir = actors::messages_dir(cfg.runtime.run_dir);
  corrupt_hash(mdir + "/rank_1.log", slice->line, "00000000000000bb");
  const std::string where = "rank 1, step 1, micro-batch " + std::to_string(slice->tag.mb) +
                            ", layer " + std::to_string(slice->tag.chunk) + ", collective " +
                            slice->op + " (forward collective";
  {
    // The whole run names it too (the replayed job stops at it).
    const auto w = replay(cfg.runtime.run_dir);
    CHECK_FALSE(w.matched);
    CHECK_MESSAGE(contains(w.mismatch, where), w.mismatch, " vs ", where);
  }
  {
    actors::replay_options opt;
    opt.rank = 1;
    auto rep = replay(cfg.runtime.run_dir, opt);
    CHECK_FALSE(rep.matched);
    CHECK_MESSAGE(contains(rep.mismatch, where), rep.mismatch, " vs ", where);
    CHECK(contains(rep.mismatch, "recorded hash 00000000000000bb"));
    CHECK(contains(rep.mismatch, "rank_1.log line " + std::to_string(slice->line)));
  }

  // A byte of a collective's slice stored in rank_2.tensors changed: refused, naming the file and
  // the tensor, before anything runs.
  const std::string file = mdir + "/rank_2.tensors";
  std::string bytes = slurp(file);
  const auto at = bytes.find("\"kind\":\"tp_");
  REQUIRE(at != std::string::npos);
  const auto end = bytes.find('}', at);
  REQUIRE(end != std::string::npos);
  bytes[end + 1] = static_cast<char>(bytes[end + 1] ^ 0x01);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  actors::replay_options opt;
  opt.run_dir = cfg.runtime.run_dir;
  opt.log = nullptr;
  opt.rank = 2;
  auto bad = actors::replay_run(opt);
  REQUIRE_FALSE(bad.ok());
  CHECK_MESSAGE(contains(bad.err().to_string(), "rank_2.tensors"), bad.err().to_string());
  CHECK_MESSAGE(contains(bad.err().to_string(), "the stored bytes of the tp_"), bad.err().to_string());
  CHECK(contains(bad.err().to_string(), "from rank 3"));
}

TEST_CASE("at model_parallel 2 × data_parallel 2 under ZeRO-2 every worker replays alone bit for bit") {
  scratch_dir tmp("rp_tp_dp");
  auto base = recorded_config(tmp, 1, 2);
  base.parallel.model_parallel = 2;
  base.optimizer.zero_stage = 2;
  base.train.steps = 2;
  base.runtime.record_tensors = true;
  auto parsed = core::parse_config(core::to_toml(base), "rp_tp_dp");
  REQUIRE_MESSAGE(parsed.ok(), (parsed.ok() ? "" : parsed.err().to_string()));
  const core::config cfg = parsed.value();
  train(cfg);
  const auto slices = check_every_worker_replays_alone(cfg);
  REQUIRE(slices.size() == 4);
  for (std::size_t rank = 0; rank < slices.size(); ++rank) {
    INFO("rank ", rank);
    CHECK(slices[rank] > 0);
  }
}

TEST_CASE("--rank without recorded tensors, or out of range, is refused with a hint") {
  scratch_dir tmp("rp_rank_refused");
  auto cfg = recorded_config(tmp, 2, 1);
  cfg.train.steps = 1;
  train(cfg);
  actors::replay_options opt;
  opt.run_dir = cfg.runtime.run_dir;
  opt.log = nullptr;
  opt.rank = 1;
  auto r = actors::replay_run(opt);
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.err().to_string(), "rank_1.tensors"));
  CHECK(contains(r.err().to_string(), "runtime.record_tensors = true"));
  opt.rank = 2;
  auto r2 = actors::replay_run(opt);
  REQUIRE_FALSE(r2.ok());
  CHECK(contains(r2.err().to_string(), "--rank 2 is not a worker: the run has 2"));
}

TEST_CASE("a run recorded with runtime.record = false is refused with a clear error") {
  scratch_dir tmp("rp_off");
  auto cfg = recorded_config(tmp, 2, 1);
  cfg.train.steps = 1;
  cfg.runtime.record = false;
  train(cfg);
  CHECK_FALSE(fs::exists(actors::messages_dir(cfg.runtime.run_dir)));
  actors::replay_options opt;
  opt.run_dir = cfg.runtime.run_dir;
  opt.log = nullptr;
  auto r = actors::replay_run(opt);
  REQUIRE_FALSE(r.ok());
  const std::string m = r.err().to_string();
  CHECK(contains(m, "config.toml"));
  CHECK(contains(m, "runtime.record"));
  CHECK(contains(m, "the run was not recorded"));
}

TEST_CASE("a log of format 2 (XXH64 hashes) still replays, also resumed by this troupe, whole and one rank") {
  scratch_dir tmp("rp_format2");
  auto cfg = recorded_config(tmp, 2, 1);
  cfg.runtime.record_tensors = true;
  // The XXH64 hashes of what the first two steps send, from a twin run that is not recorded.
  auto twin = cfg;
  twin.runtime.run_dir = tmp / "twin";
  twin.checkpoint.dir = tmp / "twin" + "/checkpoints";
  twin.runtime.record = false;
  twin.runtime.record_tensors = false;
  auto old = std::make_shared<xxh64_hashes>();
  actors::run_options twin_opt;
  twin_opt.max_steps = 2;
  twin_opt.sink = old;
  train(twin, twin_opt);
  // Steps 0-1 recorded as format 2, steps 2-3 appended by this troupe (format 3).
  actors::run_options first;
  first.max_steps = 2;
  train(cfg, first);
  downgrade_to_format_2(cfg, *old);
  actors::run_options second;
  second.resume = cfg.runtime.run_dir;
  train(cfg, second);
  auto log = actors::read_log(actors::messages_dir(cfg.runtime.run_dir), 1);
  REQUIRE(log.ok());
  REQUIRE(log->segments.size() == 2);
  for (const auto& r : log->records)
    CHECK(r.hash_def == (r.tag.step < 2 ? kernels::message_hash_def::xxh64 : kernels::message_hash_def::xxh3));
  CHECK(slurp(actors::messages_dir(cfg.runtime.run_dir) + "/rank_1.log").find("\"troupe_messages\":3") !=
        std::string::npos);

  auto rep = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(rep.matched, rep.mismatch);
  CHECK(rep.messages == static_cast<std::int64_t>(records(cfg).size()));
  check_every_worker_replays_alone(cfg);

  // A changed hash on a format-2 line is found, the replayed hash given under XXH64.
  const int line = gradient_line_of_worker_1(cfg, 1, 1);
  REQUIRE(line > 0);
  const std::string original =
      corrupt_hash(actors::messages_dir(cfg.runtime.run_dir) + "/rank_1.log", line, "0123456789abcdef");
  auto bad = replay(cfg.runtime.run_dir);
  CHECK_FALSE(bad.matched);
  INFO(bad.mismatch);
  CHECK(contains(bad.mismatch, "rank 1, step 1, micro-batch 1, instruction 1SEND_B1->0"));
  CHECK(contains(bad.mismatch, "replayed hash " + original));
}

TEST_CASE("a log of a format this troupe cannot read is refused, naming the file, the format and what to do") {
  scratch_dir tmp("rp_format1");
  auto cfg = recorded_config(tmp, 2, 1);
  cfg.train.steps = 1;
  train(cfg);
  const std::string path = actors::messages_dir(cfg.runtime.run_dir) + "/rank_0.log";
  std::string text = slurp(path);
  const auto at = text.find("\"troupe_messages\":3");
  REQUIRE(at != std::string::npos);
  text.replace(at, 19, "\"troupe_messages\":1");
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  actors::replay_options opt;
  opt.run_dir = cfg.runtime.run_dir;
  opt.log = nullptr;
  auto r = actors::replay_run(opt);
  REQUIRE_FALSE(r.ok());
  const std::string m = r.err().to_string();
  CHECK(contains(m, "rank_0.log"));
  CHECK(contains(m, "message log format 1"));
  CHECK(contains(m, "reads formats 2 and 3"));
  CHECK(contains(m, "record it again"));
}

TEST_CASE("a directory that is not a run, or logs from another config, are refused") {
  scratch_dir tmp("rp_notrun");
  actors::replay_options opt;
  opt.log = nullptr;
  opt.run_dir = tmp / "nowhere";
  auto r = actors::replay_run(opt);
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.err().to_string(), "no such run directory"));
  opt.run_dir = tmp.path.string();
  auto r2 = actors::replay_run(opt);
  REQUIRE_FALSE(r2.ok());
  CHECK(contains(r2.err().to_string(), "not a troupe run directory"));

  auto cfg = recorded_config(tmp, 2, 1);
  cfg.train.steps = 1;
  train(cfg);
  // config.toml edited after the run: the logs no longer belong to it.
  std::ofstream(cfg.runtime.run_dir + "/config.toml", std::ios::app) << "\n";
  opt.run_dir = cfg.runtime.run_dir;
  auto r3 = actors::replay_run(opt);
  REQUIRE_FALSE(r3.ok());
  CHECK(contains(r3.err().to_string(), "ran with another config than config.toml"));
}

TEST_CASE("with interleaved stages every logged transfer names an instruction of the sender's list, and replays") {
  scratch_dir tmp("rp_interleaved");
  auto cfg = recorded_config(tmp);
  cfg.schedule.name = "interleaved_1f1b";
  cfg.parallel.virtual_pipeline = 2;
  cfg.optimizer.zero_stage = 2;
  cfg.recompute.mode = core::recompute_mode::full;
  cfg.train.steps = 2;
  train(cfg);
  const auto layout = actors::layout_of(cfg);
  auto sched = actors::build_schedule(cfg, layout.microbatches);
  REQUIRE(sched.ok());
  const int transfers = scheduled_transfers(cfg, sched.value(), layout.pp);
  CHECK(transfers == 2 * 2 * 4 * 3 * 2);  // steps × replicas × micro-batches × chunk edges × (F, B)
  auto rep = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(rep.matched, rep.mismatch);
}

TEST_CASE("a zb_v run (chunks in a V, both ends on rank 0) replays bit for bit, whole and rank 0 alone") {
  scratch_dir tmp("rp_zbv");
  auto cfg = recorded_config(tmp);
  cfg.schedule.name = "zb_v";
  cfg.parallel.virtual_pipeline = 2;
  cfg.train.steps = 2;
  cfg.runtime.record_tensors = true;  // rank 0 alone replays from its neighbours' stored tensors
  train(cfg);
  auto sched = actors::build_schedule(cfg, actors::layout_of(cfg).microbatches);
  REQUIRE(sched.ok());
  const auto layout = actors::layout_of(cfg, sched.value());
  REQUIRE(layout.rank_of_chunk(3) == 0);
  const int transfers = scheduled_transfers(cfg, sched.value(), layout.pp);
  // Chunk edges 0 -> 1 and 2 -> 3 cross ranks; 1 -> 2 stays on rank 1.
  CHECK(transfers == 2 * 2 * 4 * 2 * 2);  // steps × replicas × micro-batches × crossing edges × (F, B)
  auto whole = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(whole.matched, whole.mismatch);
  actors::replay_options opt;
  opt.rank = 0;
  auto alone = replay(cfg.runtime.run_dir, opt);
  CHECK_MESSAGE(alone.matched, alone.mismatch);
}

TEST_CASE("with dynamic loss scaling (skipped steps, changing scale) a worker still replays alone") {
  scratch_dir tmp("rp_scale");
  auto cfg = recorded_config(tmp);
  cfg.model.init_std = 1.0f;
  cfg.parallel.micro_batch_size = 1;
  cfg.train.steps = 8;
  cfg.train.eval_interval = 0;
  cfg.precision.dynamic_loss_scale = true;
  cfg.precision.loss_scale = 3.4e38;
  cfg.precision.loss_scale_window = 2;
  cfg.runtime.record_tensors = true;
  train(cfg);
  // The run did skip steps: some clip records say so, and the scale changed.
  int skips = 0;
  std::set<float> scales;
  for (int rank = 0; rank < 4; ++rank) {
    auto log = actors::read_log(actors::messages_dir(cfg.runtime.run_dir), rank);
    REQUIRE(log.ok());
    for (const auto& c : log.value().clips) {
      skips += c.skip ? 1 : 0;
      scales.insert(c.loss_scale);
    }
  }
  CHECK(skips > 0);
  CHECK(scales.size() > 1);
  auto whole = replay(cfg.runtime.run_dir, {});
  CHECK_MESSAGE(whole.matched, whole.mismatch);
  for (int rank = 0; rank < 4; ++rank) {
    INFO("rank ", rank);
    actors::replay_options opt;
    opt.rank = rank;
    auto rep = replay(cfg.runtime.run_dir, opt);
    CHECK_MESSAGE(rep.matched, rep.mismatch);
  }
}

TEST_CASE("instruction data: the whole run and each worker alone replay bit for bit") {
  scratch_dir tmp("rp_masked");
  auto cfg = recorded_config(tmp, 2, 1);
  model::testing::use_instruction_data(cfg, tmp);
  cfg.runtime.record_tensors = true;
  train(cfg);
  auto whole = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(whole.matched, whole.mismatch);
  // The last stage scales the loss gradient by the step's trained targets, which the worker
  // replayed alone counts from the data as the run did.
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank ", rank);
    actors::replay_options opt;
    opt.rank = rank;
    auto rep = replay(cfg.runtime.run_dir, opt);
    CHECK_MESSAGE(rep.matched, rep.mismatch);
    CHECK(rep.messages > 0);
  }
}

TEST_CASE("a run with uneven stages and per-layer recompute replays bit for bit, whole and one rank") {
  scratch_dir tmp("rp_uneven");
  auto base = recorded_config(tmp, 2, 1);
  base.runtime.record_tensors = true;
  auto parsed = core::parse_config(core::to_toml(base), "rp_uneven",
                                   {"parallel.stage_layers=[3,1]", "recompute.mode=full",
                                    "recompute.layers=2"});
  REQUIRE_MESSAGE(parsed.ok(), (parsed.ok() ? "" : parsed.err().to_string()));
  const core::config cfg = parsed.value();
  train(cfg);
  auto rep = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(rep.matched, rep.mismatch);
  CHECK(rep.messages == static_cast<std::int64_t>(records(cfg).size()));
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank ", rank);
    actors::replay_options opt;
    opt.rank = rank;
    auto one = replay(cfg.runtime.run_dir, opt);
    CHECK_MESSAGE(one.matched, one.mismatch);
    CHECK(one.messages > 0);
  }
}

TEST_CASE("a run whose step forensics retried a transient fault replays against the bits it went on "
          "with") {
  scratch_dir tmp("replay_forensics");
  auto cfg = recorded_config(tmp);
  cfg.runtime.forensics = "stop";
  actors::run_options opt;
  auto nan = core::parse_fault("nan:3:2", "TROUPE_FAULT");
  REQUIRE(nan.ok());
  opt.fault = nan.value();
  train(cfg, opt);
  // Every worker's log marks the re-execution of step 2.
  const int workers = cfg.parallel.data_parallel * cfg.parallel.pipeline_stage;
  for (int w = 0; w < workers; ++w) {
    std::ifstream in(actors::messages_dir(cfg.runtime.run_dir) + "/rank_" + std::to_string(w) + ".log");
    std::stringstream text;
    text << in.rdbuf();
    CHECK(text.str().find("{\"step\":2,\"src\":" + std::to_string(w) + ",\"control\":\"rerun\"}") !=
          std::string::npos);
  }
  const auto r = replay(cfg.runtime.run_dir);
  CHECK_MESSAGE(r.matched, r.mismatch);
  CHECK(r.last_step == cfg.train.steps - 1);
}
