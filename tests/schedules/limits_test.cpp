// Schedule sizes past what a pipeline can have are refused where they first appear (arguments,
// a file's lines), before anything of their size is built or checked: 100,000 ranks or a million
// virtual stages used to run quadratic checks for hours. Files that are not files are refused.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "schedules/costs.hpp"
#include "schedules/registry.hpp"
#include "schedules/schedule_file.hpp"

using namespace troupe::schedules;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("generators refuse 100,000 stages, a million virtual stages and 2^21 micro-batches") {
  auto p = make_schedule("1f1b", 100000, 4, {});
  REQUIRE_FALSE(p.ok());
  CHECK(contains(p.err().to_string(), "pipeline stages p = 100000 is above the 1024"));

  schedule_options v;
  v.virtual_stages = 1000000;
  auto vs = make_schedule("interleaved_1f1b", 4, 8, v);
  REQUIRE_FALSE(vs.ok());
  CHECK(contains(vs.err().to_string(), "virtual stages v = 1000000"));

  auto m = make_schedule("gpipe", 2, 1 << 21, {});
  REQUIRE_FALSE(m.ok());
  CHECK(contains(m.err().to_string(), "micro-batches m = 2097152"));
  CHECK_FALSE(m.err().hint.empty());
}

TEST_CASE("the product p x v x m is bounded by this machine's memory") {
  schedule_options v;
  v.virtual_stages = 1024;
  auto r = make_schedule("interleaved_1f1b", 1024, 1 << 20, v);
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.err().to_string(), "(chunk, micro-batch) passes, above the " + std::to_string(max_passes())));
  CHECK(max_passes() >= (1 << 20));
}

TEST_CASE("a schedule file of 100,000 rank lines is refused at the first line too many") {
  std::string text;
  for (int r = 0; r < 100000; ++r) text += std::to_string(r) + "F0 " + std::to_string(r) + "B0\n";
  auto s = parse_schedule_text(text, "many.txt", false);
  REQUIRE_FALSE(s.ok());
  CHECK(s.err().where.line == 1025);
  CHECK(contains(s.err().message, "more than 1024 rank lines"));
}

TEST_CASE("a schedule file naming chunk 2000000 or micro-batch 2^20 is refused at that token") {
  auto chunk = parse_schedule_text("rank 0: 0F0 2000000F0\n", "chunk.txt", false);
  REQUIRE_FALSE(chunk.ok());
  CHECK(chunk.err().where.line == 1);
  CHECK(chunk.err().where.column == 13);
  CHECK(contains(chunk.err().message, "names chunk 2000000"));

  // One rank holding chunk 999999 means a million virtual stages.
  auto v = parse_schedule_text("rank 0: 0F0 999999F0\n", "v.txt", false);
  REQUIRE_FALSE(v.ok());
  CHECK(contains(v.err().to_string(), "schedule file v.txt: virtual stages v = 1000000"));

  auto mb = parse_schedule_text("0F1048576\n", "mb.csv", true);
  REQUIRE_FALSE(mb.ok());
  CHECK(contains(mb.err().message, "names micro-batch 1048576"));
}

TEST_CASE("a schedule file that is /dev/zero, a folder or a FIFO is refused without reading it") {
  auto zero = make_schedule("/dev/zero", 2, 2, {});
  REQUIRE_FALSE(zero.ok());
  CHECK(contains(zero.err().to_string(), "/dev/zero: is a character device"));

  const auto dir = std::filesystem::temp_directory_path() /
                   ("troupe_sched_limits_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto folder = make_schedule(dir.string(), 2, 2, {});
  REQUIRE_FALSE(folder.ok());
  CHECK(contains(folder.err().to_string(), "is a directory, expected a schedule file"));

  const std::string fifo = (dir / "sched.txt").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto pipe = make_schedule(fifo, 2, 2, {});
  REQUIRE_FALSE(pipe.ok());
  CHECK(contains(pipe.err().to_string(), "FIFO"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("costs that are NaN or infinite are refused like negative ones") {
  for (auto text : {"nan,2", "1,inf", "1e999", "f=nan", "comm=inf"}) {
    CAPTURE(text);
    auto c = parse_costs(text);
    REQUIRE_FALSE(c.ok());
    CHECK(c.err().message.find("is not a number >= 0") != std::string::npos);
  }
}
