// Instruction shards (model/instruction_shards.hpp) and the loader over them (model/loader.hpp):
// rows come back with their masked targets at −1, drawn by the same pure function as windows,
// and every malformed file is refused naming it.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "model/instruction_shards.hpp"
#include "model/loader.hpp"
#include "tests/model/trainer_fixture.hpp"

using namespace troupe;
using namespace troupe::model;
using model::testing::scratch_dir;

namespace {

constexpr int T = 6;  // rows of 7 tokens

// Row r: tokens 100·r + t; mask: tokens 3.. of even rows, the last token of odd rows.
void write_rows(const std::string& path, int rows, std::int32_t base = 0) {
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> mask;
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t <= T; ++t) {
      ids.push_back(base + 100 * r + t);
      mask.push_back(r % 2 == 0 ? t >= 3 : t == T);
    }
  auto st = write_instruction_shard(path, row_layout{T + 1, true, 1, 7}, ids, mask);
  REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.err().to_string()));
}

loader_options opts(int B, int M) {
  loader_options o;
  o.seq_length = T;
  o.micro_batch_size = B;
  o.micro_batches = M;
  o.seed = 11;
  return o;
}

loader open_or_fail(const std::string& spec, const loader_options& o) {
  auto l = loader::open(spec, o);
  REQUIRE_MESSAGE(l.ok(), (l.ok() ? "" : l.err().to_string()));
  return std::move(l.value());
}

std::string open_error(const std::string& spec, const loader_options& o) {
  auto l = loader::open(spec, o);
  REQUIRE_FALSE(l.ok());
  return l.err().to_string();
}

}  // namespace

TEST_CASE("an instruction shard round-trips its header, tokens and mask") {
  scratch_dir tmp("ishard_rt");
  write_rows(tmp / "a.bin", 5);
  auto s = instruction_shard::open(tmp / "a.bin");
  REQUIRE(s.ok());
  CHECK(s->rows() == 5);
  CHECK(s->layout().row_tokens == T + 1);
  CHECK(s->layout().packing);
  CHECK(s->layout().template_id == 1);
  CHECK(s->layout().pad_id == 7);
  CHECK(s->token(3, 4) == 304);
  CHECK(s->trained(0) == T + 1 - 3);
  CHECK(s->trained(1) == 1);
  CHECK(is_instruction_shard(tmp / "a.bin"));
  // Ids past 65535 are stored in 4 bytes.
  write_rows(tmp / "wide.bin", 2, 70000);
  auto w = instruction_shard::open(tmp / "wide.bin");
  REQUIRE(w.ok());
  CHECK(w->token(1, 2) == 70102);
  // Per token: the id, the mask byte and the example-start byte (version 2).
  CHECK(std::filesystem::file_size(tmp / "wide.bin") ==
        std::filesystem::file_size(tmp / "a.bin") - 5 * 7 * (2 + 2) + 2 * 7 * (4 + 2));
  // Written without starts: one example per row.
  CHECK(s->version() == 2);
  CHECK(s->starts_example(2, 0));
  CHECK_FALSE(s->starts_example(2, 3));
  // Written with starts: they come back.
  std::vector<std::int32_t> ids(2 * 7, 5);
  std::vector<std::uint8_t> mask(ids.size(), 1), starts(ids.size(), 0);
  starts[0] = starts[4] = starts[7] = starts[9] = 1;
  REQUIRE(write_instruction_shard(tmp / "starts.bin", row_layout{7, true, 0, 0}, ids, mask, starts).ok());
  auto st = instruction_shard::open(tmp / "starts.bin");
  REQUIRE(st.ok());
  for (int r = 0; r < 2; ++r)
    for (int t = 0; t < 7; ++t) CHECK(st->starts_example(r, t) == (starts[r * 7 + t] == 1));
}

