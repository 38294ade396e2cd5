// The local half of `troupe launch`: starts this node's worker processes (each with its own log
// file and environment), forwards SIGINT/SIGTERM to them, copies local rank 0's log to the
// launcher's output as it grows, and waits for them all. Every wait has a bound: after a failure
// the others get `grace` to stop by themselves, then SIGTERM, then SIGKILL (docs/launch.md).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace troupe::cli::launch {

/// One worker process to start on this node.
struct worker_spec {
  int rank = 0;
  int local_rank = 0;
  int node_rank = 0;
  /// Receives the worker's stdout and stderr (created or truncated).
  std::string log;
  /// "KEY=value" entries set on top of the launcher's environment.
  std::vector<std::string> env;
};

/// A started worker and how it ended.
struct worker_process {
  worker_spec spec;
  pid_t pid = -1;
  bool running = true;
  /// Exit status as waitpid reports it, valid once !running.
  int status = 0;
  /// The launcher itself sent it SIGTERM or SIGKILL (at the end of the grace period).
  bool stopped_by_launcher = false;
};

struct supervise_options {
  /// How long the other workers may take to stop by themselves after the first failure.
  std::chrono::milliseconds grace{30000};
  /// Between SIGTERM and SIGKILL, and after SIGKILL before giving up on a process.
  std::chrono::milliseconds kill_wait{5000};
  /// How often workers are reaped and local rank 0's log is copied.
  std::chrono::milliseconds poll{50};
  /// Called every poll; returns an error once when the job failed outside the workers (the
  /// rendezvous could not form). The launcher then treats it as the first failure (code 1).
  std::function<std::optional<core::error>()> job_failed;
  /// Prints an error that job_failed returned (it may have been logged already).
  std::function<void(const core::error&)> report_job_failure;
  /// Lines of each failed worker's log printed at the end.
  int tail_lines = 15;
};

/// Installs the launcher's SIGINT/SIGTERM handlers (which only record the signal; the
/// supervision loop forwards it) and ignores SIGPIPE. Call before spawning.
void install_signal_handlers();

/// This node's workers.
class worker_group {
 public:
  /// Starts `exe argv...` once per spec (fork + execve), stdin from /dev/null, stdout and stderr
  /// to spec.log. A worker dies with the launcher (PR_SET_PDEATHSIG). If one cannot be started,
  /// the ones already started are killed and reaped, and the error says why.
  static core::result<worker_group> spawn(const std::string& exe,
                                          const std::vector<std::string>& argv,
                                          const std::vector<worker_spec>& specs);

  const std::vector<worker_process>& workers() const { return workers_; }

  /// Waits for every worker, reporting each failure on stderr as it happens, enforcing the grace
  /// period, and copying the log of the first worker (local rank 0) to stdout as it grows.
  /// Returns the launcher's exit code: 0 when every worker exited 0, else the first failure's
  /// code: the worker's exit code, 128 + N for a worker killed by signal N or for signal N
  /// received by the launcher, 1 when job_failed reported first.
  int supervise(const supervise_options& opt);

 /// After supervise: what failed first ("worker rank 3 (pid 812) was killed by signal 9
  /// (SIGKILL)", "the job could not form: ..."); empty when nothing failed.
  const std::string& first_failure() const { return first_failure_; }
  /// After supervise: the launcher itself received SIGINT/SIGTERM before any failure (the user
  /// stopped the job: not a fault to restart from).
  bool interrupted() const { return interrupted_; }

 private:
  std::vector<worker_process> workers_;
  std::string first_failure_;
  bool interrupted_ = false;
};

/// "exited with code 3" / "was killed by signal 9 (SIGKILL)".
std::string describe_status(int status);

/// The last `n` lines of a text file (fewer when it is shorter; empty when unreadable).
std::vector<std::string> last_lines(const std::string& path, int n);

}  // namespace troupe::cli::launch
