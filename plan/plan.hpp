// `troupe plan`: before a job allocates anything, what each rank will hold on its device and how
// long a step will take, and whether that fits. Memory comes from a dry run of the job's own code
// on meta backends (dry_run.hpp); time from the cost model and the schedule simulator
// (cost_model.hpp). search() enumerates layouts of a model and global batch on N devices.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "plan/cost_model.hpp"
#include "plan/dry_run.hpp"

namespace troupe::plan {

struct plan_options {
  /// Bytes of one device; 0 = unknown (the plan then says nothing about fitting).
  std::uint64_t device_memory = 0;
  /// true: every worker in one process on one device (`troupe train`); false: one process and one
  /// device per worker (`troupe launch`).
  bool one_device = true;
  calibration cal;
  /// Try the usual remedies when the layout does not fit (each is another dry run).
  bool suggest = true;
  /// Steps of the dry run (the second sees what one step leaves for the next).
  int dry_run_steps = 2;
  /// When > 0 and smaller than the config's micro-batches per step: dry-run that many instead,
  /// if the schedule then keeps the same peak number in flight on every rank (the warm-up is
  /// over before it; the steady state repeats). The step time still uses every micro-batch.
  int dry_run_microbatches = 0;
};

/// One named amount of memory.
struct memory_term {
  std::string name;
  std::uint64_t bytes = 0;
};

/// What one worker (dp, pp, tp) holds at its peak.
struct rank_plan {
  int dp = 0, pp = 0, tp = 0;
  std::uint64_t stage_peak = 0;  // the stage backend's allocator peak (what metrics report)
  std::uint64_t shard_peak = 0;  // its optimizer shard's
  /// The coordinator's evaluation copy of the model (worker 0 only, with data.val; else 0).
  std::uint64_t evaluation = 0;
  std::uint64_t reserve = 0;     // device context and allocator slack, beyond the peaks
  /// optimizer.offload: host bytes of its shard's master slices and moments and its staging
  /// buffers for gradient pieces (all page-locked); 0 without offload.
  std::uint64_t host_bytes = 0;
  std::vector<memory_term> terms;  // the peaks split by kind, largest first
  std::uint64_t saved_per_microbatch = 0;  // one micro-batch's saved activations (all chunks)
  int peak_in_flight = 0;                  // the schedule's most (chunk, micro-batch) passes in flight
  std::uint64_t total() const { return stage_peak + shard_peak + evaluation + reserve; }
};

/// Another layout that fits, found when this one does not.
struct suggestion {
  std::string change;            // "--set recompute.mode=full"
  std::uint64_t need = 0;        // bytes on the fullest device with the change
};

struct job_plan {
  std::string name;              // a one-line description of the layout
  std::string device;            // cpu | cuda
  int dp = 1, tp = 1, pp = 1, v = 1, microbatches = 1, micro_batch_size = 1, zero_stage = 0;
  bool sequence_parallel = false;
  std::string schedule, recompute, precision;
  std::vector<int> chunk_layers;  // layers of each model chunk (core::chunk_layers)
  bool one_device = true;
  std::vector<rank_plan> ranks;
  std::uint64_t device_memory = 0;  // 0 = unknown
  std::uint64_t need = 0;           // bytes on the fullest device
  bool offload = false;             // optimizer.offload
  std::uint64_t host_need = 0;      // offload: host bytes of every rank's optimizer state
  bool fits = true;
  std::string largest_term;         // on the fullest device
  // Time (seconds): the simulated pipeline, the optimizer's tail, the step.
  double pipeline_s = 0, optimizer_s = 0, step_s = 0, bubble = 0, tokens_per_s = 0;
  /// What the pipeline time was divided by for workers side by side on one device (1: not).
  double concurrent_speedup = 1;
  std::int64_t tokens_per_step = 0;
  std::string calibration;          // "defaults" or the file
  std::vector<suggestion> suggestions;
};

/// Plans `cfg` (validated). Errors: the schedule does not build, or the dry run cannot progress.
core::result<job_plan> make_plan(const core::config& cfg, const plan_options& o);

/// The plan as text (per rank table, verdict, suggestions) / as JSON.
std::string render_text(const job_plan& p);
std::string render_json(const job_plan& p);

/// Search space of `search`.
struct search_options {
  int gpus = 1;
  std::uint64_t device_memory = 0;
  calibration cal;
  std::vector<int> micro_batch_sizes{1, 2, 4, 8, 16};
  int top = 5;
};

struct search_result {
  std::vector<job_plan> best;                     // fastest that fit, fastest first
  int considered = 0;
  std::vector<std::pair<std::string, int>> rejected;  // reason -> count
};

/// Enumerates data_parallel × pipeline_stage = gpus (tensor parallel is not implemented),
/// micro-batch size and count at cfg's global batch, virtual stages, schedule, recompute and ZeRO
/// stage for cfg's model, one process per device; keeps the fastest that fit.
core::result<search_result> search(const core::config& cfg, const search_options& o);
std::string render_search(const search_result& r, const search_options& o);

/// A rank's name in the plan: "dp0/pp1", with its tensor-parallel rank "dp0/tp1/pp1".
std::string rank_name(const job_plan& p, const rank_plan& r);

/// "1.50 GiB" etc.
std::string format_bytes(std::uint64_t bytes);
/// Parses "80GiB", "141GB", "512MiB", "1e9" (bytes). Errors name the text.
core::result<std::uint64_t> parse_bytes(const std::string& text);

}  // namespace troupe::plan
