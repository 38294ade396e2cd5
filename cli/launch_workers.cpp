#include "cli/launch_workers.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <set>

extern char** environ;

namespace troupe::cli::launch {
namespace {

using clock = std::chrono::steady_clock;

// Written by the signal handler, read by the supervision loop.
volatile std::sig_atomic_t g_last_signal = 0;
volatile std::sig_atomic_t g_signal_count = 0;
// A signal sent by a process (kill, scancel) reached only the launcher; one typed at the terminal
// (si_code SI_KERNEL) went to the whole foreground process group, workers included, so
// forwarding it would deliver it twice.
volatile std::sig_atomic_t g_forward = 0;

void on_signal(int sig, siginfo_t* info, void*) {
  g_last_signal = sig;
  g_signal_count = g_signal_count + 1;
  if (info == nullptr || info->si_code != SI_KERNEL) g_forward = 1;
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// A descriptor at 3 or above, so that dup2 onto 0, 1 or 2 in the child always makes a copy
// (dup2 of a descriptor onto itself would keep its close-on-exec flag).
int above_stdio(int fd) {
  if (fd < 0 || fd > 2) return fd;
  int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
  ::close(fd);
  return moved;
}

// Between fork and execve only async-signal-safe calls: the launcher has other threads (the
// rendezvous server), whose locks the child may have inherited held.
[[noreturn]] void exec_child(pid_t launcher, int in_fd, int log_fd, const char* exe, char** argv,
                             char** envp, const std::string& failed_msg) {
  // The worker goes when the launcher goes, even by SIGKILL, so that a job never leaves orphans
  // holding GPUs and ports; their peers on other nodes see the lost connections and stop.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(127);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : {SIGINT, SIGTERM, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (::dup2(in_fd, 0) < 0 || ::dup2(log_fd, 1) < 0 || ::dup2(log_fd, 2) < 0) ::_exit(127);
  // Sockets the launcher holds (the rendezvous listener) must not outlive it in the workers.
  if (::syscall(SYS_close_range, 3u, ~0u, 0u) != 0)
    for (int fd = 3; fd < 4096; ++fd) ::close(fd);
  ::execve(exe, argv, envp);
  ssize_t ignored = ::write(2, failed_msg.data(), failed_msg.size());
  (void)ignored;
  ::_exit(127);
}

std::string env_key(const std::string& entry) { return entry.substr(0, entry.find('=')); }

std::vector<std::string> merged_environment(const std::vector<std::string>& extra) {
  std::set<std::string> ours;
  for (const auto& e : extra) ours.insert(env_key(e));
  std::vector<std::string> env;
  for (char** p = environ; p && *p; ++p)
    if (!ours.count(env_key(*p))) env.emplace_back(*p);
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

void kill_and_reap(std::vector<worker_process>& workers) {
  for (auto& w : workers) {
    if (!w.running) continue;
    ::kill(w.pid, SIGKILL);
    while (::waitpid(w.pid, &w.status, 0) < 0 && errno == EINTR) {
    }
    w.running = false;
  }
}

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown host";
  return name;
}

// Copies what was appended to a file since the last call to `out` (tail -f).
class follower {
 public:
  explicit follower(const std::string& path) : in_(std::fopen(path.c_str(), "rb")) {}
  ~follower() {
    if (in_) std::fclose(in_);
  }
  follower(const follower&) = delete;
  follower& operator=(const follower&) = delete;

  void pump(std::FILE* out) {
    if (!in_) return;
    char buf[65536];
    bool wrote = false;
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, in_)) > 0;) {
      std::fwrite(buf, 1, n, out);
      wrote = true;
    }
    std::clearerr(in_);  // forget EOF: the file keeps growing
    if (wrote) std::fflush(out);
  }

 private:
  std::FILE* in_;
};

// "rank 2" / "ranks 0, 2, 3" of the workers still running; empty when none is.
std::string running_ranks(const std::vector<worker_process>& ws) {
  std::string s;
  int n = 0;
  for (const auto& w : ws)
    if (w.running) s += (n++ ? ", " : "") + std::to_string(w.spec.rank);
  return n == 0 ? "" : (n == 1 ? "rank " : "ranks ") + s;
}

void signal_running(std::vector<worker_process>& ws, int sig) {
  for (auto& w : ws)
    if (w.running && ::kill(w.pid, sig) == 0 && (sig == SIGTERM || sig == SIGKILL))
      w.stopped_by_launcher = true;
}

double seconds(std::chrono::milliseconds d) { return static_cast<double>(d.count()) / 1000.0; }

}  // namespace

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  // A closed pipe on our stdout (troupe launch ... | head) must not kill the launcher and, with
  // it, the whole job.
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ign, nullptr);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")";
  }
  return "ended with status " + std::to_string(status);
}

