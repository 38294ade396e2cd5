// Message logs: what every worker sent, for `troupe replay` (docs/replay.md has the file formats).
//
// route() (actors/job.hpp) shows every tensor to the job's message_sink before the bytes go on the
// transport, and receive() shows it every tensor that came from another worker; a
// tensor-parallel group's collectives show it their slices the same way (tp_group::record_to). Two sinks exist:
// the `recorder`, which writes <run_dir>/messages/rank_<R>.log (one JSON line per tensor sent:
// step, sender, receiver, tag, instruction, dtype, shape, the message hash of the bytes
// (kernels/message_hash.hpp), and for loader cuts the data-sampling key) and, with
// runtime.record_tensors, rank_<R>.tensors (the bytes of every tensor worker R received from
// another worker); and replay's verifier (replay/replay.cpp), which compares what a re-run sends
// with those lines.
//
// The recorder keeps recording off the senders' critical path: a device tensor's hash is computed
// by a kernel on the sender's stream (no host copy, no wait), and one writer thread waits for the
// hashes, formats the lines and writes the files.
//
// No CAF here: the CLI, the replay driver and tests include it cheaply.
#pragma once

#include <cstdint>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "actors/layout.hpp"
#include "actors/wire.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/backend.hpp"
#include "kernels/message_hash.hpp"
#include "transport/transport.hpp"

