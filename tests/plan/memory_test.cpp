// `troupe plan`'s memory against reality: the planned peak bytes of every stage and optimizer
// shard (a dry run of the job on meta backends) next to what the CPU backend counted in a real
// run of the same config (metrics.jsonl: peak_device_bytes, optimizer_peak_device_bytes), for a
// tiny GPT-2 and a tiny LLaMA over pipeline stages, recompute modes, ZeRO stages and tensor
// parallel (with and without sequence parallel).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "plan/plan.hpp"
#include "runtime/runtime.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace {

using namespace troupe;
using model::testing::scratch_dir;
using model::testing::tiny_run;

struct measured {
  std::map<std::tuple<int, int, int>, std::uint64_t> stage, shard;  // (dp, pp, tp)
};

/// Peaks of the last step's metrics line.
measured run_and_measure(const core::config& cfg) {
  actors::run_options opt;
  opt.log = nullptr;
  auto r = actors::run_actor_job(cfg, opt);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  std::ifstream f(cfg.runtime.run_dir + "/metrics.jsonl");
  std::string line, last;
  while (std::getline(f, line))
    if (!line.empty()) last = line;
  REQUIRE(!last.empty());
  auto j = nlohmann::json::parse(last);
  measured m;
  for (const auto& s : j.at("stages")) {
    const std::tuple<int, int, int> k{s.at("dp").get<int>(), s.at("pp").get<int>(),
                                      s.value("tp", 0)};
    m.stage[k] = s.at("peak_device_bytes").get<std::uint64_t>();
    m.shard[k] = s.at("optimizer_peak_device_bytes").get<std::uint64_t>();
  }
  return m;
}

core::config layout(const scratch_dir& tmp, core::arch_kind arch, int pp, int dp,
                    core::recompute_mode rc, int zero) {
  core::config c = tiny_run(tmp, arch);
  c.model.num_layers = 4;
  c.parallel.pipeline_stage = pp;
  c.parallel.data_parallel = dp;
  c.parallel.micro_batch_num = 4;
  c.recompute.mode = rc;
  c.optimizer.zero_stage = zero;
  c.train.steps = 2;
  c.train.eval_interval = 0;
  c.data.val.clear();
  c.runtime.record = false;
  return c;
}

double rel(std::uint64_t planned, std::uint64_t real) {
  return std::fabs(static_cast<double>(planned) - static_cast<double>(real)) /
         static_cast<double>(real);
}

void compare(const core::config& cfg) {
  plan::plan_options po;
  auto p = plan::make_plan(cfg, po);
  REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.err().to_string()));
  const measured m = run_and_measure(cfg);
  REQUIRE(p->ranks.size() == m.stage.size());
  for (const auto& r : p->ranks) {
    const std::tuple<int, int, int> k{r.dp, r.pp, r.tp};
    INFO("stage (dp ", r.dp, ", pp ", r.pp, ", tp ", r.tp, "): planned ", r.stage_peak, " measured ",
         m.stage.at(k), "; shard planned ", r.shard_peak, " measured ", m.shard.at(k));
    REQUIRE(m.stage.at(k) > 0);
    CHECK(rel(r.stage_peak, m.stage.at(k)) <= 0.10);
    CHECK(rel(r.shard_peak, m.shard.at(k)) <= 0.10);
  }
}

const char* name(core::recompute_mode m) {
  return m == core::recompute_mode::none ? "none" : m == core::recompute_mode::full ? "full" : "selective";
}

}  // namespace

TEST_CASE("planned peak bytes per stage match a CPU run within 10 %: pp 1/2/4 x recompute") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama})
    for (int pp : {1, 2, 4})
      for (auto rc : {core::recompute_mode::none, core::recompute_mode::selective,
                      core::recompute_mode::full}) {
        CAPTURE(pp);
        INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"), " recompute ", name(rc));
        scratch_dir tmp("plan_mem");
        compare(layout(tmp, arch, pp, 1, rc, 0));
      }
}

