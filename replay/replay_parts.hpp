// The parts of `troupe replay` (replay/replay.cpp): what it reads from a run directory, the
// comparison of re-sent tensors with the recorded ones, and the replay of one worker alone
// (`--rank R`), which drives that worker's stage and optimizer-shard engines directly, without
// CAF: their inputs from other workers are the bytes recorded in rank_<R>.tensors, and every
// tensor they send is compared with rank_<R>.log. Internal to replay and its tests.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "actors/recorder.hpp"
#include "replay/replay.hpp"
#include "core/config.hpp"
#include "model/safetensors.hpp"

namespace troupe::actors {

/// A recorded run: its config, invocations and every worker's records.
struct recorded_run {
  std::string dir;
  core::config cfg;
  std::string config_text;
  int workers = 1;
  std::vector<segment_header> segments;                       // rank 0's; every log agrees
  std::map<message_key, message_record> records;              // every worker's
  std::map<std::pair<int, std::int64_t>, clip_record> clips;  // (worker, step)
};

/// Reads RUN_DIR/config.toml and every worker's message log; refuses runs that were not recorded,
/// logs of another run or config, and damaged logs.
core::result<recorded_run> load_recorded_run(const std::string& run_dir);

/// Compares the tensors a replay sends with the recorded ones of steps [lo, hi) that are in scope
/// (all of them, or one worker's). Not synchronised: callers from several threads lock.
class message_checker {
 public:
  message_checker(const recorded_run& run, std::int64_t lo, std::int64_t hi, bool keep_tensors,
                  std::function<bool(const message_record&)> in_scope);
  /// Checks one tensor sent (tensors of other steps pass); false at a difference, which
  /// mismatch() then describes.
  bool check(const message_record& r, const core::tensor& bytes);
  /// After the replay: a recorded tensor in scope that was never sent is a difference too.
  void finish();

  const std::optional<std::string>& mismatch() const { return mismatch_; }
  std::int64_t mismatch_step() const { return mismatch_step_; }
  std::int64_t matched() const { return static_cast<std::int64_t>(seen_.size()); }
  /// Copies of the tensors of `step` sent so far (kept for the two newest steps), named by tag.
  std::vector<model::safetensors::named_tensor> tensors_of(std::int64_t step) const;

 private:
  void fail(std::int64_t step, std::string what);
  void keep(const message_record& r, const core::tensor& bytes);

  const recorded_run& run_;
  std::int64_t lo_, hi_;
  bool keep_;
  std::function<bool(const message_record&)> in_scope_;
  std::set<message_key> seen_;
  std::optional<std::string> mismatch_;
  std::int64_t mismatch_step_ = -1;
  std::map<std::int64_t, std::map<std::string, core::tensor>> kept_;
};

/// Writes `tensors` to DIR/step_<step>.safetensors; `path` receives the file's name.
core::status write_dump(const std::string& dir, std::int64_t step,
                        std::vector<model::safetensors::named_tensor> tensors, std::string& path);

/// Replays worker `opt.rank` alone through steps [first recorded step, last_step].
core::result<replay_report> replay_one_rank(const recorded_run& run, const replay_options& opt,
                                            int last_step);

}  // namespace troupe::actors
