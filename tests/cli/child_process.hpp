// A `troupe` process that a CLI test starts and watches while it runs (the launch and fault tests):
// started in a folder through /bin/sh, so that environment settings can precede it, with stdout
// and stderr in files there; waited for with a time limit, so a hang fails the test; killed when
// the test leaves its scope without having waited for it.
#pragma once

#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include "tests/cli/cli_harness.hpp"

namespace troupe::cli_test {

/// `troupe ARGS` started in `dir` with `env` (e.g. "TROUPE_FAULT=...") before it; its output in
/// dir/NAME.out and dir/NAME.err.
struct child {
  pid_t pid = -1;
  fs::path out, err;
  std::optional<int> code;  // the exit status, or 128 + signal; -1 after a time-out

  child(const fs::path& dir, const std::string& name, const std::string& args,
        const std::string& env = "") {
    out = dir / (name + ".out");
    err = dir / (name + ".err");
    const std::string cmd = "cd '" + dir.string() + "' && " + env + " exec '" + troupe_binary +
                            "' " + args + " >'" + out.string() + "' 2>'" + err.string() + "'";
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  child(const child&) = delete;
  child& operator=(const child&) = delete;
  ~child() {
    if (!code) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  /// The exit status, waiting at most `limit` (then kills the process and fails the test).
  int wait(std::chrono::seconds limit = std::chrono::seconds(300)) {
    if (code) return *code;
    const auto until = std::chrono::steady_clock::now() + limit;
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > until) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        code = -1;
        FAIL("troupe " << out << " did not finish within " << limit.count() << " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return *code;
  }
  bool running() { return !code && ::waitpid(pid, nullptr, WNOHANG) == 0; }
  std::string stdout_text() const { return slurp(out); }
  std::string stderr_text() const { return slurp(err); }
};

}  // namespace troupe::cli_test