TEST_CASE("planned peak bytes per stage and shard match a CPU run within 10 %: ZeRO 0/1/2") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama})
    for (int zero : {0, 1, 2}) {
      CAPTURE(zero);
      INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
      scratch_dir tmp("plan_zero");
      compare(layout(tmp, arch, 2, 2, core::recompute_mode::none, zero));
    }
}

TEST_CASE("on one device the planned pipeline time is the whole model's work, whatever the split") {
  // Every worker of `troupe train` shares the device, so moving layers between pipeline ranks
  // moves work without adding any: the head is counted once, not once per chunk.
  scratch_dir tmp("plan_one_device");
  plan::plan_options po;
  po.suggest = false;
  double pp1 = 0;
  for (int pp : {1, 2, 4}) {
    INFO("pipeline_stage ", pp);
    auto p = plan::make_plan(layout(tmp, core::arch_kind::gpt2, pp, 1, core::recompute_mode::none, 0), po);
    REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.err().to_string()));
    if (pp == 1) pp1 = p.value().pipeline_s;
    CHECK(p.value().pipeline_s == doctest::Approx(pp1).epsilon(1e-12));
  }
  // One device per worker: the pipeline's makespan, shorter than the whole model's work.
  po.one_device = false;
  auto p4 = plan::make_plan(layout(tmp, core::arch_kind::gpt2, 4, 1, core::recompute_mode::none, 0), po);
  REQUIRE(p4.ok());
  CHECK(p4.value().pipeline_s < pp1);
}

TEST_CASE("with optimizer.offload the planned device peaks still match a CPU run within 10 %") {
  for (const auto& layout_case : {std::tuple{1, 1, 0}, std::tuple{2, 2, 1}, std::tuple{2, 2, 2}}) {
    // Plain variables: clang 14's CAPTURE cannot name a structured binding.
    const int pp = std::get<0>(layout_case), dp = std::get<1>(layout_case);
    const int zero = std::get<2>(layout_case);
    CAPTURE(pp);
    CAPTURE(dp);
    CAPTURE(zero);
    scratch_dir tmp("plan_offload");
    core::config c = layout(tmp, core::arch_kind::gpt2, pp, dp, core::recompute_mode::none, zero);
    c.optimizer.offload = true;
    compare(c);
  }
}

namespace {

std::uint64_t term(const plan::rank_plan& r, const std::string& name) {
  for (const auto& t : r.terms)
    if (t.name == name) return t.bytes;
  return 0;
}

/// `c` with `sets` applied through the parser (validated as `troupe plan --set` would).
core::config with(const core::config& c, const std::vector<std::string>& sets) {
  auto r = core::parse_config(core::to_toml(c), "memory_test", sets);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  return r.value();
}

}  // namespace

