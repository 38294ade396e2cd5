// `troupe plan --search` and the zero-bubble V: the search tries zb_v where every rank can hold
// its share of the layers in two chunks, splits them so each rank gets L / p (chunk r on the way
// down, chunk 2p-1-r on the way back), plans it with the V's placement (memory terms per rank,
// the simulator's timing), says why it dropped zb_v where it did, and a zb_v plan's peaks match
// a CPU run; its simulator costs follow the V.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "kernels/select.hpp"
#include "model/chunk.hpp"
#include "model/params.hpp"
#include "plan/calibrate.hpp"
#include "plan/plan.hpp"
#include "runtime/build.hpp"
#include "runtime/runtime.hpp"
#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using model::testing::tiny_run;

core::config tiny(const scratch_dir& tmp, int layers) {
  core::config c = tiny_run(tmp, core::arch_kind::gpt2);
  c.model.num_layers = layers;
  c.parallel.micro_batch_num = 8;
  c.train.steps = 2;
  c.train.eval_interval = 0;
  c.data.val.clear();
  c.runtime.record = false;
  return c;
}

std::uint64_t term(const plan::rank_plan& r, const std::string& name) {
  for (const auto& t : r.terms)
    if (t.name == name) return t.bytes;
  return 0;
}

/// fp32 bytes of the chunks `ids` of `split` (the model's own parameter definitions).
std::uint64_t fp32_bytes(const core::config& c, const std::vector<int>& split, std::vector<int> ids) {
  const auto specs = model::partition(c.model, split);
  std::uint64_t n = 0;
  for (int i : ids) n += model::flat_numel(model::define_params(c.model, specs[static_cast<std::size_t>(i)]));
  return 4 * n;
}

const plan::job_plan* find(const plan::search_result& r, const std::string& schedule) {
  for (const auto& p : r.best)
    if (p.schedule == schedule) return &p;
  return nullptr;
}

int rejected(const plan::search_result& r, const std::string& why) {
  for (const auto& [k, n] : r.rejected)
    if (k == why) return n;
  return 0;
}

/// Search options for `gpus` devices at micro-batch size 2 that list every layout that fits.
plan::search_options every_fit(int gpus) {
  plan::search_options o;
  o.gpus = gpus;
  o.top = 1000;
  o.micro_batch_sizes = {2};
  return o;
}

TEST_CASE("plan --search tries zb_v with each rank's share split over its two chunks, placed in a V") {
  scratch_dir tmp("plan_search_zbv");
  // 6 layers on 2 ranks: 3 each. interleaved_1f1b needs 4 equal chunks (6 % 4 != 0); zb_v gives
  // rank r 2 layers in chunk r (down) and 1 in chunk 3 - r (back, the head's chunk 3 the smaller
  // on rank 0): [2, 2, 1, 1].
  const core::config base = tiny(tmp, 6);
  const plan::search_options o = every_fit(2);
  auto r = plan::search(base, o);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  const plan::job_plan* v = find(r.value(), "zb_v");
  REQUIRE_MESSAGE(v != nullptr, plan::render_search(r.value(), o));
  CHECK(v->pp == 2);
  CHECK(v->v == 2);
  CHECK(v->chunk_layers == std::vector<int>{2, 2, 1, 1});
  CHECK(v->name.find("layers [2, 2, 1, 1], zb_v") != std::string::npos);
  // The memory terms follow the V: rank 0 holds chunks 0 and 3 (embedding, 3 layers, ln_f),
  // rank 1 chunks 1 and 2 (3 layers).
  REQUIRE(v->ranks.size() == 2);
  const std::vector<int> split{2, 2, 1, 1};
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    const std::uint64_t want = fp32_bytes(base, split, rank == 0 ? std::vector<int>{0, 3} : std::vector<int>{1, 2});
    const std::uint64_t got = term(v->ranks[static_cast<std::size_t>(rank)], "fp32 parameters");
    CHECK(got >= want);
    CHECK(got < want + 4096);  // the backend's rounding of two chunks
  }
  // The 1F1B family at the same pp is planned beside it; interleaved_1f1b is dropped, and says why.
  CHECK(find(r.value(), "1f1b") != nullptr);
  CHECK(rejected(r.value(), "virtual stages do not divide the layers") > 0);
  // The V's schedule has no warm-up bubble of zb_h1's size: the simulator says so through the plan.
  const plan::job_plan* h1 = find(r.value(), "zb_h1");
  REQUIRE(h1 != nullptr);
  CHECK(v->bubble < h1->bubble);
  const std::string text = plan::render_search(r.value(), o);
  CHECK(text.find("zb_v") != std::string::npos);

  // 4 layers on 4 ranks: one layer each cannot fill two chunks; the rejected list says so (at
  // pp 2, 2 layers a rank, zb_v runs its even split).
  auto few = plan::search(tiny(tmp, 4), every_fit(4));
  REQUIRE(few.ok());
  for (const auto& p : few.value().best) CHECK_FALSE((p.schedule == "zb_v" && p.pp == 4));
  REQUIRE(find(few.value(), "zb_v") != nullptr);
  CHECK(find(few.value(), "zb_v")->pp == 2);
  CHECK(find(few.value(), "zb_v")->chunk_layers == std::vector<int>{1, 1, 1, 1});
  CHECK(rejected(few.value(), "zb_v: fewer than 2 layers per rank (each of a rank's two chunks needs one)") > 0);
  CHECK(plan::render_search(few.value(), o).find("zb_v: fewer than 2 layers per rank") != std::string::npos);
}