namespace troupe::actors {

/// The data-sampling key of a loader cut, the job's only use of randomness in training: global
/// sequences [first_seq, first_seq + count) of `step`, drawn with `seed` (model/loader.hpp).
struct sample_key {
  std::uint64_t seed = 0;
  std::int64_t step = 0;
  std::int64_t first_seq = 0;
  int count = 0;
};

/// One tensor sent, as a line of a message log holds it.
struct message_record {
  int src = 0;            // sender's worker rank
  int dst = 0;            // receiver's worker rank
  std::string from;       // "stage(dp=0, pp=1)", "data_loader(dp=0)", ...
  std::string to;
  transport::tag tag;     // tag.step is the step the tensor belongs to
  std::string op;         // the instruction ("1SEND_F3->2") or role action ("loader cut")
  core::dtype dtype = core::dtype::f32;
  core::shape_t shape;
  std::uint64_t hash = 0;  // message hash of the bytes (kernels/message_hash.hpp)
  // the definition `hash` follows: the current one, or the one its log's format names
  kernels::message_hash_def hash_def = kernels::message_hash_current;
  std::optional<sample_key> sample;
  // where a parsed record came from
  std::string file;
  int line = 0;
};

/// Which (sender worker, receiver worker, tag) a record is: the unit replay compares.
struct message_key {
  int src = 0;
  int dst = 0;
  transport::tag tag;
  auto operator<=>(const message_key&) const = default;
  bool operator==(const message_key&) const = default;
};
inline message_key key_of(const message_record& r) { return {r.src, r.dst, r.tag}; }

/// The format of message logs this troupe writes (the header's "troupe_messages"): 3 holds message
/// hashes (kernels/message_hash.hpp) with XXH3 leaves in the "hash" field. Logs of format 2 (XXH64
/// leaves) are read too, their records marked so (message_record::hash_def).
inline constexpr int message_log_version = 3;

/// The message hash definition of a log format, or nothing for a format this troupe cannot read.
std::optional<kernels::message_hash_def> hash_def_of_log_format(int format);

/// One invocation of the job (a fresh run or a resume), as the header line of each log says.
struct segment_header {
  int rank = 0;                 // the worker whose log this is
  int workers = 1;
  int first_step = 0;           // steps [first_step, end_step) were planned
  int end_step = 0;
  std::string resume;           // checkpoint directory resumed from ("" = fresh)
  std::uint64_t config_xxh64 = 0;  // of the config.toml text this invocation wrote
};

/// The exact clip scale and learning rate an optimizer shard applied at a step (a control
/// message, logged so that `replay --rank` can apply them without the other shards' norms).
struct clip_record {
  int src = 0;
  int pp = 0;
  int part = 0;
  std::int64_t step = 0;
  float scale = 1;
  double lr = 0;
  std::int64_t adam_step = 1;  // AdamW's t (step + 1 unless loss scaling skipped steps)
  bool skip = false;           // dynamic loss scaling skipped the update
  float loss_scale = 1;        // the step's loss scale, which the stages multiplied the loss by
};

/// "gradient", "param_slice", ...; a tensor-parallel collective's "tp_<op>_<n>" ("tp_forward_1",
/// with "_gather" for an all-reduce's gather phase: actors/tp_group.hpp); "kind 12" for an
/// unknown value.
std::string kind_name(std::uint32_t kind);
/// "stage(dp=0, pp=1)", "optimizer_shard(pp=1, part=0)", "data_loader(dp=0)", "coordinator", ...
std::string address_name(const address& a);
/// The instruction or role action that sends tensor `tg` from `from` to `to`: the schedule's
/// text for stage transfers ("0SEND_F3->1", "1SEND_B3->0", "0REDUCE_GRAD"), else "loader cut",
/// "shard update", "snapshot", "shard snapshot".
std::string producer_of(const address& from, const address& to, const transport::tag& tg);
/// "rank 1, step 2, micro-batch 3, instruction 0SEND_F3->1 (stage(dp=0, pp=0) -> stage(dp=0,
/// pp=1), activation chunk 1 part 0)"; for a tensor-parallel collective "rank 1, step 2,
/// micro-batch 3, layer 0, collective all_reduce (forward collective 1, reduce-scatter phase,
/// part 0: stage(dp=0, pp=0, tp=1) -> stage(dp=0, pp=0) on rank 0)".
std::string describe(const message_record& r);

/// One JSON line (no newline).
std::string to_line(const message_record& r);
std::string to_line(const segment_header& h);
std::string to_line(const clip_record& c);

/// Everything a worker's log holds. A re-executed step's line ({"step":S,"src":W,"control":
/// "rerun"}) drops the records of step S read before it: the re-execution sends them again.
struct message_log {
  std::vector<segment_header> segments;
  std::vector<message_record> records;
  std::vector<clip_record> clips;
};
/// Reads <dir>/rank_<rank>.log; errors name the file and line.
core::result<message_log> read_log(const std::string& dir, int rank);

/// A tensor stored in a .tensors file.
struct stored_tensor {
  int src = 0;
  int dst = 0;
  transport::tag tag;
  core::tensor value;  // host
};
/// Reads every frame of <dir>/rank_<rank>.tensors; errors name the file and the byte offset.
core::result<std::vector<stored_tensor>> read_tensors(const std::string& dir, int rank);

/// Sees every tensor the job moves. Called from many actor threads at once: implementations
/// synchronise themselves.
class message_sink {
 public:
  virtual ~message_sink() = default;
  /// A tensor about to go on the transport; `bytes` is a host view of it. May throw
  /// core::failure to stop the sending actor (replay does, at the first difference).
  virtual void sent(const message_record& r, const core::tensor& bytes) = 0;
  /// Whether sent() must see the hash and the host bytes before the send goes on. When false,
  /// sent_pending() gets the record with a hash the device may still be computing (no host copy).
  virtual bool wants_bytes() const { return true; }
  /// The record of a tensor sent, its hash still pending (r.hash is unset).
  virtual void sent_pending(message_record r, std::shared_ptr<kernels::pending_value> hash) {
    r.hash = hash->get();
    sent(r, core::tensor{});
  }
  /// Whether received() wants the bytes of tensors from other workers.
  virtual bool wants_received() const { return false; }
  /// Worker `dst` took a tensor that worker `src` sent (src != dst).
  virtual void received(int /*src*/, int /*dst*/, const transport::tag& /*tg*/,
                        const core::tensor& /*bytes*/) {}
  /// An optimizer shard applied this clip scale and learning rate.
  virtual void clipped(const clip_record& /*c*/) {}
  /// Step forensics executes `step` again: worker `worker`'s shard forgot the step, before any of
  /// the worker's actors sends a tensor of the re-execution. Those sends supersede the worker's
  /// earlier ones of the step.
  virtual void reexecuted(int /*worker*/, std::int64_t /*step*/) {}
  /// Worker `worker` ended a step: its buffered lines may go to disk.
  virtual void flush(int /*worker*/) {}
};

/// The message hash of a host tensor's bytes, as the logs hold it (under `def`: the current
/// definition, or the one an older log's records follow).
std::uint64_t tensor_hash(const core::tensor& t,
                          kernels::message_hash_def def = kernels::message_hash_current);

/// A record naming the message (who sent what to whom, under which tag and op); no tensor facts.
message_record header_of(const address& from, int src, const address& to, int dst,
                         const transport::tag& tg);
/// The record of tensor `t` (host bytes) that `from` on worker `src` sends `to` on `dst`.
message_record record_of(const address& from, int src, const address& to, int dst,
                         const transport::tag& tg, const core::tensor& t, const sample_key* sample);
/// The host bytes of `t`: itself, or a copy through `be` for a device tensor.
core::tensor host_view(const core::tensor& t, kernels::backend* be);

/// The message hash of the last host tensor a sender hashed in one batch of sends: a batch that
/// sends the same bytes to several receivers (under ZeRO-0 a replica's gradient goes whole to
/// every optimizer shard of its pipeline rank) hashes them once. Valid only while the sender
/// writes none of the tensors it sends; it holds the storage, so the address is not reused.
struct hash_memo {
  std::shared_ptr<core::storage> store;
  const void* data = nullptr;
  std::size_t bytes = 0;
  std::uint64_t hash = 0;
};

/// Builds the record of a tensor `from` sends `to` and shows it to `sink`. A device tensor is
/// hashed through `be` (the sender's backend, after the sender's queued work, so the bytes hashed
/// are the final ones): on the device when the sink takes pending hashes, else through a host
/// copy. A host tensor's hash comes from `memo` when it holds these very bytes, and goes into it.
/// `op`: the record's op, when the tag does not say it (a tensor-parallel collective's name).
/// `hash`: t's message hash, already queued by the sender (the optimizer shard's AdamW hashes the
/// parameters it writes), taken in place of hashing t when the sink takes pending hashes.
void observe_send(message_sink& sink, const address& from, int src, const address& to, int dst,
                  const transport::tag& tg, const core::tensor& t, kernels::backend* be,
                  const sample_key* sample, hash_memo* memo = nullptr,
                  const std::string* op = nullptr,
                  std::shared_ptr<kernels::pending_value> hash = nullptr);
/// Shows `sink` a tensor worker `dst` received from `src`, when it wants the bytes.
void observe_receive(message_sink& sink, int src, int dst, const transport::tag& tg,
                     const core::tensor& t, kernels::backend* be);

/// Writes the message logs of the workers this process hosts: one buffered file per worker, written
/// by one writer thread in the order the worker's actors sent, flushed when the worker ends a step.
/// The sending actors only queue: the writer waits for each pending hash. A checkpoint snapshot's
/// sender waits instead until the writer has written and flushed the snapshot's line: a checkpoint
/// can then be complete only once every line before it is in the files, so a worker killed later
/// (SIGKILL loses what a process still buffers) leaves a log that a resume from that checkpoint
/// continues without a gap, and that replays.
class recorder final : public message_sink {
 public:
  /// Opens <run_dir>/messages/rank_<w>.log (and .tensors when `tensors`) for every w in
  /// `workers` and appends `header` (its rank set per file). When header.first_step > 0 (a
  /// resume), records of steps >= first_step left by an earlier invocation are dropped first: the
  /// steps are run again. A fresh run starts the files anew.
  static core::result<std::shared_ptr<recorder>> open(const std::string& run_dir,
                                                      const std::vector<int>& workers,
                                                      segment_header header, bool tensors);
  ~recorder() override;

