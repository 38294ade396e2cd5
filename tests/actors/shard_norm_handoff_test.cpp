// The optimizer shard's side of norm_handoff (actors/stage_engine.hpp), driven directly as a stage
// would drive it: with one replica the shard adopts the stage's gradient buffer and, when the
// stage marked block sums for that very step and buffer, adds those instead of reading the
// gradient again. Sums of the true blocks give the shard's own bits; sums marked for another step
// or another buffer are not taken; and sums that are taken are what the norm says (poisoned ones
// show through), so a shard that silently stopped taking them fails here.
#include "actors/shard_engine.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "core/exact_sum.hpp"
#include "kernels/message_hash.hpp"
#include "tests/kernels/cuda_test_util.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace {

using namespace troupe;
using namespace troupe::actors;
using model::testing::scratch_dir;

transport::tag grad_tag(std::int64_t step) {
  return transport::tag{step, static_cast<std::uint32_t>(tensor_kind::grad_slice), 0, -1, 0};
}

}  // namespace

TEST_CASE("shard engine: takes the stage's norm blocks only for the step and buffer they are of") {
  scratch_dir tmp("shard_norm_handoff");
  core::config cfg = model::testing::tiny_run(tmp);
  auto be = kernels::make_backend("cpu");
  // A chunk buffer of 4 blocks: a tensor over a block and a half, a whole block, and a tied copy
  // (left out of the norm) in the last.
  const std::int64_t n = 4 * kernels::norm_block;
  const std::vector<model::param_info> infos = {
      {"a", {1500}, 0, 1500, true, false},
      {"b", {1024}, 2 * kernels::norm_block, 1024, true, false},
      {"tied", {10}, 3 * kernels::norm_block, 10, true, true}};
  core::tensor params = kernels::cuda_test::random_host({n}, 301, 0.1f);
  const core::tensor grad = kernels::cuda_test::random_host({n}, 302);
  const job_layout one;  // one replica, one stage: the shard adopts the gradient
  shard_engine shard(cfg, one, 0, 0, *be, {shard_chunk{0, infos, params, {}}});
  std::shared_ptr<norm_handoff> h = shard.norm_blocks(0);
  REQUIRE(h != nullptr);
  CHECK(h->counts == std::vector<std::int32_t>{1024, 476, 1024, 0});

  // One step: deliver the gradient, reduce, and return the norm part's words.
  std::int64_t step = 0;
  auto norm_words = [&] {
    shard.deliver(0, grad_tag(step), grad);
    REQUIRE(shard.reduce(step));
    auto parts = shard.take_norm_parts();
    REQUIRE(parts.size() == 1);
    shard.apply(step, 1.0f, 1e-4);
    shard.take_outgoing();
    ++step;
    return parts[0].second;
  };
  const std::vector<std::int64_t> own = norm_words();  // nothing marked: the shard's own pass

  h->device_counts = core::tensor::zeros({4}, core::dtype::i32);
  for (int b = 0; b < 4; ++b) h->device_counts.data<std::int32_t>()[b] = h->counts[b];
  h->sums = core::tensor::zeros({4}, core::dtype::f64);
  core::tensor blocks = core::tensor::zeros({4}, core::dtype::i64);
  be->message_hash_sumsq_blocks(grad, h->device_counts, blocks, h->sums);
  h->mark(step, grad.raw());
  CHECK(norm_words() == own);  // the stage's true sums: the same bits

  // Poisoned sums marked for this step and buffer are taken...
  for (int b = 0; b < 4; ++b) h->sums.data<double>()[b] = 0.25 * (b + 1);
  h->mark(step, grad.raw());
  core::exact_sum poisoned;
  for (int b = 0; b < 4; ++b) poisoned.add(0.25 * (b + 1));
  const std::vector<std::int64_t> taken = norm_words();
  CHECK(taken == std::vector<std::int64_t>(poisoned.words, poisoned.words + core::exact_sum_words));
  CHECK(taken != own);
  // ...but not when they are of an earlier step, or of another buffer.
  CHECK(norm_words() == own);
  const core::tensor other = grad.clone();
  h->mark(step, other.raw());
  CHECK(norm_words() == own);
}
