// llm.c token shards, uint16 and uint32: the byte layout written, the round trip through mmap, the
// choice of width by vocabulary size, and the messages for files that are cut short, foreign, or
// of another llm.c kind.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/shards.hpp"

namespace fs = std::filesystem;
using namespace troupe::model;

namespace {

fs::path scratch_dir(const std::string& name) {
  fs::path d =
      fs::temp_directory_path() / ("troupe_shard_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<std::uint16_t> sample_tokens(std::size_t n) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>((i * 7919u) % 65536u);
  return t;
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A shard file with the given header words and `count` tokens' worth of zero bytes.
void write_raw_shard(const fs::path& p, std::int32_t magic, std::int32_t version, std::int32_t count,
                     std::size_t token_bytes) {
  std::vector<char> bytes(shard_header_bytes + token_bytes, 0);
  std::int32_t h[3] = {magic, version, count};
  std::memcpy(bytes.data(), h, sizeof h);
  write_bytes(p, bytes);
}

std::string open_error(const fs::path& p) {
  auto s = shard::open(p.string());
  REQUIRE(!s.ok());
  return s.err().to_string();
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("write_shard lays out llm.c's 256-int32 header then uint16 tokens") {
  auto dir = scratch_dir("layout");
  auto tokens = sample_tokens(1000);
  auto path = dir / "train.bin";
  REQUIRE(write_shard(path.string(), tokens).ok());
  auto bytes = read_bytes(path);
  REQUIRE(bytes.size() == 1024 + 2 * 1000);
  std::int32_t header[256];
  std::memcpy(header, bytes.data(), sizeof header);
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == 1000);
  for (int i = 3; i < 256; ++i) CHECK(header[i] == 0);
  CHECK(std::memcmp(bytes.data() + 1024, tokens.data(), 2000) == 0);
  // Nothing but the shard is left in the folder: the temporary name was renamed away.
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);
  fs::remove_all(dir);
}

TEST_CASE("shard::open maps back exactly the tokens written, and an empty shard is valid") {
  auto dir = scratch_dir("roundtrip");
  auto tokens = sample_tokens(12345);
  REQUIRE(write_shard((dir / "a.bin").string(), tokens).ok());
  auto s = shard::open((dir / "a.bin").string());
  REQUIRE(s.ok());
  CHECK(s->size() == tokens.size());
  CHECK(std::equal(tokens.begin(), tokens.end(), s->tokens16().begin(), s->tokens16().end()));
  CHECK(s->path() == (dir / "a.bin").string());

  shard moved = std::move(s.value());
  CHECK(moved.size() == tokens.size());
  CHECK(moved.tokens16()[12344] == tokens[12344]);

  REQUIRE(write_shard((dir / "empty.bin").string(), std::vector<std::uint16_t>{}).ok());
  auto e = shard::open((dir / "empty.bin").string());
  REQUIRE(e.ok());
  CHECK(e->size() == 0);
  fs::remove_all(dir);
}

TEST_CASE("rewriting a shard replaces it whole") {
  auto dir = scratch_dir("rewrite");
  auto p = (dir / "s.bin").string();
  REQUIRE(write_shard(p, sample_tokens(5000)).ok());
  REQUIRE(write_shard(p, sample_tokens(10)).ok());
  auto s = shard::open(p);
  REQUIRE(s.ok());
  CHECK(s->size() == 10);
  fs::remove_all(dir);
}

TEST_CASE("a truncated shard names the file, the expected and the found size") {
  auto dir = scratch_dir("truncated");
  auto p = dir / "t.bin";
  REQUIRE(write_shard(p.string(), sample_tokens(100)).ok());
  fs::resize_file(p, 1024 + 50);
  auto msg = open_error(p);
  CHECK(has(msg, p.string()));
  CHECK(has(msg, "truncated"));
  CHECK(has(msg, "100 uint16 tokens"));
  CHECK(has(msg, "expected 1224 bytes, found 1074"));
  CHECK(has(msg, "hint: "));

  fs::resize_file(p, 500);  // cut inside the header
  msg = open_error(p);
  CHECK(has(msg, "1024-byte llm.c shard header, found a file of 500 bytes"));
  CHECK(has(msg, "cut off inside its header"));
  fs::remove_all(dir);
}

TEST_CASE("a shard with bytes after its tokens is refused") {
  auto dir = scratch_dir("trailing");
  auto p = dir / "t.bin";
  REQUIRE(write_shard(p.string(), sample_tokens(100)).ok());
  fs::resize_file(p, 1024 + 200 + 6);
  auto msg = open_error(p);
  CHECK(has(msg, "trailing bytes"));
  CHECK(has(msg, "expected 1224 bytes, found 1230"));
  fs::remove_all(dir);
}

TEST_CASE("a foreign file is refused with what it looks like") {
  auto dir = scratch_dir("foreign");
  auto small = dir / "notes.txt";
  { std::ofstream(small) << "Call me Ishmael."; }
  auto msg = open_error(small);
  CHECK(has(msg, small.string()));
  CHECK(has(msg, "not a token shard"));
  CHECK(has(msg, "text 'Call me Ishmael."));
  CHECK(has(msg, "troupe data prepare"));

  auto big = dir / "book.txt";
  {
    std::ofstream out(big);
    for (int i = 0; i < 200; ++i) out << "Call me Ishmael. ";
  }
  msg = open_error(big);
  CHECK(has(msg, "not an llm.c token shard: expected magic 20240520 (uint16 tokens) or 20240801 "
                 "(uint32 tokens) in the first 4 bytes"));
  CHECK(has(msg, "text 'Call me Ishmael."));

  msg = open_error(dir / "absent.bin");
  CHECK(has(msg, "cannot open the token shard"));
  CHECK(has(msg, "absent.bin"));
  fs::remove_all(dir);
}

TEST_CASE("a wrong magic, version or count is reported with expected and found values") {
  auto dir = scratch_dir("magic");
  auto p = dir / "x.bin";
  write_raw_shard(p, 20240326, 3, 0, 4096);  // llm.c's GPT-2 model file magic
  auto msg = open_error(p);
  CHECK(has(msg, "expected magic 20240520"));
  CHECK(has(msg, "found an llm.c GPT-2 model checkpoint (magic 20240326)"));

  write_raw_shard(p, 12345, 1, 10, 20);
  msg = open_error(p);
  CHECK(has(msg, "(uint32 tokens) in the first 4 bytes, found magic 12345"));

  write_raw_shard(p, 20240520, 2, 10, 20);
  msg = open_error(p);
  CHECK(has(msg, "unsupported shard version: magic 20240520 expects version 1 (uint16 tokens), "
                 "found 2"));

  write_raw_shard(p, 20240801, 1, 10, 40);
  msg = open_error(p);
  CHECK(has(msg, "magic 20240801 expects version 7 (uint32 tokens), found 1"));

  write_raw_shard(p, 20240520, 1, -5, 20);
  msg = open_error(p);
  CHECK(has(msg, "token count -5 is negative"));
  fs::remove_all(dir);
}

TEST_CASE("write_shard reports a folder it cannot write to") {
  auto s = write_shard("/nonexistent-troupe-dir/train.bin", sample_tokens(3));
  REQUIRE(!s.ok());
  CHECK(has(s.err().to_string(), "/nonexistent-troupe-dir/train.bin"));
  CHECK(has(s.err().to_string(), "cannot create"));
}

TEST_CASE("to_u16 narrows ids and refuses one that does not fit, naming its position") {
  std::vector<int> ok = {0, 50256, 65535};
  auto r = to_u16(ok);
  REQUIRE(r.ok());
  CHECK(r.value() == std::vector<std::uint16_t>{0, 50256, 65535});
  std::vector<int> bad = {1, 2, 70000};
  auto e = to_u16(bad);
  REQUIRE(!e.ok());
  CHECK(has(e.err().to_string(), "token id 70000 at position 2"));
}

TEST_CASE("a uint32 shard has llm.c's LLaMA-3 header (20240801, version 7) and maps back") {
  auto dir = scratch_dir("wide");
  std::vector<std::uint32_t> tokens(3000);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<std::uint32_t>((i * 104729u) % 128256u);
  auto path = dir / "train.bin";
  REQUIRE(write_shard(path.string(), std::span<const std::uint32_t>(tokens)).ok());
  auto bytes = read_bytes(path);
  REQUIRE(bytes.size() == 1024 + 4 * 3000);
  std::int32_t header[256];
  std::memcpy(header, bytes.data(), sizeof header);
  CHECK(header[0] == 20240801);
  CHECK(header[1] == 7);
  CHECK(header[2] == 3000);
  for (int i = 3; i < 256; ++i) CHECK(header[i] == 0);
  CHECK(std::memcmp(bytes.data() + 1024, tokens.data(), 4 * 3000) == 0);

  auto s = shard::open(path.string());
  REQUIRE(s.ok());
  CHECK(s->width() == 4);
  CHECK(s->size() == 3000);
  CHECK(std::equal(tokens.begin(), tokens.end(), s->tokens32().begin(), s->tokens32().end()));
  for (std::size_t i = 0; i < tokens.size(); i += 97) CHECK(s->id(i) == tokens[i]);
  CHECK_THROWS_WITH(s->tokens16(), doctest::Contains("holds uint32 tokens"));

  fs::resize_file(path, 1024 + 4 * 3000 - 2);
  auto msg = open_error(path);
  CHECK(has(msg, "3000 uint32 tokens, so expected 13024 bytes, found 13022"));
  fs::remove_all(dir);
}

TEST_CASE("write_tokens keeps uint16 up to 65,536 ids, widens above, and refuses out-of-range ids") {
  auto dir = scratch_dir("choose");
  const std::vector<int> ids = {0, 1, 50256, 65535};
  auto narrow = (dir / "narrow.bin").string();
  REQUIRE(write_tokens(narrow, ids, 65536).ok());
  auto n = shard::open(narrow);
  REQUIRE(n.ok());
  CHECK(n->width() == 2);
  CHECK(fs::file_size(narrow) == 1024 + 2 * ids.size());
  // Byte-identical to the uint16 writer: GPT-2 data keeps llm.c's format.
  auto same = (dir / "same.bin").string();
  const std::vector<std::uint16_t> as16 = {0, 1, 50256, 65535};
  REQUIRE(write_shard(same, as16).ok());
  CHECK(read_bytes(narrow) == read_bytes(same));

  const std::vector<int> big = {128000, 5, 128255, 65536};
  auto wide = (dir / "wide.bin").string();
  REQUIRE(write_tokens(wide, big, 128256).ok());
  auto w = shard::open(wide);
  REQUIRE(w.ok());
  CHECK(w->width() == 4);
  for (std::size_t i = 0; i < big.size(); ++i) CHECK(w->id(i) == static_cast<std::uint32_t>(big[i]));

  auto e = write_tokens((dir / "bad.bin").string(), big, 100000);
  REQUIRE(!e.ok());
  CHECK(has(e.err().to_string(), "token id 128000 at position 0 is outside the vocabulary [0, 100000)"));
  CHECK(has(e.err().to_string(), "bad.bin"));
  const std::vector<int> negative = {3, -1};
  e = write_tokens((dir / "neg.bin").string(), negative, 50257);
  REQUIRE(!e.ok());
  CHECK(has(e.err().to_string(), "token id -1 at position 1"));
  CHECK(!fs::exists(dir / "bad.bin"));
  fs::remove_all(dir);
}
