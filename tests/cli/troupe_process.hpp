// Runs the built `troupe` binary as a child of a test: arguments passed as a vector (no shell
// quoting), inside a chosen folder, with stdout and stderr captured in files and a bound on its
// running time, so a regression that hangs fails the test instead of stalling the suite.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace troupe::testing {

inline const std::string troupe_binary = TROUPE_BINARY_DIR "/troupe";

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

/// A started `troupe` process.
struct troupe_process {
  pid_t pid = -1;
  std::filesystem::path out, err;
  std::optional<int> code;  // exit code, or 128 + signal

  std::string stdout_text() const { return read_file(out); }
  std::string stderr_text() const { return read_file(err); }

  /// Waits at most `limit`; on time-out kills the process and returns nothing.
  std::optional<int> wait(std::chrono::milliseconds limit) {
    if (code) return code;
    const auto until = std::chrono::steady_clock::now() + limit;
    int status = 0;
    for (;;) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return code;
      }
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return std::nullopt;
  }
  ~troupe_process() {
    if (!code && pid > 0) wait(std::chrono::milliseconds(0));
  }
};

/// Starts `troupe ARGS...` in `dir`; its output goes to dir/TAG.out and dir/TAG.err.
inline std::unique_ptr<troupe_process> start_troupe(const std::filesystem::path& dir,
                                                    const std::string& tag,
                                                    const std::vector<std::string>& args) {
  REQUIRE_MESSAGE(std::filesystem::exists(troupe_binary),
                  ("build the troupe target first: " + troupe_binary));
  auto p = std::make_unique<troupe_process>();
  p->out = dir / (tag + ".out");
  p->err = dir / (tag + ".err");
  std::vector<std::string> argv_s = {troupe_binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, p->out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, p->err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addchdir_np(&fa, dir.c_str());
  const int rc = posix_spawn(&p->pid, troupe_binary.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE(rc == 0);
  return p;
}

/// The outcome of a finished run.
struct troupe_result {
  int code = -1;  // -1: still running at the limit (then killed)
  std::string out, err;
};

/// Runs `troupe ARGS...` in `dir` to its end, or kills it after `limit`.
inline troupe_result run_troupe(const std::filesystem::path& dir, const std::vector<std::string>& args,
                                std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  static int n = 0;
  auto p = start_troupe(dir, "run" + std::to_string(n++), args);
  const auto code = p->wait(limit);
  return {code.value_or(-1), p->stdout_text(), p->stderr_text()};
}

}  // namespace troupe::testing