TEST_CASE("a zb_v plan's peaks per stage match a CPU run within 10 %, uneven chunks in a V") {
  scratch_dir tmp("plan_zbv_run");
  core::config c = tiny(tmp, 6);
  c.parallel.pipeline_stage = 2;
  c.parallel.virtual_pipeline = 2;
  c.parallel.micro_batch_num = 4;
  c.schedule.name = "zb_v";
  // In the V rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2: 3 layers each (interleaved
  // would give rank 0 chunks 0 and 2, 2 layers, and rank 1 4: a layer's parameters apart).
  c.parallel.stage_layers = {1, 2, 1, 2};
  auto p = plan::make_plan(c, {});
  REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.err().to_string()));
  REQUIRE(p->ranks.size() == 2);
  const std::vector<int> split{1, 2, 1, 2};
  // Two chunks a rank: the in-flight count is of (chunk, micro-batch) passes, not micro-batches.
  CHECK(plan::render_text(p.value()).find("per micro-batch over its 2 chunks; at most ") != std::string::npos);
  CHECK(term(p->ranks[0], "fp32 parameters") >= fp32_bytes(c, split, {0, 3}));
  CHECK(term(p->ranks[0], "fp32 parameters") < fp32_bytes(c, split, {0, 3}) + 4096);
  CHECK(term(p->ranks[1], "fp32 parameters") >= fp32_bytes(c, split, {1, 2}));
  CHECK(term(p->ranks[1], "fp32 parameters") < fp32_bytes(c, split, {1, 2}) + 4096);

  actors::run_options opt;
  opt.log = nullptr;
  auto run = actors::run_actor_job(c, opt);
  REQUIRE_MESSAGE(run.ok(), (run.ok() ? "" : run.err().to_string()));
  std::ifstream f(c.runtime.run_dir + "/metrics.jsonl");
  std::string line, last;
  while (std::getline(f, line))
    if (!line.empty()) last = line;
  REQUIRE(!last.empty());
  const auto j = nlohmann::json::parse(last);
  int seen = 0;
  for (const auto& s : j.at("stages")) {
    const int pp = s.at("pp").get<int>();
    const auto& r = p->ranks.at(static_cast<std::size_t>(pp));
    const auto stage = s.at("peak_device_bytes").get<double>();
    const auto shard = s.at("optimizer_peak_device_bytes").get<double>();
    INFO("pp ", pp, ": planned ", r.stage_peak, " measured ", stage, "; shard planned ",
         r.shard_peak, " measured ", shard);
    REQUIRE(stage > 0);
    CHECK(std::fabs(static_cast<double>(r.stage_peak) - stage) / stage <= 0.10);
    CHECK(std::fabs(static_cast<double>(r.shard_peak) - shard) / shard <= 0.10);
    ++seen;
  }
  CHECK(seen == 2);
}

