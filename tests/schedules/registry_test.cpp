// The registry: built-in names, unknown names, duplicate names, generators that break their
// contract, and plugins loaded with dlopen.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "schedules/registry.hpp"
#include "schedules/simulate.hpp"
#include "schedules/validate.hpp"

using namespace troupe::schedules;

namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string error_of(const troupe::core::result<schedule>& s) {
  REQUIRE_FALSE(s.ok());
  return s.err().message + "\n" + s.err().hint;
}

}  // namespace

TEST_CASE("the four built-in schedules are registered") {
  const auto names = schedule_names();
  for (auto name : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"}) CHECK(std::count(names.begin(), names.end(), name) == 1);
}

TEST_CASE("an unknown name is an error that lists the valid names") {
  const auto e = error_of(make_schedule("2f2b", 4, 8, {}));
  CHECK(has(e, "unknown schedule '2f2b'"));
  CHECK(has(e, "1f1b, gpipe, interleaved_1f1b"));
  CHECK(has(e, "zb_h1"));
  CHECK(has(e, "LIB.so:NAME"));
}

TEST_CASE("a schedule file that does not exist is named, with the valid names") {
  const auto e = error_of(make_schedule("configs/schedules/nope.txt", 4, 8, {}));
  CHECK(has(e, "schedule file 'configs/schedules/nope.txt' does not exist"));
  CHECK(has(e, "zb_h1"));
}

TEST_CASE("registering a name twice is an error that names both definitions") {
  auto gen = [](int p, int m, const schedule_options& o) { return make_schedule("1f1b", p, m, o); };
  REQUIRE(register_schedule("twice_registered", gen, "test definition A").ok());
  const auto st = register_schedule("twice_registered", gen, "test definition B");
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().message, "already defined by test definition A"));
  CHECK(has(st.err().message, "again from test definition B"));
}

TEST_CASE("registering a built-in name is refused, naming the built-in") {
  const auto st = register_schedule("1f1b", [](int, int, const schedule_options&) { return troupe::core::result<schedule>(schedule{}); },
                                    "test");
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().message, "built-in"));
}

TEST_CASE("names with ':' or '/' or nothing cannot be registered") {
  auto gen = [](int p, int m, const schedule_options& o) { return make_schedule("1f1b", p, m, o); };
  CHECK_FALSE(register_schedule("", gen, "test").ok());
  CHECK_FALSE(register_schedule("lib.so:x", gen, "test").ok());
  CHECK_FALSE(register_schedule("a/b", gen, "test").ok());
}

TEST_CASE("a registered generator's output is validated before make_schedule returns it") {
  REQUIRE(register_schedule("forgets_a_backward",
                            [](int p, int m, const schedule_options& o) {
                              auto s = make_schedule("gpipe", p, m, o);
                              s->ranks[0].pop_back();
                              return s;
                            },
                            "test")
              .ok());
  const auto e = error_of(make_schedule("forgets_a_backward", 2, 2, {}));
  CHECK(has(e, "never backwarded"));
  CHECK(has(e, ">0F1<"));
}

TEST_CASE("a generator that ignores p or m is caught") {
  REQUIRE(register_schedule("always_two_ranks",
                            [](int, int m, const schedule_options& o) { return make_schedule("1f1b", 2, m, o); }, "test")
              .ok());
  CHECK(has(error_of(make_schedule("always_two_ranks", 4, 8, {})), "pipeline_stage p = 2, but 4 was asked for"));
}

TEST_CASE("a plugin loaded with dlopen registers a generator that runs like a built-in") {
  REQUIRE(load_schedule_plugin(TROUPE_TEST_PLUGIN).ok());
  const auto names = schedule_names();
  CHECK(std::count(names.begin(), names.end(), "looped_bfs") == 1);
  schedule_options o;
  o.virtual_stages = 2;
  auto s = make_schedule("looped_bfs", 4, 8, o);
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
  CHECK(s->name == "looped_bfs");
  CHECK(validate(*s).ok());
  auto sim = simulate(*s);
  REQUIRE(sim.ok());
  CHECK(sim->ranks[0].peak_activations == 16);  // breadth-first: every micro-batch of both chunks
  // Loading the same library again registers nothing twice.
  CHECK(load_schedule_plugin(TROUPE_TEST_PLUGIN).ok());
}

TEST_CASE("LIB.so:NAME loads the plugin and picks the name") {
  auto s = make_schedule(std::string(TROUPE_TEST_PLUGIN) + ":looped_bfs", 2, 4, {});
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
  CHECK(s->stages == 2);
  CHECK(has(error_of(make_schedule(std::string(TROUPE_TEST_PLUGIN) + ":no_such", 2, 4, {})),
            "defines no schedule 'no_such'"));
}

TEST_CASE("a plugin that registers a built-in name fails, naming the built-in and the plugin") {
  const auto st = load_schedule_plugin(TROUPE_TEST_CLASHING_PLUGIN);
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().message, "schedule '1f1b' is already defined by built-in"));
  CHECK(has(st.err().message, std::string("plugin ") + TROUPE_TEST_CLASHING_PLUGIN));
}

TEST_CASE("two plugins that register the same name: the second fails, naming both files") {
  REQUIRE(load_schedule_plugin(TROUPE_TEST_PLUGIN).ok());
  const auto copy = std::filesystem::temp_directory_path() /
                    ("troupe_plugin_copy_" + std::to_string(getpid()) + ".so");
  std::filesystem::copy_file(TROUPE_TEST_PLUGIN, copy, std::filesystem::copy_options::overwrite_existing);
  const auto st = load_schedule_plugin(copy.string());
  std::filesystem::remove(copy);
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().message, std::string("already defined by plugin ") + TROUPE_TEST_PLUGIN));
  CHECK(has(st.err().message, "again from plugin " + copy.string()));
}

TEST_CASE("a file that is not a plugin, or not there, is an error naming it") {
  const auto missing = load_schedule_plugin("/nonexistent/libnothing.so");
  REQUIRE_FALSE(missing.ok());
  CHECK(has(missing.err().to_string(), "/nonexistent/libnothing.so"));
  const auto text = std::filesystem::temp_directory_path() / ("troupe_not_a_plugin_" + std::to_string(getpid()) + ".so");
  std::ofstream(text) << "not a shared library\n";
  const auto st = load_schedule_plugin(text.string());
  std::filesystem::remove(text);
  REQUIRE_FALSE(st.ok());
  CHECK(has(st.err().message, "cannot load schedule plugin"));
}

TEST_CASE("built-in names take v = 0 as one chunk per rank") {
  schedule_options o;
  o.virtual_stages = 0;
  auto s = make_schedule("1f1b", 2, 4, o);
  REQUIRE(s.ok());
  CHECK(s->virtual_stages == 1);
}