std::vector<std::string> last_lines(const std::string& path, int n) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  // Only the end of the file: worker logs can be long.
  constexpr std::streamoff window = 64 * 1024;
  in.seekg(0, std::ios::end);
  std::streamoff size = in.tellg();
  in.seekg(size > window ? size - window : 0);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  if (size > window && !lines.empty()) lines.erase(lines.begin());  // a partial line
  if (static_cast<int>(lines.size()) > n) lines.erase(lines.begin(), lines.end() - n);
  return lines;
}

core::result<worker_group> worker_group::spawn(const std::string& exe,
                                               const std::vector<std::string>& argv,
                                               const std::vector<worker_spec>& specs) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::string failed_msg = "troupe launch: could not execute " + exe + " (execve failed)\n";
  int in_fd = above_stdio(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (in_fd < 0)
    return core::error::make(std::string("cannot open /dev/null: ") + std::strerror(errno));
  worker_group g;
  core::status st;
  for (const auto& spec : specs) {
    std::vector<std::string> env = merged_environment(spec.env);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    int log_fd =
        above_stdio(::open(spec.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (log_fd < 0) {
      st = core::error::at_file(
          spec.log, std::string("cannot create the worker log: ") + std::strerror(errno),
          "pass a writable --log_dir");
      break;
    }
    const pid_t launcher = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0)
      exec_child(launcher, in_fd, log_fd, exe.c_str(), args.data(), envp.data(), failed_msg);
    const int fork_errno = errno;
    ::close(log_fd);
    if (pid < 0) {
      st = core::error::make("cannot start worker rank " + std::to_string(spec.rank) +
                                 ": fork failed: " + std::strerror(fork_errno),
                             "check the process limit (ulimit -u) and free memory");
      break;
    }
    worker_process w;
    w.spec = spec;
    w.pid = pid;
    g.workers_.push_back(std::move(w));
  }
  ::close(in_fd);
  if (!st) {
    kill_and_reap(g.workers_);
    return st.err();
  }
  return g;
}

int worker_group::supervise(const supervise_options& opt) {
  const std::string host = this_host();
  auto& ws = workers_;
  std::optional<follower> follow;
  if (!ws.empty()) follow.emplace(ws.front().spec.log);

  int exit_code = 0;
  bool failed = false;
  bool interrupted = false;  // a signal to the launcher came before any failure
  // When the first failure (or a signal) happened, and when the launcher escalated.
  std::optional<clock::time_point> stop_since, term_at, kill_at;
  std::string stop_reason;
  int signals_handled = 0;
  std::vector<int> failed_order;  // indices into ws, in the order they failed

  auto begin_stop = [&](const std::string& why) {
    if (stop_since) return;
    stop_since = clock::now();
    stop_reason = why;
    const std::string others = running_ranks(ws);
    if (!others.empty())
      std::fprintf(stderr,
                   "troupe launch: waiting up to %g s for %s to stop by themselves, then "
                   "SIGTERM\n",
                   seconds(opt.grace), others.c_str());
  };

  for (;;) {
    // Signals to the launcher.
    if (g_signal_count != signals_handled) {
      const int count = g_signal_count;
      const int sig = g_last_signal;
      if (signals_handled == 0) {
        if (g_forward) {
          g_forward = 0;
          signal_running(ws, sig);
          std::fprintf(stderr, "troupe launch: received %s; forwarded it to the workers\n",
                       signal_name(sig).c_str());
        } else {
          std::fprintf(stderr,
                       "troupe launch: received %s (the workers got it from the terminal "
                       "too); press Ctrl-C again to kill them at once\n",
                       signal_name(sig).c_str());
        }
        begin_stop("the launcher received " + signal_name(sig));
        if (!failed) {
          failed = true;
          interrupted = true;
          exit_code = 128 + sig;
          first_failure_ = "the launcher received " + signal_name(sig);
        }
      } else {
        std::fprintf(stderr, "troupe launch: received %s again; sending SIGKILL to %s\n",
                     signal_name(sig).c_str(), running_ranks(ws).c_str());
        signal_running(ws, SIGKILL);
        if (!kill_at) kill_at = clock::now();
      }
      signals_handled = count;
    }

    // Workers that ended since the last poll. Which of several died first cannot be known; a
    // worker killed by a signal nobody here sent is more likely the cause than the ones that
    // exited with an error after losing it, so it is reported (and its code returned) first.
    std::vector<int> ended;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      auto& w = ws[i];
      if (!w.running) continue;
      pid_t r = ::waitpid(w.pid, &w.status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      if (r < 0) w.status = W_EXITCODE(127, 0);  // not our child any more: cannot know
      w.running = false;
      if (!(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0))
        ended.push_back(static_cast<int>(i));
    }
    std::stable_sort(ended.begin(), ended.end(), [&](int a, int b) {
      auto crashed = [&](int i) { return WIFSIGNALED(ws[i].status) && !ws[i].stopped_by_launcher; };
      return crashed(a) && !crashed(b);
    });
    for (int i : ended) {
      auto& w = ws[i];
      failed_order.push_back(i);
      std::fprintf(stderr, "troupe launch: worker rank %d (pid %d, host %s) %s%s\n", w.spec.rank,
                   static_cast<int>(w.pid), host.c_str(), describe_status(w.status).c_str(),
                   w.stopped_by_launcher ? " (stopped by the launcher)" : "");
      if (!failed) {
        failed = true;
        exit_code = WIFSIGNALED(w.status) ? 128 + WTERMSIG(w.status) : WEXITSTATUS(w.status);
        if (exit_code == 0) exit_code = 1;
        first_failure_ = "worker rank " + std::to_string(w.spec.rank) + " (pid " +
                         std::to_string(static_cast<int>(w.pid)) + ", host " + host + ") " +
                         describe_status(w.status);
      }
      begin_stop("worker rank " + std::to_string(w.spec.rank) + " failed");
    }

    // The job failed outside the workers (the rendezvous).
    if (opt.job_failed) {
      if (auto e = opt.job_failed()) {
        if (opt.report_job_failure) opt.report_job_failure(*e);
        if (!failed) {
          failed = true;
          exit_code = 1;
          first_failure_ = "the job could not form: " + e->message;
        }
        begin_stop("the job could not form");
      }
    }

    if (follow) follow->pump(stdout);

    if (running_ranks(ws).empty()) break;

    const auto now = clock::now();
    if (stop_since && !term_at && !kill_at && now - *stop_since >= opt.grace) {
      std::fprintf(stderr, "troupe launch: %s still running %g s after %s; sending SIGTERM\n",
                   running_ranks(ws).c_str(), seconds(opt.grace), stop_reason.c_str());
      signal_running(ws, SIGTERM);
      term_at = now;
    }
    if (term_at && !kill_at && now - *term_at >= opt.kill_wait) {
      std::fprintf(stderr, "troupe launch: %s still running %g s after SIGTERM; sending SIGKILL\n",
                   running_ranks(ws).c_str(), seconds(opt.kill_wait));
      signal_running(ws, SIGKILL);
      kill_at = now;
    }
    if (kill_at && now - *kill_at >= opt.kill_wait) {
      for (auto& w : ws) {
        if (!w.running) continue;
        std::fprintf(stderr,
                     "troupe launch: worker rank %d (pid %d) has not exited %g s after SIGKILL; "
                     "giving up on it\n",
                     w.spec.rank, static_cast<int>(w.pid), seconds(opt.kill_wait));
        w.running = false;
        w.status = W_EXITCODE(0, SIGKILL);
        w.stopped_by_launcher = true;
        failed_order.push_back(static_cast<int>(&w - ws.data()));
      }
      if (!failed) {
        failed = true;
        exit_code = 128 + SIGKILL;
        first_failure_ = "workers did not exit after SIGKILL";
      }
      break;
    }

    timespec ts{static_cast<time_t>(opt.poll.count() / 1000),
                static_cast<long>(opt.poll.count() % 1000) * 1000000L};
    ::nanosleep(&ts, nullptr);  // a signal ends it early, which is what we want
  }

  if (follow) follow->pump(stdout);
  // The rendezvous may decide just after the last worker it told has exited.
  if (opt.job_failed) {
    if (auto e = opt.job_failed()) {
      if (opt.report_job_failure) opt.report_job_failure(*e);
      if (!failed) {
        failed = true;
        exit_code = 1;
        first_failure_ = "the job could not form: " + e->message;
      }
    }
  }
  interrupted_ = interrupted;
  if (!failed || interrupted) return exit_code;

  // Where to look: the failed workers' logs, then local rank 0's, whose log usually says what
  // the job as a whole saw.
  std::vector<int> show = failed_order;
  if (!ws.empty() && std::find(show.begin(), show.end(), 0) == show.end()) show.push_back(0);
  for (int i : show) {
    const auto& w = ws[i];
    auto lines = last_lines(w.spec.log, opt.tail_lines);
    const std::string how = describe_status(w.status);
    if (lines.empty()) {
      std::fprintf(stderr, "troupe launch: %s (rank %d, %s) is empty\n", w.spec.log.c_str(),
                   w.spec.rank, how.c_str());
      continue;
    }
    std::fprintf(stderr, "troupe launch: last %zu line%s of %s (rank %d, %s):\n", lines.size(),
                 lines.size() == 1 ? "" : "s", w.spec.log.c_str(), w.spec.rank, how.c_str());
    for (const auto& l : lines) std::fprintf(stderr, "    %s\n", l.c_str());
  }
  return exit_code;
}

}  // namespace troupe::cli::launch
