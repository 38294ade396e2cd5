// The masked loss of instruction data (model/trainer.hpp, step 8; model/loader.hpp): the loss of a
// step is the mean over the trained targets of the whole global batch, validation reports the same
// masked mean, and a masked target has no influence at all.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/select.hpp"
#include "model/checkpoint.hpp"
#include "model/instruction_shards.hpp"
#include "model/loader.hpp"
#include "model/trainer.hpp"
#include "tests/model/trainer_fixture.hpp"

using namespace troupe;
using namespace troupe::model;
using model::testing::scratch_dir;

namespace {

// Σ over the unmasked targets of −log softmax(logits)[target], in float64, from the model's own
// logits (forward_logits), and how many there were.
std::pair<double, std::int64_t> masked_sum(chunk& whole, kernels::backend& be, const batch& b) {
  tensor logits = whole.forward_logits(b.tokens);
  tensor host = be.dev().is_cpu() ? logits : be.to_host(logits);
  const std::int64_t V = host.dim(-1);
  double total = 0;
  std::int64_t n = 0;
  for (std::int64_t r = 0; r < b.targets.numel(); ++r) {
    const std::int32_t t = b.targets.data<std::int32_t>()[r];
    if (t < 0) continue;
    const float* x = host.data<float>() + r * V;
    double m = x[0];
    for (std::int64_t i = 1; i < V; ++i) m = std::max(m, static_cast<double>(x[i]));
    double z = 0;
    for (std::int64_t i = 0; i < V; ++i) z += std::exp(x[i] - m);
    total += std::log(z) + m - x[t];
    ++n;
  }
  return {total, n};
}

std::vector<double> losses_of(const core::config& cfg, std::string* checkpoint = nullptr) {
  train_options opt;
  opt.log = nullptr;
  auto r = train_single_rank(cfg, opt);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  if (checkpoint) *checkpoint = r->checkpoint;
  return r->losses;
}

// A copy of the rows at `from` with the last token of each row changed where `masked_last` says
// (the last token is never an input, only the target of the token before it).
void rewrite_last_tokens(const std::string& from, const std::string& to, bool masked_last,
                         int vocab) {
  auto s = instruction_shard::open(from);
  REQUIRE(s.ok());
  const int L = s->layout().row_tokens;
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> mask;
  int changed = 0;
  for (std::size_t r = 0; r < s->rows(); ++r)
    for (int t = 0; t < L; ++t) {
      auto id = static_cast<std::int32_t>(s->token(r, t));
      const std::uint8_t m = s->mask(r)[static_cast<std::size_t>(t)];
      if (t == L - 1 && (m == 0) == masked_last) {
        id = (id + 7) % vocab;
        ++changed;
      }
      ids.push_back(id);
      mask.push_back(m);
    }
  REQUIRE(changed > 10);
  REQUIRE(write_instruction_shard(to, s->layout(), ids, mask).ok());
}

std::map<std::string, std::uint64_t> tensor_hashes(const std::string& ck) {
  auto r = checkpoint::reader::open(ck);
  REQUIRE(r.ok());
  std::map<std::string, std::uint64_t> out;
  for (const auto& [name, rec] : r->info().tensors) out[name] = rec.xxh64;
  return out;
}

}  // namespace

TEST_CASE("the step loss and the validation loss are the mean over the trained targets") {
  scratch_dir tmp("masked_mean");
  core::config cfg = testing::tiny_run(tmp);
  testing::use_instruction_data(cfg, tmp);
  auto be = kernels::make_backend("cpu");
  auto made = trainer::create(cfg, *be);
  REQUIRE(made.ok());
  trainer& tr = *made.value();

  loader_options lo = loader_options::from(cfg);
  lo.micro_batches = tr.micro_batches();
  auto train = loader::open(cfg.data.train, lo);
  auto val = loader::open(cfg.data.val, lo);
  REQUIRE(train.ok());
  REQUIRE(val.ok());
  // Before the update: the model the first step's forward sees.
  double total = 0;
  std::int64_t n = 0;
  for (int mb = 0; mb < tr.micro_batches(); ++mb) {
    auto [s, k] = masked_sum(tr.chunks().front(), *be, train->cut(0, 0, mb));
    total += s;
    n += k;
  }
  REQUIRE(n < tr.tokens_per_step());  // the mask is in effect
  REQUIRE(n > 0);
  CHECK(n == train->trained_targets(0, static_cast<std::uint64_t>(tr.micro_batches()) *
                                           static_cast<std::uint64_t>(cfg.parallel.micro_batch_size)));
  auto r = tr.train_step(0);
  REQUIRE(r.ok());
  INFO("trainer " << r->loss << ", float64 masked mean " << total / n);
  CHECK(std::abs(r->loss - total / static_cast<double>(n)) <= 1e-5 * (total / n));
  CHECK(r->tokens == tr.tokens_per_step());

  double vtotal = 0;
  std::int64_t vn = 0;
  for (int i = 0; i < cfg.train.eval_batches; ++i) {
    auto [s, k] = masked_sum(tr.chunks().front(), *be, val->eval_cut(i));
    vtotal += s;
    vn += k;
  }
  const double v = tr.validation_loss();
  INFO("validation " << v << ", float64 masked mean " << vtotal / vn);
  CHECK(std::abs(v - vtotal / static_cast<double>(vn)) <= 1e-5 * (vtotal / vn));
}

TEST_CASE("changing masked targets changes neither the losses nor the trained weights") {
  scratch_dir tmp("masked_target");
  core::config cfg = testing::tiny_run(tmp);
  testing::use_instruction_data(cfg, tmp);
  cfg.train.steps = 3;
  cfg.train.eval_interval = 0;
  std::string ck_ref;
  const std::vector<double> ref = losses_of(cfg, &ck_ref);
  const auto ref_hashes = tensor_hashes(ck_ref);

  auto other = cfg;
  rewrite_last_tokens(cfg.data.train, tmp / "masked_changed.bin", true, cfg.model.vocab_size);
  other.data.train = tmp / "masked_changed.bin";
  other.runtime.run_dir = tmp / "run_masked";
  std::string ck_masked;
  const std::vector<double> masked = losses_of(other, &ck_masked);
  REQUIRE(masked.size() == ref.size());
  CHECK(std::memcmp(masked.data(), ref.data(), ref.size() * sizeof(double)) == 0);
  CHECK(tensor_hashes(ck_masked) == ref_hashes);

  // The control: the same change to trained targets does change the run.
  auto trained = cfg;
  rewrite_last_tokens(cfg.data.train, tmp / "trained_changed.bin", false, cfg.model.vocab_size);
  trained.data.train = tmp / "trained_changed.bin";
  trained.runtime.run_dir = tmp / "run_trained";
  std::string ck_trained;
  const std::vector<double> changed = losses_of(trained, &ck_trained);
  CHECK(std::memcmp(changed.data(), ref.data(), ref.size() * sizeof(double)) != 0);
  CHECK(tensor_hashes(ck_trained) != ref_hashes);
}

TEST_CASE("training on instruction data lowers the masked loss") {
  scratch_dir tmp("masked_learn");
  core::config cfg = testing::tiny_run(tmp);
  testing::use_instruction_data(cfg, tmp);
  cfg.train.steps = 12;
  const std::vector<double> l = losses_of(cfg);
  CHECK(l.back() < l.front() - 0.5);
}
