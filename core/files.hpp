// Files from outside and files we leave behind, each done one way.
//
// Reading: every reader of outside input (configs, token shards, safetensors, manifest.json,
// schedule files, tokenizer files, text to tokenize) opens through `open_input`, which refuses a
// path holding a NUL byte, looks at what the path is *before* a blocking open (a FIFO, a device
// such as /dev/zero, a socket or a directory is refused, so nothing waits forever for a writer or
// reads gigabytes of zeros), opens without blocking, checks again on the open descriptor (the path
// may have been swapped in between) and refuses a file larger than the reader's limit. Every
// refusal names the file, says what it found and what the reader expected.
//
// Writing: `write_file_atomic` writes to a temporary name beside the target, fsyncs it, renames it
// over the target and fsyncs the folder, so a reader (or a crash, or a signal) sees either the old
// file or the whole new one, never a part.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/error.hpp"

namespace troupe::core {

/// What a reader expects and how much of it it takes.
struct input_spec {
  /// Words for the file in messages: "config file", "token shard", "checkpoint manifest", ...
  std::string what = "file";
  /// Largest size accepted, in bytes (the reader's own limit: a config is small, a shard is not).
  std::uint64_t max_bytes = std::uint64_t(1) << 40;
  /// Appended to every refusal as the hint (what the reader wants instead).
  std::string hint;
};

/// An open, regular, readable file; closes its descriptor on destruction.
class input_file {
 public:
  input_file() = default;
  input_file(input_file&& o) noexcept;
  input_file& operator=(input_file&& o) noexcept;
  input_file(const input_file&) = delete;
  input_file& operator=(const input_file&) = delete;
  ~input_file();

  int fd() const { return fd_; }
  std::uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  /// Gives up ownership of the descriptor (the caller closes it).
  int release();

 private:
  friend result<input_file> open_input(const std::string& path, const input_spec& spec);
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::string path_;
};

/// Opens `path` for reading as described above. Never blocks on a FIFO or device.
result<input_file> open_input(const std::string& path, const input_spec& spec);

/// The whole content of a regular file opened by open_input.
result<std::string> read_input(const std::string& path, const input_spec& spec);

/// An error when `path` holds a NUL byte (which would silently cut a C path short), naming
/// `what` and the byte's position.
status check_path_text(const std::string& path, std::string_view what);

/// Writes `parts` one after another to `path` atomically (temporary file beside it, fsync, rename,
/// fsync of the folder). On failure the target is untouched and the temporary file is removed.
status write_file_atomic(const std::string& path, std::span<const std::span<const std::byte>> parts);
/// The same for one string.
status write_file_atomic(const std::string& path, std::string_view text);

/// Writes `text` to `path` (created or truncated) and fsyncs it; for files inside a directory
/// that is itself renamed into place (a checkpoint), where a second rename is not needed.
status write_file_synced(const std::string& path, std::string_view text);

/// fsync of a folder: makes the creations and renames inside it durable.
status fsync_dir(const std::string& dir);

/// Makes SIGINT and SIGTERM wait for a sealed_file append in progress: the handler lets the
/// write finish, then stops the process with the signal's default action (so the exit status is
/// still 128 + the signal). Without it the kernel may end a write to a file short at a page
/// boundary when a fatal signal arrives, leaving a sealed file without its tail. `troupe`
/// installs it at start; `troupe launch` then replaces it with its own forwarding handlers.
void guard_appends_from_stop_signals();

/// A file that is whole at every moment, however the process stops (SIGTERM, SIGKILL, a crash):
/// it is created holding `head` + `tail`, and each append writes the new bytes followed by `tail`
/// in one write at the end of what was committed, over the previous tail. A JSON document that
/// grows (trace.json: head `{"traceEvents":[`, tail `]}`) or a JSON-lines file (no head or tail)
/// is therefore always parseable (after SIGINT or SIGTERM only where
/// guard_appends_from_stop_signals is installed; SIGKILL cannot be caught, so a kill -9 during a
/// write larger than a page can still cut it). Not for concurrent appends to one file.
class sealed_file {
 public:
  /// Creates (or truncates) `path`.
  static result<sealed_file> create(const std::string& path, std::string_view head = {},
                                    std::string_view tail = {});
  /// Opens `path` to append after its first `keep` bytes (the rest is dropped), then seals it.
  static result<sealed_file> reopen(const std::string& path, std::uint64_t keep,
                                    std::string_view tail = {});
  sealed_file() = default;
  sealed_file(sealed_file&& o) noexcept;
  sealed_file& operator=(sealed_file&& o) noexcept;
  sealed_file(const sealed_file&) = delete;
  sealed_file& operator=(const sealed_file&) = delete;
  ~sealed_file();

  status append(std::string_view bytes);
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  void close();

 private:
  int fd_ = -1;
  std::uint64_t committed_ = 0;  // bytes before the tail
  std::string tail_;
  std::string path_;
};

}  // namespace troupe::core