TEST_CASE("zb_v's simulator costs: the slowest rank's work over its two chunks, not the head's chunk twice") {
  scratch_dir tmp("plan_zbv_costs");
  core::config c = tiny(tmp, 6);
  c.parallel.pipeline_stage = 2;
  c.parallel.virtual_pipeline = 2;
  c.parallel.stage_layers = {2, 2, 1, 1};  // V: rank 0 chunks 0 (2 layers) and 3 (1 + head)
  const plan::calibration cal = plan::default_calibration("cpu", core::precision_kind::fp32);
  const std::int64_t rows = static_cast<std::int64_t>(c.parallel.micro_batch_size) * c.model.seq_length;
  const auto ft = [&](int layers, bool head) {
    return plan::forward_flops(c.model, layers, head, rows) / cal.flops_per_s +
           plan::forward_ops_per_layer(c.model) * layers * cal.op_overhead_s;
  };
  const double rank0 = ft(2, false) + ft(1, true), rank1 = ft(2, false) + ft(1, false);
  REQUIRE(rank0 > rank1);
  const auto v = plan::chunk_costs(c, cal, schedules::placement::v);
  CHECK(v.f == doctest::Approx(rank0 / 2).epsilon(1e-12));
  CHECK(v.b == doctest::Approx(rank0).epsilon(1e-12));
  CHECK(v.w == doctest::Approx(rank0 / 2).epsilon(1e-12));
  // Interleaved keeps the slowest chunk (rank 1's chunk 3: one layer and the head, here the
  // heaviest of the four).
  const auto inter = plan::chunk_costs(c, cal);
  CHECK(inter.f == doctest::Approx(std::max(ft(2, false), ft(1, true))).epsilon(1e-12));
  // Through make_plan: a zb_v config is simulated with the V's costs.
  c.schedule.name = "zb_v";
  plan::plan_options po;
  po.one_device = false;
  po.suggest = false;
  auto p = plan::make_plan(c, po);
  REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.err().to_string()));
  auto lowered = actors::build_schedule(c, c.parallel.micro_batch_num);
  REQUIRE(lowered.ok());
  auto sim = schedules::simulate(lowered.value(), v);
  REQUIRE(sim.ok());
  CHECK(p->pipeline_s == doctest::Approx(sim.value().makespan).epsilon(1e-12));
}

TEST_CASE("plan --search tries tensor parallel, and rejects what the config check refuses with its reason") {
  scratch_dir tmp("plan_search_tp");
  const core::config base = tiny(tmp, 4);
  const plan::search_options o = every_fit(2);
  auto r = plan::search(base, o);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  const std::string text = plan::render_search(r.value(), o);
  INFO(text);
  // On 2 devices tp 2 leaves dp 1 × pp 1, with sequence parallel off and on.
  int tp2 = 0, tp2_sp = 0;
  for (const auto& p : r.value().best) {
    if (p.tp != 2) continue;
    CHECK(p.dp * p.pp == 1);
    REQUIRE(p.ranks.size() == 2);
    CHECK(plan::rank_name(p, p.ranks[1]) == "dp0/tp1/pp0");
    CHECK(p.name.find("tp 2") != std::string::npos);
    ++(p.sequence_parallel ? tp2_sp : tp2);
  }
  CHECK(tp2 > 0);
  CHECK(tp2_sp > 0);
  CHECK(text.find("not searched") == std::string::npos);

  // Compute below fp32 with tensor parallel is refused by the config check: every tp 2 layout is
  // rejected with the check's key and words, counted, and none is planned.
  auto bf16 = [&] {
    auto c = core::parse_config(core::to_toml(base), "search_test",
                                {"runtime.device=\"cuda\"", "precision.compute=\"bf16\""});
    REQUIRE_MESSAGE(c.ok(), (c.ok() ? "" : c.err().to_string()));
    return c.value();
  }();
  auto low = plan::search(bf16, o);
  REQUIRE(low.ok());
  const std::string low_text = plan::render_search(low.value(), o);
  INFO(low_text);
  REQUIRE_FALSE(low.value().best.empty());
  for (const auto& p : low.value().best) CHECK(p.tp == 1);
  int refused = 0;
  for (const auto& [why, n] : low.value().rejected)
    if (why.rfind("model_parallel 2", 0) == 0) {
      CHECK(why.find("refused by the config check (precision.compute: ") != std::string::npos);
      CHECK(why.find("fp32 only") != std::string::npos);
      refused += n;
    }
  // dp 1 × pp 1: one schedule × three recompute modes, sequence parallel off and on.
  CHECK(refused == 6);
  CHECK(low_text.find("precision.compute") != std::string::npos);
}

