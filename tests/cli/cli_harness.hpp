// What the CLI tests share: the built troupe binary, run in a folder with its stdout and stderr
// captured, and reading the files it writes.
#pragma once

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "tests/model/trainer_fixture.hpp"

namespace troupe::cli_test {

namespace fs = std::filesystem;

inline const std::string troupe_binary = TROUPE_BINARY_DIR "/troupe";

struct run_result {
  int code;  // the exit status (-1 when the process did not exit normally)
  std::string out;
  std::string err;
};

/// The whole file (empty when it does not exist).
inline std::string slurp(const fs::path& p) { return model::testing::file_bytes(p.string()); }

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// Runs `troupe ARGS` (already shell-quoted) inside `dir`; stdout and stderr go through
/// dir/stdout.txt and dir/stderr.txt.
inline run_result run_troupe(const fs::path& dir, const std::string& args) {
  REQUIRE_MESSAGE(fs::exists(troupe_binary), ("build the troupe target first: " + troupe_binary));
  const auto out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = "cd '" + dir.string() + "' && '" + troupe_binary + "' " + args + " >'" +
                          out.string() + "' 2>'" + err.string() + "'";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

/// A port nobody listens on right now (the kernel's pick for port 0).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace troupe::cli_test