TEST_CASE("the plan follows uneven stages and per-layer recompute, and matches a CPU run within 10 %") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    scratch_dir tmp("plan_uneven");
    const core::config base = layout(tmp, arch, 2, 1, core::recompute_mode::none, 0);
    // The first stage's parameters grow with every layer moved onto it, the last stage's shrink.
    std::vector<std::uint64_t> first, last;
    for (const std::string split : {"[1,3]", "[2,2]", "[3,1]"}) {
      auto p = plan::make_plan(with(base, {"parallel.stage_layers=" + split}), {});
      REQUIRE(p.ok());
      REQUIRE(p->ranks.size() == 2);
      first.push_back(term(p->ranks[0], "fp32 parameters"));
      last.push_back(term(p->ranks[1], "fp32 parameters"));
    }
    CHECK(first[0] < first[1]);
    CHECK(first[1] < first[2]);
    CHECK(last[0] > last[1]);
    CHECK(last[1] > last[2]);
    // The even split is the default's plan.
    auto even = plan::make_plan(base, {});
    REQUIRE(even.ok());
    CHECK(term(even->ranks[0], "fp32 parameters") == first[1]);

    // Activations: recomputing some layers of a chunk keeps less than none, more than all.
    const auto saved = [&](const std::vector<std::string>& sets) {
      auto p = plan::make_plan(with(base, sets), {});
      REQUIRE(p.ok());
      return p->ranks[0].saved_per_microbatch;
    };
    const std::uint64_t none = saved({}), all = saved({"recompute.mode=full"}),
                        one = saved({"recompute.mode=full", "recompute.layers=1"}),
                        listed = saved({"recompute.mode=full", "recompute.layer_list=[0]"}),
                        sel_all = saved({"recompute.mode=selective"}),
                        sel_one = saved({"recompute.mode=selective", "recompute.layers=1"});
    CHECK(all < one);
    CHECK(one < none);
    CHECK(listed == one);
    CHECK(sel_all < sel_one);
    CHECK(sel_one < none);

    // Planned peaks against a real run, uneven and per-layer.
    compare(with(base, {"parallel.stage_layers=[1,3]", "recompute.mode=full", "recompute.layers=1"}));
    compare(with(base, {"parallel.stage_layers=[3,1]", "recompute.mode=selective",
                        "recompute.layer_list=[1,3]"}));

    // recompute.keep_gelu = 2: the GELU outputs of the model's last two layers, which the even
    // split puts on the last stage: one fp32 [rows, 4C] more each there, nothing on the first.
    if (arch == core::arch_kind::gpt2) {
      auto keep = plan::make_plan(with(base, {"recompute.keep_gelu=2"}), {});
      REQUIRE(keep.ok());
      const std::uint64_t act = static_cast<std::uint64_t>(base.parallel.micro_batch_size) *
                                base.model.seq_length * 4 * base.model.hidden_size * 4;
      CHECK(keep->ranks[0].saved_per_microbatch == even->ranks[0].saved_per_microbatch);
      CHECK(keep->ranks[1].saved_per_microbatch == even->ranks[1].saved_per_microbatch + 2 * act);
      compare(with(base, {"recompute.keep_gelu=2"}));
    }
  }
}

TEST_CASE("planned peak bytes per tensor-parallel stage and shard match a CPU run within 10 %") {
  // tp 2: every rank its shard of the weights, vocabulary-parallel logits, and (sequence
  // parallel) its rows of the norms and residuals; LLaMA with 2 key/value heads splits them.
  struct tp_case {
    core::arch_kind arch;
    bool sp;
    int pp, dp;
  };
  for (const tp_case& t : {tp_case{core::arch_kind::gpt2, false, 1, 1},
                           tp_case{core::arch_kind::gpt2, true, 2, 1},
                           tp_case{core::arch_kind::llama, false, 1, 2},
                           tp_case{core::arch_kind::llama, true, 1, 1}}) {
    const bool gpt2 = t.arch == core::arch_kind::gpt2, sp = t.sp;
    const int pp = t.pp, dp = t.dp;
    INFO((gpt2 ? "gpt2" : "llama"), " sequence_parallel ", sp, " pp ", pp, " dp ", dp);
    scratch_dir tmp("plan_tp");
    core::config c = layout(tmp, t.arch, pp, dp, core::recompute_mode::none, dp > 1 ? 1 : 0);
    c.parallel.model_parallel = 2;
    c.parallel.sequence_parallel = sp;
    auto p = plan::make_plan(c, {});
    REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.err().to_string()));
    CHECK(p->ranks.size() == static_cast<std::size_t>(2 * pp * dp));
    compare(c);
  }
}

