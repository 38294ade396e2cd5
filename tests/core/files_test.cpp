// core/files: the one way outside input is opened (never blocking on a FIFO, never reading a
// device, refusing folders, NUL bytes and oversized files with the file named) and the one way
// files are replaced (atomically) or grown (whole at every moment).
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "core/files.hpp"

using namespace troupe;
namespace fs = std::filesystem;

namespace {

struct scratch {
  fs::path path;
  scratch() {
    static int n = 0;
    path = fs::temp_directory_path() /
           ("troupe_files_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::create_directories(path);
  }
  ~scratch() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

core::input_spec spec(std::uint64_t max_bytes = 1 << 20) {
  core::input_spec s;
  s.what = "test file";
  s.max_bytes = max_bytes;
  s.hint = "pass a test file";
  return s;
}

}  // namespace

TEST_CASE("open_input refuses a FIFO at once instead of blocking in open()") {
  scratch dir;
  const std::string fifo = dir / "pipe";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // No writer ever opens the FIFO: a blocking open would hang this test.
  auto r = core::read_input(fifo, spec());
  REQUIRE_FALSE(r.ok());
  const std::string msg = r.err().to_string();
  CHECK(contains(msg, fifo));
  CHECK(contains(msg, "FIFO"));
  CHECK(contains(msg, "expected a test file"));
  CHECK(contains(msg, "hint: pass a test file"));
}

TEST_CASE("open_input refuses a device, a folder and a missing file, naming each") {
  scratch dir;
  auto dev = core::read_input("/dev/zero", spec());
  REQUIRE_FALSE(dev.ok());
  CHECK(contains(dev.err().to_string(), "/dev/zero: is a character device"));

  auto folder = core::read_input(dir.path.string(), spec());
  REQUIRE_FALSE(folder.ok());
  CHECK(contains(folder.err().to_string(), "is a directory, expected a test file"));

  auto missing = core::read_input(dir / "nope.txt", spec());
  REQUIRE_FALSE(missing.ok());
  CHECK(contains(missing.err().to_string(), "nope.txt: cannot open the test file: it does not exist"));
}

TEST_CASE("open_input refuses a path with a NUL byte instead of cutting it short") {
  scratch dir;
  std::ofstream(dir / "a") << "x";
  const std::string path = dir / "a" + std::string(1, '\0') + "b";
  auto r = core::read_input(path, spec());
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.err().to_string(), "NUL byte at position " + std::to_string((dir / "a").size())));
}

TEST_CASE("open_input refuses a file above the reader's limit and reads one at the limit") {
  scratch dir;
  std::ofstream(dir / "big") << std::string(101, 'x');
  auto r = core::read_input(dir / "big", spec(100));
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.err().to_string(), "the test file is 101 bytes; a test file is at most 100 bytes"));
  auto ok = core::read_input(dir / "big", spec(101));
  REQUIRE(ok.ok());
  CHECK(ok.value() == std::string(101, 'x'));
}

TEST_CASE("write_file_atomic replaces a file whole and leaves no temporary behind") {
  scratch dir;
  const std::string path = dir / "out.txt";
  REQUIRE(core::write_file_atomic(path, std::string_view("first version\n")).ok());
  REQUIRE(core::write_file_atomic(path, std::string_view("second\n")).ok());
  CHECK(slurp(path) == "second\n");
  int files = 0;
  for (auto& e : fs::directory_iterator(dir.path)) files += e.is_regular_file();
  CHECK(files == 1);
  // A folder that does not exist: an error naming the temporary file's folder, target untouched.
  auto bad = core::write_file_atomic(dir / "no/such/folder/x", std::string_view("x"));
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.err().to_string(), "no/such/folder/x.tmp."));
}

TEST_CASE("sealed_file is valid JSON after every append and after a reopen") {
  scratch dir;
  const std::string path = dir / "trace.json";
  auto f = core::sealed_file::create(path, "{\"traceEvents\":[", "\n]}\n");
  REQUIRE(f.ok());
  CHECK(nlohmann::json::parse(slurp(path))["traceEvents"].empty());
  for (int i = 0; i < 5; ++i) {
    REQUIRE(f->append(std::string(i ? ",\n" : "\n") + "{\"i\":" + std::to_string(i) + "}").ok());
    // What a reader sees if the process were killed right here.
    const auto j = nlohmann::json::parse(slurp(path));
    CHECK(j["traceEvents"].size() == static_cast<std::size_t>(i + 1));
  }
  f->close();

  // JSON lines: reopen after the first line, dropping the rest, and append.
  const std::string lines = dir / "metrics.jsonl";
  std::ofstream(lines) << "{\"step\":0}\n{\"step\":1}\n{\"ste";
  auto g = core::sealed_file::reopen(lines, 11);
  REQUIRE(g.ok());
  REQUIRE(g->append("{\"step\":1}\n").ok());
  CHECK(slurp(lines) == "{\"step\":0}\n{\"step\":1}\n");
}

// A child appends 4 MiB events to a trace (each write spans a thousand pages) and is sent SIGTERM
// mid-stream. Without the guard the kernel ends a write to a file short at a page boundary when a
// fatal signal is pending, so the file loses its tail in most of these kills.
TEST_CASE("a SIGTERM during sealed_file appends stops the process with the file whole") {
  scratch dir;
  const std::string event(4u << 20, 'x');
  for (int round = 0; round < 6; ++round) {
    const std::string path = dir / ("trace" + std::to_string(round) + ".json");
    int ready[2];
    REQUIRE(::pipe(ready) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::signal(SIGTERM, SIG_DFL);  // not doctest's crash handler, inherited from the parent
      core::guard_appends_from_stop_signals();
      auto f = core::sealed_file::create(path, "{\"traceEvents\":[", "\n]}\n");
      if (!f.ok()) ::_exit(3);
      for (int i = 0;; ++i) {
        if (!f->append(std::string(i ? ",\n" : "\n") + "\"" + event + "\"").ok()) ::_exit(4);
        if (i == 1) (void)!::write(ready[1], "r", 1);
      }
    }
    ::close(ready[1]);
    char c = 0;
    REQUIRE(::read(ready[0], &c, 1) == 1);  // two events written: the kill lands mid-stream
    ::close(ready[0]);
    std::this_thread::sleep_for(std::chrono::milliseconds(round * 3));
    REQUIRE(::kill(pid, SIGTERM) == 0);
    int wstatus = 0;
    REQUIRE(::waitpid(pid, &wstatus, 0) == pid);
    CHECK(WIFSIGNALED(wstatus));
    CHECK(WTERMSIG(wstatus) == SIGTERM);
    const std::string text = slurp(path);
    INFO("round " << round << ": " << text.size() << " bytes");
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);  // no exception
    const std::string end = text.substr(text.size() - std::min<std::size_t>(text.size(), 16));
    REQUIRE_MESSAGE(!j.is_discarded(), "the file does not parse; it ends in \"" << end << "\"");
    CHECK(j["traceEvents"].size() >= 2);
  }
}
