// Readers of outside input under hostile files: a FIFO or device where a token shard, a
// safetensors file or manifest.json is expected (once a hang in open()), and manifest numbers that
// do not fit (a step of 2^40 once read as 0, restarting a resumed run from the beginning). Each is
// refused at once, naming the file and the field.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "model/checkpoint.hpp"
#include "model/safetensors.hpp"
#include "model/shards.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace ck = troupe::model::checkpoint;
using troupe::model::testing::file_bytes;
using troupe::model::testing::scratch_dir;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

ck::save_request small_request(int step) {
  ck::save_request r;
  r.step = step;
  r.seed = 5;
  r.config_toml = "[model]\narch = \"gpt2\"\n";
  r.shards = {{"model.safetensors", "model",
               {{"a.weight", troupe::core::tensor::zeros({2, 3})}}}};
  return r;
}

std::string open_error(const std::string& dir) {
  auto r = ck::reader::open(dir);
  return r.ok() ? std::string("(opened)") : r.err().to_string();
}

// Replaces manifest.json's text with `edit`'s result.
template <class F>
void edit_manifest(const std::string& dir, F edit) {
  const std::string path = dir + "/manifest.json";
  auto j = nlohmann::json::parse(file_bytes(path));
  edit(j);
  std::ofstream(path, std::ios::trunc) << j.dump(1);
}

}  // namespace

TEST_CASE("a FIFO or /dev/zero as a token shard is refused at once, naming it") {
  scratch_dir tmp("badshard");
  const std::string fifo = tmp / "train.bin";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto s = troupe::model::shard::open(fifo);
  REQUIRE_FALSE(s.ok());
  CHECK(contains(s.err().to_string(), fifo + ": is a FIFO"));
  CHECK(contains(s.err().to_string(), "expected a token shard"));
  CHECK(contains(s.err().to_string(), "troupe data prepare"));

  auto z = troupe::model::shard::open("/dev/zero");
  REQUIRE_FALSE(z.ok());
  CHECK(contains(z.err().to_string(), "/dev/zero: is a character device"));
}

TEST_CASE("a FIFO as a checkpoint's safetensors file or manifest.json is refused at once") {
  scratch_dir tmp("badckpt");
  auto dir = ck::save(tmp / "c", small_request(2));
  REQUIRE(dir.ok());
  const std::string weights = dir.value() + "/model.safetensors";
  std::filesystem::remove(weights);
  REQUIRE(::mkfifo(weights.c_str(), 0600) == 0);
  CHECK(contains(open_error(dir.value()), weights + ": is a FIFO"));
  auto st = troupe::model::safetensors::file::open(weights);
  REQUIRE_FALSE(st.ok());
  CHECK(contains(st.err().to_string(), "expected a safetensors file"));

  const std::string manifest = dir.value() + "/manifest.json";
  std::filesystem::remove(manifest);
  REQUIRE(::mkfifo(manifest.c_str(), 0600) == 0);
  const std::string e = open_error(dir.value());
  CHECK(contains(e, manifest + ": is a FIFO"));
  CHECK(contains(e, "expected a checkpoint manifest"));
}

TEST_CASE("a manifest step of 2^40 is refused instead of read as 0") {
  scratch_dir tmp("bigstep");
  auto dir = ck::save(tmp / "c", small_request(3));
  REQUIRE(dir.ok());
  REQUIRE(ck::reader::open(dir.value()).ok());
  edit_manifest(dir.value(), [](nlohmann::json& j) { j["step"] = std::uint64_t(1) << 40; });
  const std::string e = open_error(dir.value());
  CHECK(contains(e, "manifest.json: step: is 1099511627776, above the largest 2147483647"));
  CHECK(contains(e, "hint:"));
}

TEST_CASE("negative, fractional and wrapped manifest numbers are refused, naming the field") {
  scratch_dir tmp("badnums");
  auto dir = ck::save(tmp / "c", small_request(3));
  REQUIRE(dir.ok());
  edit_manifest(dir.value(), [](nlohmann::json& j) { j["data_position"]["next_step"] = -1; });
  CHECK(contains(open_error(dir.value()), "data_position.next_step: is -1, outside 0..2147483647"));

  edit_manifest(dir.value(), [](nlohmann::json& j) {
    j["data_position"]["next_step"] = 3;
    j["seed"] = -1;
  });
  CHECK(contains(open_error(dir.value()), "seed: is -1, expected a whole number of at least 0"));

  edit_manifest(dir.value(), [](nlohmann::json& j) {
    j["seed"] = 5;
    j["step"] = 2.5;
  });
  CHECK(contains(open_error(dir.value()), "step: is 2.5, expected a whole number"));
}
