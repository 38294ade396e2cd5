// The time side of `troupe plan`: how long a chunk's forward and backward of one micro-batch take,
// from the chunk's arithmetic (matrix products and attention, in FLOPs) and a device's measured
// rates; the schedule simulator (schedules/simulate.hpp) turns those into the step's makespan.
//
// Rates come from a calibration file (`troupe plan --calibrate FILE`, which times the model's own
// chunk forward/backward, AdamW and a copy on the device) or, without one, from defaults per
// device and precision stated below.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "schedules/schedule.hpp"

namespace troupe::plan {

/// Measured (or default) rates of one device at one precision.
struct calibration {
  std::string device = "cpu";         // what it was measured on: cpu | cuda
  std::string precision = "fp32";     // compute precision it was measured at
  double flops_per_s = 2e10;          // effective rate of a chunk's forward/backward arithmetic
  double op_overhead_s = 2e-6;        // fixed cost of each op (launch, dispatch)
  double memory_bytes_per_s = 1e10;   // AdamW and copies: bytes read + written per second
  double link_bytes_per_s = 5e9;      // a tensor between two pipeline ranks or replicas
  // How much faster one device runs two workers' chunks at once (each on its own stream, as
  // `troupe train` runs every worker on one device) than one after the other: one stream leaves
  // gaps (launches, a kernel's last partial wave) that another's kernels fill.
  double concurrent_speedup = 1.0;
  // optimizer.offload: the copies between the device and page-locked host memory (bytes down and
  // back per second, one stream of offload pieces) and the host AdamW (28 B per element per
  // second; `--calibrate` times the optimizer shard's whole offloaded update, so the copies and
  // fences the update waits on count in it). Without a measurement the CPU device takes its
  // memory rate for both.
  double offload_link_bytes_per_s = 1e10;
  double host_adamw_bytes_per_s = 1e10;
  std::string source = "defaults";    // file it came from, or "defaults"
  // What a measurement timed (written to the file for the reader, not read back): forward +
  // backward seconds of one micro-batch through a chunk of `layers` layers with the embedding and
  // the head, for each depth timed.
  std::vector<std::pair<int, double>> chunk_seconds;
};

/// Defaults: CPU fp32 2e10 FLOP/s (a few cores of OpenBLAS), 10 GB/s, no gain from concurrent
/// workers; CUDA (H200-class) bf16/fp16 4e14 FLOP/s, fp32 5e13, 3e12 B/s memory, 1e11 B/s between
/// GPUs, 5 µs per op, concurrent workers 1.1 times as fast, and for offload 5e10 B/s for the
/// copies and 1e11 B/s for the shard's host loop (an H200 with a 16-core host measured 54 GB/s and
/// 114–129 GB/s, docs/plan.md).
calibration default_calibration(const std::string& device, core::precision_kind precision);

/// Reads a calibration file (JSON written by save_calibration). Errors name the file and key.
core::result<calibration> load_calibration(const std::string& path);
core::status save_calibration(const calibration& c, const std::string& path);

/// FLOPs of one chunk forward of `rows` tokens holding layers [first, first + n) (and the head when
/// `head`): 2·rows·(weights of its matrix products) plus causal attention 2·rows·T·C per layer.
double forward_flops(const core::model_config& m, int layers, bool head, std::int64_t rows);
/// Ops one layer's forward launches (for the per-op overhead).
int forward_ops_per_layer(const core::model_config& m);

/// Seconds of the tensor-parallel collectives (parallel.model_parallel > 1) of one rank in one
/// chunk's forward of one micro-batch, at the calibration's link_bytes_per_s; the backward moves
/// as much again. With A = rows x hidden_size x 4 bytes (tensor parallel sums in fp32) and n ranks,
/// a rank sends (n-1)/n A in an all-gather or a reduce-scatter and twice that in an all-reduce.
/// Per layer two all-reduces (attention and MLP outputs; under sequence parallel an all-gather
/// before and a reduce-scatter after each, the same bytes); the embedding's sum (a reduce-scatter
/// under sequence parallel); the head's vocabulary-parallel loss gathers the final norm's rows
/// (sequence parallel), sums its row maxima and sums (a few bytes per row) and sums the final
/// norm's gradient (a reduce-scatter under sequence parallel). The key/value
/// replicas' weight-gradient sums (num_kv_heads < model_parallel) are left out. 0 at tp 1.
double tp_comm_seconds(const core::config& cfg, const calibration& cal, int layers,
                       bool embedding, bool head);

/// Per-kind simulator costs (seconds) of one chunk: F, B (with recompute), I, W, and comm for one
/// activation between ranks. Tensor parallel divides the arithmetic (not the per-op overhead) by
/// model_parallel and adds tp_comm_seconds to F and to B and I. The simulator charges every chunk the same, so: with chunks
/// interleaved, cfg's slowest chunk; with chunks in a V (`place` v, zb_v's), the slowest rank's
/// work spread evenly over its chunks (a V pairs the head's chunk with the embedding's on rank 0,
/// and the search splits each rank's layers over its pair, so the rank, not the chunk, sets the
/// pace).
schedules::cost_model chunk_costs(const core::config& cfg, const calibration& cal,
                                  schedules::placement place = schedules::placement::interleaved);

/// Seconds of the optimizer's tail of a step on one pipeline rank: the gradient exchange between
/// replicas and AdamW over the largest shard (`shard_elements` fp32 elements). The exchange moves
/// at link_bytes_per_s between devices; with every worker on one GPU (`one_device`) the replicas'
/// slices never leave its memory, so there it moves at memory_bytes_per_s (on the CPU the link
/// rate is the timed copy, memory already). Under optimizer.offload AdamW runs on the host: the
/// gradient slice goes down and the parameters come back (4 + 4 B per element at the calibration's
/// offload_link_bytes_per_s) overlapped piece by piece with the host AdamW (28 B per element at its
/// host_adamw_bytes_per_s), so the slower of the two counts.
double optimizer_seconds(const core::config& cfg, const calibration& cal,
                         std::int64_t stage_elements, std::int64_t shard_elements,
                         bool one_device = false);

}  // namespace troupe::plan
