// Config text that would crash or mislead the parser: keys and headers nested deep enough to
// overflow toml++'s recursion (in a file, in a --set value with a newline), NUL bytes in strings,
// oversized text, a folder or a device as the config file, and micro-batch counts past what a
// schedule holds. Each is refused with file, line and a hint; valid nesting still parses.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/config.hpp"

using namespace troupe;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string dotted(int parts) {
  std::string key = "a";
  for (int i = 1; i < parts; ++i) key += ".a";
  return key;
}

}  // namespace

TEST_CASE("a dotted key of 50,000 parts is refused before toml++ recurses on it") {
  const std::string text = "[model]\nnum_layers = 2\n" + dotted(50000) + " = 1\n";
  auto r = core::parse_config(text, "deep.toml");
  REQUIRE_FALSE(r.ok());
  const auto& e = r.err();
  CHECK(e.where.file == "deep.toml");
  CHECK(e.where.line == 3);
  CHECK(contains(e.message, "more than 32 levels deep"));
  CHECK_FALSE(e.hint.empty());
}

TEST_CASE("a [table] header of 100,000 parts and deeply nested arrays are refused") {
  auto header = core::parse_config(std::string("[") + dotted(100000) + "]\nx = 1\n", "header.toml");
  REQUIRE_FALSE(header.ok());
  CHECK(header.err().where.line == 1);
  CHECK(contains(header.err().message, "levels deep"));

  auto arrays = core::parse_config("[model]\nx = " + std::string(100000, '[') + "\n", "arr.toml");
  REQUIRE_FALSE(arrays.ok());
  CHECK(contains(arrays.err().message, "levels deep"));
}

TEST_CASE("dots and brackets inside strings and comments do not count as nesting") {
  const std::string many_dots(5000, '.');
  const std::string text = "# " + many_dots + " [[[[[[\n[data]\ntrain = \"" + many_dots +
                           "/x\"\nval = '''" + std::string(100, '[') + "'''\n";
  auto r = core::parse_config(text, "strings.toml");
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.err().to_string()));
  CHECK(r->data.train == many_dots + "/x");
}

TEST_CASE("a --set value with a newline and a deep header is refused, naming the override") {
  auto r = core::parse_config("", "empty.toml", {std::string("train.steps=1\n[") + dotted(60000) + "]"});
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.err().where.file, "--set train.steps=1"));
  CHECK(contains(r.err().message, "levels deep"));
}

TEST_CASE("a NUL byte inside a string key is refused instead of cutting the path short") {
  auto r = core::parse_config("[data]\ntrain = \"data/a\\u0000.bin\"\n", "nul.toml");
  REQUIRE_FALSE(r.ok());
  CHECK(r.err().where.line == 2);
  CHECK(r.err().where.key == "data.train");
  CHECK(contains(r.err().message, "NUL byte"));
}

TEST_CASE("config text above the size limit is refused without parsing it") {
  const std::string text = "# " + std::string(5u << 20, 'x') + "\n";
  auto r = core::parse_config(text, "huge.toml");
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.err().to_string(), "huge.toml: config text of"));
}

TEST_CASE("load_config refuses a folder and /dev/zero as the config file at once") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("troupe_config_limits_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto folder = core::load_config(dir.string(), {"train.steps=1"});
  REQUIRE_FALSE(folder.ok());
  CHECK(contains(folder.err().to_string(), "is a directory, expected a config file"));
  std::filesystem::remove_all(dir);

  auto zero = core::load_config("/dev/zero");
  REQUIRE_FALSE(zero.ok());
  CHECK(contains(zero.err().to_string(), "/dev/zero: is a character device"));
}

TEST_CASE("micro_batch_num x gradient_accumulation_steps above 2^20 is refused at its key") {
  auto r = core::parse_config("[parallel]\nmicro_batch_num = 1048576\n[train]\n"
                              "gradient_accumulation_steps = 2\n",
                              "mb.toml");
  REQUIRE_FALSE(r.ok());
  CHECK(r.err().where.key == "train.gradient_accumulation_steps");
  CHECK(r.err().where.line == 4);
  CHECK(contains(r.err().message, "2097152 micro-batches per step"));
}