TEST_CASE("tensor parallel's simulator costs: the arithmetic over the ranks, the collectives at the link rate") {
  scratch_dir tmp("plan_tp_costs");
  core::config c = tiny(tmp, 4);  // one chunk: the embedding, 4 layers, the head
  const plan::calibration cal = plan::default_calibration("cpu", core::precision_kind::fp32);
  const std::int64_t rows = static_cast<std::int64_t>(c.parallel.micro_batch_size) * c.model.seq_length;
  const double compute = plan::forward_flops(c.model, 4, true, rows) / cal.flops_per_s;
  const double overhead = plan::forward_ops_per_layer(c.model) * 4 * cal.op_overhead_s;
  const auto one = plan::chunk_costs(c, cal);
  CHECK(one.f == doctest::Approx(compute + overhead).epsilon(1e-12));
  CHECK(plan::tp_comm_seconds(c, cal, 4, true, true) == 0);

  // tp 2: a rank computes half; it sends half of an fp32 activation A in each all-gather or
  // reduce-scatter and all of it in each all-reduce (two halves). Without sequence parallel:
  // two all-reduces a layer, one for the embedding, one for the final norm's gradient, the
  // loss's row maxima (rows floats to one peer) and row sums (2 rows floats, all-reduced).
  c.parallel.model_parallel = 2;
  const double A = static_cast<double>(rows) * c.model.hidden_size * 4;
  const double loss_small = rows * 4.0 + 2 * rows * 4.0;
  const double plain = (4 * 2 * A + A + A + loss_small) / cal.link_bytes_per_s;
  CHECK(plan::tp_comm_seconds(c, cal, 4, true, true) == doctest::Approx(plain).epsilon(1e-12));
  const auto two = plan::chunk_costs(c, cal);
  CHECK(two.f == doctest::Approx(compute / 2 + overhead + plain).epsilon(1e-12));
  CHECK(two.b == doctest::Approx(compute + 2 * overhead + plain).epsilon(1e-12));
  CHECK(two.w == doctest::Approx(compute / 2 + overhead).epsilon(1e-12));
  CHECK(two.comm == doctest::Approx(one.comm).epsilon(1e-12));
  // Sequence parallel: a layer's all-gathers and reduce-scatters move as much as its all-reduces;
  // the embedding's sum becomes a reduce-scatter, the head gathers the norm's rows and
  // reduce-scatters its gradient; the activation between pipeline ranks is a rank's rows.
  c.parallel.sequence_parallel = true;
  const double seq = (4 * 2 * A + A / 2 + A / 2 + A / 2 + loss_small) / cal.link_bytes_per_s;
  CHECK(plan::tp_comm_seconds(c, cal, 4, true, true) == doctest::Approx(seq).epsilon(1e-12));
  CHECK(plan::chunk_costs(c, cal).comm == doctest::Approx(one.comm / 2).epsilon(1e-12));
  // Full recompute repeats the forward's collectives inside the backward.
  c.parallel.sequence_parallel = false;
  c.recompute.mode = core::recompute_mode::full;
  const auto full = plan::chunk_costs(c, cal);
  CHECK(full.b - two.b == doctest::Approx(compute / 2 + overhead + plain).epsilon(1e-9));

  // On one device (troupe train) every rank's share runs there: tp ranks times one rank's work.
  c.recompute.mode = core::recompute_mode::none;
  c.parallel.data_parallel = 2;  // more than one worker besides the tp group
  plan::plan_options po;
  po.suggest = false;
  auto p = plan::make_plan(c, po);
  REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.err().to_string()));
  CHECK(p->pipeline_s ==
        doctest::Approx((two.f + two.b) * c.parallel.micro_batch_num * 2 * 2).epsilon(1e-12));
}

