#include "runtime/preflight.hpp"

#include <fmt/format.h>

#include "model/loader.hpp"
#include "runtime/build.hpp"

namespace troupe::actors {

core::status preflight(const core::config& cfg) {
  if (auto st = core::check_files(cfg); !st) return st;
  const job_layout layout = layout_of(cfg);
  if (auto s = build_schedule(cfg, layout.microbatches); !s) return s.err();
  const auto opts = model::loader_options::from(cfg);
  if (auto train = model::loader::open(cfg.data.train, opts); !train) {
    core::error e = train.err();
    if (e.where.key.empty()) e.where.key = "data.train";
    return e;
  }
  if (cfg.data.val.empty()) return {};
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
