#include "runtime/preflight.hpp"

#include <fmt/format.h>

#include "model/loader.hpp"
#include "runtime/build.hpp"

namespace troupe::actors {

using core::derive;

static core::status check_validation(const core::config& cfg);

core::status preflight(const core::config& cfg) {
  if (auto st = core::check_files(cfg); !st) return st;
  const auto opts = model::loader_options::from(cfg);
  auto train = model::loader::open(cfg.data.train, opts);
  if (!train) {
    core::error e = train.err();
    if (e.where.key.empty()) e.where.key = "data.train";
    return e;
  }
  // A step draws its global batch from the training data's windows; a batch larger than the data
  // (2^20 micro-batches of a small shard) re-reads the same sequences many times a step and
  // makes every step take as long as that.
  const std::uint64_t batch = static_cast<std::uint64_t>(derive(cfg).global_batch);
  if (batch > train->windows())
    return core::config_error(
        cfg, "parallel.micro_batch_num",
        fmt::format("a step's global batch of {} sequences (micro_batch_size {} x micro_batch_num "
                    "{} x gradient_accumulation_steps {} x data_parallel {}) is larger than the {} "
                    "distinct sequences data.train ({} tokens) holds",
                    batch, cfg.parallel.micro_batch_size, cfg.parallel.micro_batch_num,
                    cfg.train.gradient_accumulation_steps, cfg.parallel.data_parallel,
                    train->windows(), train->tokens()),
        "use more training data or a smaller batch");
  if (!cfg.data.val.empty())
    if (auto st = check_validation(cfg); !st) return st;
  // Last: the schedule's size is proportional to the batch checked above.
  if (auto s = build_schedule(cfg, layout_of(cfg).microbatches); !s) return s.err();
  return {};
}

static core::status check_validation(const core::config& cfg) {
  const auto opts = model::loader_options::from(cfg);
  auto val = model::loader::open(cfg.data.val, opts);
  if (!val) {
    core::error e = val.err();
    if (e.where.key.empty()) e.where.key = "data.val";
    return e;
  }
  // An evaluation draws eval_batches x micro_batch_size windows of the validation data; more
  // draws than the data has distinct windows only repeat them (and 2^31 batches never end).
  const std::uint64_t draws = static_cast<std::uint64_t>(cfg.train.eval_batches) *
                              static_cast<std::uint64_t>(cfg.parallel.micro_batch_size);
  const std::uint64_t windows = val->windows();
  if (draws > windows) {
    const std::uint64_t most = std::max<std::uint64_t>(
        1, windows / static_cast<std::uint64_t>(cfg.parallel.micro_batch_size));
    return core::config_error(
        cfg, "train.eval_batches",
        fmt::format("eval_batches {} x micro_batch_size {} = {} validation sequences per "
                    "evaluation, but data.val ({} tokens) holds only {} distinct ones",
                    cfg.train.eval_batches, cfg.parallel.micro_batch_size, draws, val->tokens(),
                    windows),
        fmt::format("more would only evaluate the same sequences again: use eval_batches <= {}",
                    most));
  }
  return {};
}

}  // namespace troupe::actors