  void sent(const message_record& r, const core::tensor& bytes) override;
  bool wants_bytes() const override { return false; }
  void sent_pending(message_record r, std::shared_ptr<kernels::pending_value> hash) override;
  bool wants_received() const override { return tensors_; }
  void received(int src, int dst, const transport::tag& tg, const core::tensor& bytes) override;
  void clipped(const clip_record& c) override;
  void reexecuted(int worker, std::int64_t step) override;
  void flush(int worker) override;
  /// Writes what is queued, flushes and closes every file; the first write error, naming the
  /// file.
  core::status close();

 private:
  struct file;
  /// A log line to write (or a flush): `hash` set means `rec` waits for it first.
  struct item {
    int worker = 0;
    bool flush = false;
    std::string line;
    message_record rec;
    std::shared_ptr<kernels::pending_value> hash;
    std::shared_ptr<std::promise<void>> done;  // a flush's waiter, told once the flush is done
  };
  explicit recorder(bool tensors);
  /// Queues a flush of `worker`'s log and waits until the writer has done it (unless closing).
  void flush_and_wait(int worker);
  file& of(int worker);
  void fail(file& f, const std::string& what);
  void push(item it);
  void write_loop();

  bool tensors_;
  std::map<int, std::unique_ptr<file>> files_;
  std::mutex error_mu_;
  std::optional<core::error> error_;
  // the writer thread and its queue
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<item> queue_;
  bool stopping_ = false;
  std::thread writer_;
};

/// The folder message logs live in: <run_dir>/messages.
std::string messages_dir(const std::string& run_dir);

}  // namespace troupe::actors