TEST_CASE("on one device concurrent workers run faster by the calibration's concurrent_speedup, "
          "which calibration files carry (older ones take the device's default)") {
  scratch_dir tmp("plan_concurrent");
  core::config c = tiny(tmp, 2);
  c.parallel.pipeline_stage = 2;  // two workers on the one device
  plan::plan_options po;
  po.suggest = false;
  po.cal = plan::default_calibration("cpu", core::precision_kind::fp32);
  CHECK(po.cal.concurrent_speedup == 1.0);
  auto base = plan::make_plan(c, po);
  REQUIRE_MESSAGE(base.ok(), (base.ok() ? "" : base.err().to_string()));
  po.cal.concurrent_speedup = 1.25;
  auto faster = plan::make_plan(c, po);
  REQUIRE(faster.ok());
  CHECK(faster->pipeline_s == doctest::Approx(base->pipeline_s / 1.25).epsilon(1e-12));
  // One worker has no other stream to fill its gaps.
  c.parallel.pipeline_stage = 1;
  auto alone = plan::make_plan(c, po);
  po.cal.concurrent_speedup = 1.0;
  auto alone_base = plan::make_plan(c, po);
  REQUIRE((alone.ok() && alone_base.ok()));
  CHECK(alone->pipeline_s == doctest::Approx(alone_base->pipeline_s).epsilon(1e-12));

  // The file: written and read back; absent, the device's default; out of range, an error naming
  // the key.
  plan::calibration cal = plan::default_calibration("cuda", core::precision_kind::bf16);
  CHECK(cal.concurrent_speedup == doctest::Approx(1.1));
  cal.concurrent_speedup = 1.17;
  const std::string path = tmp / "cal.json";
  REQUIRE(plan::save_calibration(cal, path).ok());
  auto back = plan::load_calibration(path);
  REQUIRE(back.ok());
  CHECK(back->concurrent_speedup == doctest::Approx(1.17));
  auto rewrite = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
    edit(j);
    std::ofstream(path) << j.dump();
    return plan::load_calibration(path);
  };
  auto old = rewrite([](nlohmann::json& j) { j.erase("concurrent_speedup"); });
  REQUIRE(old.ok());
  CHECK(old->concurrent_speedup == doctest::Approx(1.1));
  auto bad = rewrite([](nlohmann::json& j) { j["concurrent_speedup"] = 0; });
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.err().to_string().find("concurrent_speedup") != std::string::npos);
}

TEST_CASE("the offload rates come from the calibration file and set the time of an offloaded "
          "step's optimizer tail") {
  scratch_dir tmp("plan_offload_rates");
  core::config c = tiny(tmp, 2);
  c.runtime.device = "cuda";
  c.optimizer.offload = true;
  plan::calibration cal = plan::default_calibration("cuda", core::precision_kind::bf16);
  CHECK(cal.offload_link_bytes_per_s == doctest::Approx(5e10));
  CHECK(cal.host_adamw_bytes_per_s == doctest::Approx(1e11));
  const std::int64_t n = 1'000'000;
  // The slower of the copies (8 B an element) and the host update (28 B) counts.
  cal.offload_link_bytes_per_s = 4e9;
  cal.host_adamw_bytes_per_s = 56e9;
  CHECK(plan::optimizer_seconds(c, cal, n, n) == doctest::Approx(8.0 * n / 4e9));
  cal.host_adamw_bytes_per_s = 7e9;
  CHECK(plan::optimizer_seconds(c, cal, n, n) == doctest::Approx(28.0 * n / 7e9));
  const std::string path = tmp / "cal.json";
  REQUIRE(plan::save_calibration(cal, path).ok());
  auto back = plan::load_calibration(path);
  REQUIRE(back.ok());
  CHECK(back->offload_link_bytes_per_s == doctest::Approx(4e9));
  CHECK(back->host_adamw_bytes_per_s == doctest::Approx(7e9));
  auto rewrite = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
    edit(j);
    std::ofstream(path + ".edit") << j.dump();
    return plan::load_calibration(path + ".edit");
  };
  auto old = rewrite([](nlohmann::json& j) {
    j.erase("offload_link_bytes_per_s");
    j.erase("host_adamw_bytes_per_s");
  });
  REQUIRE(old.ok());
  CHECK(old->offload_link_bytes_per_s == doctest::Approx(5e10));
  CHECK(old->host_adamw_bytes_per_s == doctest::Approx(1e11));
  // A CPU file without them: its own memory rate.
  auto old_cpu = rewrite([](nlohmann::json& j) {
    j.erase("host_adamw_bytes_per_s");
    j["device"] = "cpu";
    j["memory_bytes_per_s"] = 3e9;
  });
  REQUIRE(old_cpu.ok());
  CHECK(old_cpu->host_adamw_bytes_per_s == doctest::Approx(3e9));
  for (const char* key : {"offload_link_bytes_per_s", "host_adamw_bytes_per_s"}) {
    auto bad = rewrite([&](nlohmann::json& j) { j[key] = -1; });
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.err().to_string().find(key) != std::string::npos);
  }
}

