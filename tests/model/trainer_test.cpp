#include "model/trainer.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/metrics.hpp"
#include "model/params.hpp"
#include "tests/model/poisoned_step.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "kernels/select.hpp"

namespace {

namespace fs = std::filesystem;
namespace ck = troupe::model::checkpoint;
using troupe::model::testing::file_bytes;
using troupe::model::testing::scratch_dir;
using troupe::model::testing::tiny_run;

troupe::model::train_summary run(const troupe::core::config& cfg,
                                 troupe::model::train_options opt = {}) {
  opt.log = nullptr;
  auto r = troupe::model::train_single_rank(cfg, opt);
  REQUIRE_MESSAGE(r.ok(), r.err().to_string());
  return std::move(r.value());
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// The saved weights and moments, compared as bytes of the checkpoint's tensor data.
void check_same_checkpoint(const std::string& a, const std::string& b) {
  auto ra = ck::reader::open(a);
  auto rb = ck::reader::open(b);
  REQUIRE(ra.ok());
  REQUIRE(rb.ok());
  REQUIRE(ra->info().tensors.size() == rb->info().tensors.size());
  // No structured binding: clang 14 cannot capture one (INFO below).
  for (const auto& entry : ra->info().tensors) {
    const auto& name = entry.first;
    const auto& rec = entry.second;
    INFO("tensor ", name);
    REQUIRE(rb->contains(name));
    CHECK(rec.xxh64 == rb->info().tensors.at(name).xxh64);
  }
  CHECK(file_bytes(a + "/model.safetensors") == file_bytes(b + "/model.safetensors"));
  CHECK(file_bytes(a + "/optimizer.safetensors") == file_bytes(b + "/optimizer.safetensors"));
}

}  // namespace

TEST_CASE("training starts near ln(vocab) and lowers the loss of a patterned corpus") {
  scratch_dir tmp("trainer");
  auto cfg = tiny_run(tmp);
  cfg.train.steps = 12;
  auto s = run(cfg);
  REQUIRE(s.losses.size() == 12);
  CHECK(s.losses.front() == doctest::Approx(std::log(64.0)).epsilon(0.05));
  CHECK(s.losses.back() < s.losses.front() - 0.5);
  REQUIRE(s.final_val_loss.has_value());
  CHECK(*s.final_val_loss < std::log(64.0) - 0.3);
  CHECK(fs::path(s.checkpoint).filename() == "step_000012");
  CHECK(fs::exists(cfg.runtime.run_dir + "/config.toml"));
}

TEST_CASE("the same config twice gives bit-identical losses and weights") {
  scratch_dir a("trainer"), b("trainer");
  auto ca = tiny_run(a);
  auto cb = tiny_run(b);
  auto sa = run(ca);
  auto sb = run(cb);
  CHECK(same_bits(sa.losses, sb.losses));
  CHECK(same_bits(sa.grad_norms, sb.grad_norms));
  check_same_checkpoint(sa.checkpoint, sb.checkpoint);
}

TEST_CASE("training 2k steps equals training k, resuming, and training k more, bit for bit") {
  for (auto arch : {troupe::core::arch_kind::gpt2, troupe::core::arch_kind::llama}) {
    INFO("arch ", arch == troupe::core::arch_kind::gpt2 ? "gpt2" : "llama");
    scratch_dir a("trainer"), b("trainer");
    auto ca = tiny_run(a, arch);
    auto cb = tiny_run(b, arch);
    auto whole = run(ca);

    troupe::model::train_options first;
    first.max_steps = 3;
    auto part1 = run(cb, first);
    CHECK(part1.end_step == 3);
    troupe::model::train_options rest;
    rest.resume = cb.runtime.run_dir;
    auto part2 = run(cb, rest);
    CHECK(part2.first_step == 3);

    std::vector<double> joined = part1.losses;
    joined.insert(joined.end(), part2.losses.begin(), part2.losses.end());
    CHECK(same_bits(whole.losses, joined));
    check_same_checkpoint(whole.checkpoint, part2.checkpoint);

    // The resumed run's metrics continue the first part's, one line per step.
    std::ifstream in(cb.runtime.run_dir + "/metrics.jsonl");
    int line_no = 0;
    for (std::string line; std::getline(in, line); ++line_no) {
      auto m = troupe::model::parse_json_line(line);
      REQUIRE(m.ok());
      CHECK(m->step == line_no);
      CHECK(m->loss == static_cast<float>(joined[line_no]));
    }
    CHECK(line_no == ca.train.steps);
  }
}

TEST_CASE("the loop gives the same bits with the model split into two chunks") {
  scratch_dir tmp("trainer");
  auto cfg = tiny_run(tmp);
  auto be = troupe::kernels::make_backend("cpu");
  auto one = troupe::model::trainer::create(cfg, *be, 1);
  auto two = troupe::model::trainer::create(cfg, *be, 2);
  REQUIRE(one.ok());
  REQUIRE(two.ok());
  for (int step = 0; step < 4; ++step) {
    auto r1 = (*one)->train_step(step);
    auto r2 = (*two)->train_step(step);
    REQUIRE(r1.ok());
    REQUIRE(r2.ok());
    CHECK(std::memcmp(&r1->loss, &r2->loss, sizeof(double)) == 0);
    CHECK(std::memcmp(&r1->grad_norm, &r2->grad_norm, sizeof(double)) == 0);
  }
  CHECK((*one)->validation_loss() == (*two)->validation_loss());
  auto& whole = (*one)->chunks()[0];
  for (auto& part : (*two)->chunks())
    for (const auto& p : part.params())
      CHECK_MESSAGE(std::memcmp(part.param(p.name).raw(), whole.param(p.name).raw(), p.numel * 4) == 0,
                    p.name);
}

TEST_CASE("the tied head copy stays equal to the embedding through training") {
  // Split over two chunks the head holds a copy; in one chunk it reads the embedding itself, and
  // both train the same bits.
  scratch_dir tmp("trainer"), one_tmp("trainer");
  auto cfg = tiny_run(tmp);
  auto be = troupe::kernels::make_backend("cpu");
  auto t = troupe::model::trainer::create(cfg, *be, 2);
  REQUIRE(t.ok());
  auto one_cfg = tiny_run(one_tmp);
  auto one = troupe::model::trainer::create(one_cfg, *be);
  REQUIRE(one.ok());
  REQUIRE((*one)->chunks().size() == 1);
  CHECK((*one)->chunks()[0].shares_head());
  for (int step = 0; step < 3; ++step) {
    REQUIRE((*t)->train_step(step).ok());
    REQUIRE((*one)->train_step(step).ok());
  }
  REQUIRE((*t)->chunks().size() == 2);
  CHECK(!(*t)->chunks()[1].shares_head());
  const std::string emb = troupe::model::embedding_name(cfg.model);
  auto wte = (*t)->chunks()[0].param(emb);
  auto head = (*t)->chunks()[1].param("lm_head.weight");
  CHECK(std::memcmp(wte.raw(), head.raw(), wte.bytes()) == 0);
  auto shared = (*one)->chunks()[0].param(emb);
  CHECK(std::memcmp(wte.raw(), shared.raw(), wte.bytes()) == 0);
}

TEST_CASE("micro_batch_num and gradient_accumulation_steps with the same product agree bitwise") {
  scratch_dir a("trainer"), b("trainer");
  auto ca = tiny_run(a);
  auto cb = tiny_run(b);
  ca.parallel.micro_batch_num = 4;
  cb.parallel.micro_batch_num = 2;
  cb.train.gradient_accumulation_steps = 2;
  auto sa = run(ca);
  auto sb = run(cb);
  CHECK(same_bits(sa.losses, sb.losses));
  check_same_checkpoint(sa.checkpoint, sb.checkpoint);
}

TEST_CASE("tokens per step count every micro-batch of the global batch") {
  scratch_dir tmp("trainer");
  auto cfg = tiny_run(tmp);
  cfg.train.gradient_accumulation_steps = 3;
  auto be = troupe::kernels::make_backend("cpu");
  auto t = troupe::model::trainer::create(cfg, *be);
  REQUIRE(t.ok());
  CHECK((*t)->micro_batches() == 2 * 3);
  CHECK((*t)->tokens_per_step() == 2 * 3 * 2 * 16);
}

TEST_CASE("metrics.jsonl has a line per step with validation where it ran") {
  scratch_dir tmp("trainer");
  auto cfg = tiny_run(tmp);
  auto s = run(cfg);
  std::ifstream in(cfg.runtime.run_dir + "/metrics.jsonl");
  std::vector<troupe::model::step_metrics> lines;
  for (std::string line; std::getline(in, line);) {
    auto m = troupe::model::parse_json_line(line);
    REQUIRE(m.ok());
    lines.push_back(m.value());
  }
  REQUIRE(lines.size() == 6);
  for (int i = 0; i < 6; ++i) {
    CHECK(lines[i].loss == static_cast<float>(s.losses[i]));
    CHECK(lines[i].grad_norm == static_cast<float>(s.grad_norms[i]));
    CHECK(lines[i].val_loss.has_value() == (i == 2 || i == 5));  // eval_interval 3, and the end
  }
  CHECK(*lines[5].val_loss == static_cast<float>(*s.final_val_loss));
  CHECK(lines[0].lr == static_cast<float>(cfg.optimizer.lr / 2));  // warm-up step 1 of 2
}

TEST_CASE("resuming from a checkpoint of another model is refused") {
  scratch_dir tmp("trainer");
  auto cfg = tiny_run(tmp);
  cfg.train.steps = 1;
  run(cfg);
  cfg.model.hidden_size = 64;
  troupe::model::train_options opt;
  opt.resume = cfg.runtime.run_dir;
  opt.log = nullptr;
  auto r = troupe::model::train_single_rank(cfg, opt);
  REQUIRE_FALSE(r.ok());
  CHECK(r.err().to_string().find("different model") != std::string::npos);
}

TEST_CASE("a NaN loss stops the step naming it, with the parameters left as they were") {
  scratch_dir tmp("trainer");
  auto cfg = tiny_run(tmp);
  auto be = troupe::kernels::make_backend("cpu");
  auto t = troupe::model::trainer::create(cfg, *be);
  REQUIRE(t.ok());
  for (int step = 0; step < 2; ++step) REQUIRE((*t)->train_step(step).ok());
  troupe::model::testing::check_poisoned_step(**t, *be, 2);
}