TEST_CASE("the loader cuts whole rows with masked targets at -1 and counts the trained ones") {
  scratch_dir tmp("ishard_cut");
  write_rows(tmp / "a.bin", 9);
  const loader l = open_or_fail(tmp / "a.bin", opts(3, 2));
  CHECK(l.masked());
  CHECK(l.windows() == 9);
  for (int mb = 0; mb < 2; ++mb) {
    batch b = l.cut(4, 0, mb);
    std::int64_t trained = 0;
    for (int i = 0; i < 3; ++i) {
      // The documented draw: a row number where token shards have a window start.
      const std::uint64_t k = static_cast<std::uint64_t>(mb) * 3 + static_cast<std::uint64_t>(i);
      const std::uint64_t row = core::rng_stream(core::stream_key(11, 0xda7a, 4, k)).below(9);
      CHECK(l.window_of(4, k) == row);
      for (int t = 0; t < T; ++t) {
        const auto j = static_cast<std::size_t>(i * T + t);
        CHECK(b.tokens.data<std::int32_t>()[j] == static_cast<std::int32_t>(100 * row) + t);
        const bool trained_here = row % 2 == 0 ? t + 1 >= 3 : t + 1 == T;
        CHECK(b.targets.data<std::int32_t>()[j] ==
              (trained_here ? static_cast<std::int32_t>(100 * row) + t + 1 : -1));
        trained += trained_here;
      }
    }
    CHECK(b.trained == trained);
  }
  // The step's denominator is the trained targets of the global batch's cuts.
  CHECK(l.trained_targets(4, 6) == l.cut(4, 0, 0).trained + l.cut(4, 0, 1).trained);
  // Replica 1 of two holds the second half of that global batch.
  const loader half = open_or_fail(tmp / "a.bin", opts(3, 1));
  CHECK(half.cut(4, 1, 0).trained == l.cut(4, 0, 1).trained);
  CHECK(half.trained_targets(4, 6) == l.trained_targets(4, 6));
}

TEST_CASE("token shards count every target as trained") {
  scratch_dir tmp("ishard_plain");
  std::vector<std::uint16_t> tokens(100, 3);
  REQUIRE(write_shard(tmp / "t.bin", tokens).ok());
  const loader l = open_or_fail(tmp / "t.bin", opts(2, 2));
  CHECK_FALSE(l.masked());
  CHECK(l.cut(0, 0, 1).trained == 2 * T);
  CHECK(l.trained_targets(5, 4) == 4 * T);
}

TEST_CASE("rows prepared for another seq_length are refused naming both lengths") {
  scratch_dir tmp("ishard_len");
  write_rows(tmp / "a.bin", 4);
  auto o = opts(1, 1);
  o.seq_length = 8;
  const std::string e = open_error(tmp / "a.bin", o);
  CHECK(e.find("a.bin") != std::string::npos);
  CHECK(e.find("rows of 7 tokens (prepared for seq_length 6)") != std::string::npos);
  CHECK(e.find("model.seq_length 8") != std::string::npos);
}

TEST_CASE("a folder mixing token shards and instruction shards is refused") {
  scratch_dir tmp("ishard_mix");
  write_rows(tmp / "a.bin", 4);
  std::vector<std::uint16_t> tokens(100, 3);
  REQUIRE(write_shard(tmp / "b.bin", tokens).ok());
  const std::string e = open_error(tmp.path.string(), opts(1, 1));
  CHECK(e.find("b.bin") != std::string::npos);
  CHECK(e.find("is a token shard, but") != std::string::npos);
}

TEST_CASE("truncated, padded, empty and corrupt instruction shards are refused naming the file") {
  scratch_dir tmp("ishard_bad");
  write_rows(tmp / "a.bin", 4);
  const std::string whole = model::testing::file_bytes(tmp / "a.bin");
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(tmp / name, std::ios::binary) << bytes;
    return tmp / name;
  };
  CHECK(open_error(write("cut.bin", whole.substr(0, whole.size() - 3)), opts(1, 1))
            .find("truncated: the header promises 4 rows of 7 tokens") != std::string::npos);
  CHECK(open_error(write("long.bin", whole + "x"), opts(1, 1)).find("has trailing bytes") !=
        std::string::npos);
  CHECK(open_error(write("head.bin", whole.substr(0, 100)), opts(1, 1))
            .find("cut off inside its header") != std::string::npos);
  std::string bad_width = whole;
  bad_width[16] = 3;
  CHECK(open_error(write("width.bin", bad_width), opts(1, 1))
            .find("bytes per token 3 is not 2 or 4") != std::string::npos);
  std::string bad_version = whole;
  bad_version[4] = 9;
  CHECK(open_error(write("version.bin", bad_version), opts(1, 1))
            .find("unsupported instruction shard version 9") != std::string::npos);
  REQUIRE(write_instruction_shard(tmp / "empty.bin", row_layout{T + 1, false, 0, 0}, {}, {}).ok());
  CHECK(open_error(tmp / "empty.bin", opts(1, 1)).find("holds no rows") != std::string::npos);
}

TEST_CASE("a token id not below vocab_size in a row makes cut fail naming it and the shard") {
  scratch_dir tmp("ishard_vocab");
  write_rows(tmp / "a.bin", 4, 300);
  auto o = opts(4, 1);
  o.vocab_size = 200;
  const loader l = open_or_fail(tmp / "a.bin", o);
  try {
    (void)l.cut(0, 0, 0);
    FAIL("cut accepted an id past the vocabulary");
  } catch (const core::failure& e) {
    const std::string m = e.what();
    CHECK(m.find("a.bin") != std::string::npos);
    CHECK(m.find("not below model.vocab_size 200") != std::string::npos);
  }
}