TEST_CASE("calibrate: rates from the config's own chunks; on a GPU, two workers at once as well") {
  scratch_dir tmp("plan_calibrate");
  core::config c = tiny(tmp, 2);
  auto cpu = plan::calibrate(c, 2);
  REQUIRE_MESSAGE(cpu.ok(), (cpu.ok() ? "" : cpu.err().to_string()));
  CHECK(cpu->source == "measured");
  CHECK(cpu->flops_per_s > 0);
  CHECK(cpu->memory_bytes_per_s > 0);
  CHECK(cpu->link_bytes_per_s > 0);
  REQUIRE(cpu->chunk_seconds.size() == 2);  // one layer and both layers, with embedding and head
  CHECK(cpu->chunk_seconds[1].second > 0);
  CHECK(cpu->concurrent_speedup == 1.0);  // not measured on the CPU
  // Offload through the shard on the CPU device: host copies, and an update that reads and
  // writes 28 bytes an element, so the whole tail cannot beat that AdamW alone by much.
  CHECK(cpu->offload_link_bytes_per_s > 0);
  CHECK(cpu->host_adamw_bytes_per_s > 0);
  CHECK(cpu->host_adamw_bytes_per_s < 2 * cpu->memory_bytes_per_s);
  if (!kernels::cuda_available()) return;
  c.runtime.device = "cuda";
  c.precision.compute = core::precision_kind::bf16;
  auto gpu = plan::calibrate(c, 2);
  REQUIRE_MESSAGE(gpu.ok(), (gpu.ok() ? "" : gpu.err().to_string()));
  CHECK(gpu->device == "cuda");
  CHECK(gpu->concurrent_speedup >= 0.5);
  CHECK(gpu->concurrent_speedup <= 4.0);
  MESSAGE("cuda: concurrent_speedup ", gpu->concurrent_speedup);
  // Offload's copies over PCIe or NVLink-C2C and a host's AdamW: more than 1 GB/s, less than the
  // device's own memory.
  CHECK(gpu->offload_link_bytes_per_s > 1e9);
  CHECK(gpu->offload_link_bytes_per_s < gpu->memory_bytes_per_s);
  CHECK(gpu->host_adamw_bytes_per_s > 1e9);
  MESSAGE("cuda: offload link ", gpu->offload_link_bytes_per_s, " B/s, host AdamW ",
          gpu->host_adamw_bytes_per_s, " B/s");
}

TEST_CASE("the replicas' gradient exchange costs the link between GPUs, and device memory on one GPU") {
  scratch_dir tmp("plan_exchange");
  core::config c = tiny(tmp, 4);
  c.parallel.data_parallel = 2;
  plan::calibration cal = plan::default_calibration("cuda", core::precision_kind::bf16);
  cal.link_bytes_per_s = 1e11;
  cal.memory_bytes_per_s = 3e12;
  const std::int64_t stage = 1000000, shard = 400000;
  // Gradient slices out and parameters back: 2 x 4 B per element, (dp - 1) / dp of the stage;
  // then AdamW's 28 B per element of the shard at the memory rate.
  const double adamw = 28.0 * shard / cal.memory_bytes_per_s;
  const double moved = 2.0 * stage * 4 * 0.5;
  CHECK(plan::optimizer_seconds(c, cal, stage, shard, false) ==
        doctest::Approx(moved / cal.link_bytes_per_s + adamw).epsilon(1e-12));
  CHECK(plan::optimizer_seconds(c, cal, stage, shard, true) ==
        doctest::Approx(moved / cal.memory_bytes_per_s + adamw).epsilon(1e-12));
  // On the CPU the link rate is the timed copy between two stages' memory: it counts either way.
  plan::calibration cpu = plan::default_calibration("cpu", core::precision_kind::fp32);
  CHECK(plan::optimizer_seconds(c, cpu, stage, shard, true) ==
        doctest::Approx(plan::optimizer_seconds(c, cpu, stage, shard, false)).epsilon(1e-12));
  // One replica exchanges nothing.
  c.parallel.data_parallel = 1;
  CHECK(plan::optimizer_seconds(c, cal, stage, shard, false) == doctest::Approx(adamw).epsilon(1e-12));
}

}  // namespace