TEST_CASE("tensor parallel halves a rank's split weights and sequence parallel its saved activations") {
  // Against the plan of the same model at tp 1: tp 2 takes away half of every split tensor, by
  // the sharding rules of model/tensor_parallel.hpp counted here from the model's sizes (the
  // norms, wpe and GPT-2's row-parallel biases stay whole). Within 2 %: the flat buffers pad
  // each tensor to a block (kernels::norm_block), and the model is wide enough for that to be
  // small.
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    scratch_dir tmp("plan_tp_half");
    const core::config base = with(layout(tmp, arch, 1, 1, core::recompute_mode::none, 0),
                                   {"model.hidden_size=256", "model.ffn_hidden_size=1024"});
    auto one = plan::make_plan(base, {});
    auto two = plan::make_plan(with(base, {"parallel.model_parallel=2"}), {});
    auto seq = plan::make_plan(
        with(base, {"parallel.model_parallel=2", "parallel.sequence_parallel=true"}), {});
    REQUIRE(one.ok());
    REQUIRE(two.ok());
    REQUIRE(seq.ok());
    const core::model_config& m = base.model;
    const std::uint64_t C = m.hidden_size, F = m.ffn_size(), V = m.vocab_size, L = m.num_layers;
    const std::uint64_t kv = static_cast<std::uint64_t>(m.kv_heads()) * m.head_dim();
    REQUIRE(V % 2 == 0);  // no vocabulary padding at tp 2
    const std::uint64_t split =
        arch == core::arch_kind::gpt2
            ? L * (3 * C * C + 3 * C + C * C + F * C + F + C * F) + 2 * V * C  // wte, lm_head
            : L * (2 * C * C + 2 * kv * C + 3 * F * C) + 2 * V * C;
    const double halved = static_cast<double>(term(one->ranks[0], "fp32 parameters") -
                                              term(two->ranks[0], "fp32 parameters"));
    // At tp 1 a tied head reads the embedding (model::chunk::shares_head): no copy to halve.
    const std::uint64_t head_copy = m.tie_embeddings ? V * C : 0;
    CHECK(halved == doctest::Approx(static_cast<double>((split / 2 - head_copy) * 4)).epsilon(0.02));
    CHECK(term(two->ranks[0], "fp32 parameters") == term(two->ranks[1], "fp32 parameters"));
    CHECK(two->ranks[0].saved_per_microbatch < one->ranks[0].saved_per_microbatch);
    CHECK(seq->ranks[0].saved_per_microbatch < two->ranks[0].saved_per_microbatch);
    CHECK(plan::rank_name(*two, two->ranks[1]) == "dp0/tp1/pp0");
    CHECK(plan::rank_name(*one, one->ranks[0]) == "dp0/pp0");
  }
}

TEST_CASE("the coordinator's evaluation copy: planned on worker 0's device, matching a CPU run "
          "within 10 %, without gradients") {
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO((arch == core::arch_kind::gpt2 ? "gpt2" : "llama"));
    scratch_dir tmp("plan_eval");
    core::config c = layout(tmp, arch, 1, 2, core::recompute_mode::none, 0);
    c.data.val = tiny_run(tmp, arch).data.val;
    c.train.eval_interval = 2;
    plan::plan_options po;
    po.suggest = false;
    auto p = plan::make_plan(c, po);
    REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.err().to_string()));
    std::uint64_t params = 0, low = 0, planned = 0;
    for (const auto& r : p->ranks) {
      if (r.dp == 0) {
        params = term(r, "fp32 parameters");  // the whole model's (pipeline_stage 1)
        low = term(r, "low-precision weights");
        planned = r.evaluation;
        CHECK(term(r, "evaluation copy of the model") == r.evaluation);
      } else {
        CHECK(r.evaluation == 0);
      }
    }
    // Its weights and one layer's work at a time: a copy that made gradients (as large as its
    // fp32 parameters) or kept a training micro-batch's activations would be larger.
    CHECK(planned >= params + low);
    CHECK(planned < params + low + params / 2);

    run_and_measure(c);
    std::ifstream f(c.runtime.run_dir + "/metrics.jsonl");
    std::string line;
    std::uint64_t measured = 0;
    while (std::getline(f, line))
      if (!line.empty())
        measured = std::max(measured, nlohmann::json::parse(line).value(
                                          "evaluation_peak_device_bytes", std::uint64_t{0}));
    INFO("evaluation copy: planned ", planned, " measured ", measured);
    REQUIRE(measured > 0);
    CHECK(rel(planned, measured) <= 0.10);

    // Without validation data the coordinator makes no copy.
    c.data.val.clear();
    auto none = plan::make_plan(c, po);
    REQUIRE(none.ok());
    CHECK(none->ranks.front().evaluation == 0);
  }
}
