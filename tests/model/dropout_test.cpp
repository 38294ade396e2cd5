// Dropout in the model chunks: the masks are redrawn from keyed streams, so with dropout on every
// split, recompute mode and backward split still gives the same bits; with the rates at 0, or in
// a forward without a training context (evaluation), nothing is drawn and every bit is as without
// dropout.
#include <doctest/doctest.h>

#include "kernels/select.hpp"
#include "model/chunk.hpp"
#include "tests/model/chunk_harness.hpp"

namespace troupe::model {
namespace {

using core::arch_kind;
using core::recompute_mode;
using namespace model::testing;

struct run_result {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> grads;
};

/// Two micro-batches of 2 sequences (global sequences 4-5 and 6-7 of step 3), forward both then
/// backward both; masks drawn when `train`.
run_result run_two(const core::model_config& cfg, kernels::backend& be, int parts,
                   recompute_mode mode, bool split_backward, bool train) {
  auto chunks = make_chunks(cfg, be, parts);
  for (auto& c : chunks) {
    c.init(17);
    c.set_recompute(mode);
  }
  run_result r;
  for (int mb = 0; mb < 2; ++mb) {
    const dropout_ctx drop = train ? training_dropout(cfg, 9, 3, 4 + 2 * mb) : dropout_ctx{};
    r.losses.push_back(forward_all(chunks, mb, random_tokens(cfg, 2, 100 + mb),
                                   random_tokens(cfg, 2, 200 + mb), 1.0f / 32, drop));
  }
  for (int mb = 0; mb < 2; ++mb) backward_all(chunks, mb, split_backward);
  r.grads = by_name(chunks, be, true);
  return r;
}

core::model_config dropout_config(arch_kind arch, float attention, float hidden) {
  core::model_config cfg = tiny_config(arch, 4);
  cfg.attention_dropout = attention;
  cfg.hidden_dropout = hidden;
  return cfg;
}

}  // namespace

TEST_CASE("with dropout, chunk splits, recompute modes and split backward give the same bits") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : {arch_kind::gpt2, arch_kind::llama}) {
    CAPTURE(static_cast<int>(arch));
    const core::model_config cfg = dropout_config(arch, 0.3f, 0.2f);
    const run_result ref = run_two(cfg, *be, 1, recompute_mode::none, false, true);
    // The masks are drawn: the same step without them differs.
    const run_result plain = run_two(cfg, *be, 1, recompute_mode::none, false, false);
    CHECK(plain.losses != ref.losses);
    for (int parts : {1, 2, 4})
      for (recompute_mode mode :
           {recompute_mode::none, recompute_mode::selective, recompute_mode::full})
        for (bool split : {false, true}) {
          CAPTURE(parts);
          CAPTURE(static_cast<int>(mode));
          CAPTURE(split);
          const run_result r = run_two(cfg, *be, parts, mode, split, true);
          CHECK(r.losses == ref.losses);
          CHECK(differing(ref.grads, r.grads).empty());
        }
  }
}

TEST_CASE("dropout rates 0, or a forward without a training context, draw nothing") {
  auto be = kernels::make_backend("cpu");
  for (arch_kind arch : {arch_kind::gpt2, arch_kind::llama}) {
    CAPTURE(static_cast<int>(arch));
    const run_result before = run_two(tiny_config(arch, 4), *be, 2, recompute_mode::none, false, false);
    // Rates 0 with a training context: the ops of a model without dropout, bit for bit.
    const run_result zero = run_two(dropout_config(arch, 0, 0), *be, 2, recompute_mode::none, false, true);
    CHECK(zero.losses == before.losses);
    CHECK(differing(before.grads, zero.grads).empty());
    // Rates set but no training context (what evaluation passes): nothing is dropped.
    const run_result eval = run_two(dropout_config(arch, 0.3f, 0.2f), *be, 2, recompute_mode::none, false, false);
    CHECK(eval.losses == before.losses);
    CHECK(differing(before.grads, eval.grads).empty());
    // One rate at a time is drawn on its own.
    const run_result hidden = run_two(dropout_config(arch, 0, 0.2f), *be, 2, recompute_mode::none, false, true);
    const run_result attention = run_two(dropout_config(arch, 0.3f, 0), *be, 2, recompute_mode::none, false, true);
    CHECK(hidden.losses != before.losses);
    CHECK(attention.losses != before.losses);
    CHECK(attention.losses != hidden.losses);
  }
}

}  // namespace troupe::model
