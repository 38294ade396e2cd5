// The loader's determinism contract (model/loader.hpp): batches are a pure function of
// (seed, step, data-parallel rank, micro-batch), and the global sequence index makes them
// independent of how a global batch is split over replicas.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "model/loader.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::model;

namespace {

fs::path scratch_dir(const std::string& name) {
  fs::path d =
      fs::temp_directory_path() / ("troupe_loader_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A shard whose token at position j is first + j, so a sequence shows where it was cut from.
std::string counting_shard(const fs::path& p, std::uint16_t first, std::size_t n) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t j = 0; j < n; ++j) t[j] = static_cast<std::uint16_t>(first + j);
  REQUIRE(write_shard(p.string(), t).ok());
  return p.string();
}

std::vector<std::int32_t> values(const core::tensor& t) {
  auto* p = t.data<std::int32_t>();
  return {p, p + t.numel()};
}

loader open_or_fail(const std::vector<std::string>& paths, const loader_options& o) {
  auto l = loader::open(paths, o);
  REQUIRE_MESSAGE(l.ok(), (l.ok() ? "" : l.err().to_string()));
  return std::move(l.value());
}

loader_options opts(int T, int B, int M, std::uint64_t seed = 7) {
  loader_options o;
  o.seq_length = T;
  o.micro_batch_size = B;
  o.micro_batches = M;
  o.seed = seed;
  return o;
}

}  // namespace

TEST_CASE("cut returns int32 [B*T] tokens with targets shifted by one, inside the shard") {
  auto dir = scratch_dir("shape");
  auto p = counting_shard(dir / "a.bin", 100, 5000);
  auto l = open_or_fail({p}, opts(16, 4, 2));
  CHECK(l.tokens() == 5000);
  CHECK(l.windows() == 5000 - 16);
  auto b = l.cut(3, 0, 1);
  CHECK(b.batch_size == 4);
  CHECK(b.seq_length == 16);
  CHECK(b.tokens.type() == core::dtype::i32);
  CHECK(b.tokens.shape() == core::shape_t{64});
  CHECK(b.targets.shape() == core::shape_t{64});
  auto x = values(b.tokens), y = values(b.targets);
  for (int i = 0; i < 4; ++i) {
    int start = x[i * 16];
    CHECK(start >= 100);
    CHECK(start + 16 <= 100 + 4999);  // the last target is the shard's last token at most
    for (int t = 0; t < 16; ++t) {
      CHECK(x[i * 16 + t] == start + t);
      CHECK(y[i * 16 + t] == start + t + 1);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("cut is a pure function of (seed, step, rank, micro-batch) following the documented key") {
  auto dir = scratch_dir("pure");
  auto p = counting_shard(dir / "a.bin", 0, 60000);
  auto a = open_or_fail({p}, opts(8, 3, 4, 42));
  auto b = open_or_fail({p}, opts(8, 3, 4, 42));
  CHECK(values(a.cut(5, 1, 2).tokens) == values(b.cut(5, 1, 2).tokens));
  CHECK(values(a.cut(5, 1, 2).tokens) == values(a.cut(5, 1, 2).tokens));
  CHECK(values(a.cut(5, 1, 2).tokens) != values(a.cut(6, 1, 2).tokens));
  CHECK(values(a.cut(5, 1, 2).tokens) != values(a.cut(5, 0, 2).tokens));
  CHECK(values(a.cut(5, 1, 2).tokens) != values(a.cut(5, 1, 3).tokens));
  auto other_seed = open_or_fail({p}, opts(8, 3, 4, 43));
  CHECK(values(a.cut(5, 1, 2).tokens) != values(other_seed.cut(5, 1, 2).tokens));

  // Sequence i of micro-batch mb on rank r starts at window k = (r*M + mb)*B + i of the stream
  // keyed (seed, 0xda7a, step, k); other components rely on exactly this.
  auto x = values(a.cut(5, 1, 2).tokens);
  for (int i = 0; i < 3; ++i) {
    std::uint64_t k = (1 * 4 + 2) * 3 + i;
    auto expect = core::rng_stream(core::stream_key(42, 0xda7a, 5, k)).below(60000 - 8);
    CHECK(static_cast<std::uint64_t>(x[i * 8]) == expect);
    CHECK(a.window_of(5, k) == expect);
  }
  fs::remove_all(dir);
}

TEST_CASE("data_parallel 1 and 2 at the same global batch see the same sequences") {
  auto dir = scratch_dir("dp");
  auto p = counting_shard(dir / "a.bin", 0, 40000);
  const int B = 2;
  auto dp1 = open_or_fail({p}, opts(32, B, 4));  // one replica, 4 micro-batches
  auto dp2 = open_or_fail({p}, opts(32, B, 2));  // two replicas, 2 micro-batches each
  for (std::uint64_t step : {0ull, 1ull, 17ull}) {
    std::vector<std::int32_t> one, two;
    for (int mb = 0; mb < 4; ++mb) {
      auto v = values(dp1.cut(step, 0, mb).tokens);
      one.insert(one.end(), v.begin(), v.end());
    }
    for (int rank = 0; rank < 2; ++rank)
      for (int mb = 0; mb < 2; ++mb) {
        auto v = values(dp2.cut(step, rank, mb).tokens);
        two.insert(two.end(), v.begin(), v.end());
      }
    CAPTURE(step);
    CHECK(one == two);
  }
  fs::remove_all(dir);
}

TEST_CASE("eval_cut is fixed across seeds and differs from training batches") {
  auto dir = scratch_dir("eval");
  auto p = counting_shard(dir / "v.bin", 0, 30000);
  auto a = open_or_fail({p}, opts(16, 4, 1, 1));
  auto b = open_or_fail({p}, opts(16, 4, 1, 999));
  CHECK(values(a.eval_cut(0).tokens) == values(b.eval_cut(0).tokens));
  CHECK(values(a.eval_cut(3).targets) == values(b.eval_cut(3).targets));
  CHECK(values(a.eval_cut(0).tokens) != values(a.eval_cut(1).tokens));
  CHECK(values(a.eval_cut(0).tokens) != values(a.cut(0, 0, 0).tokens));
  fs::remove_all(dir);
}

TEST_CASE("several shards are numbered in order and no sequence straddles two") {
  auto dir = scratch_dir("multi");
  auto p1 = counting_shard(dir / "a.bin", 0, 300);
  auto p2 = counting_shard(dir / "b.bin", 20000, 200);
  auto l = open_or_fail({p1, p2}, opts(10, 8, 1));
  CHECK(l.tokens() == 500);
  CHECK(l.windows() == (300 - 10) + (200 - 10));
  std::set<bool> seen_shard;
  for (std::uint64_t step = 0; step < 50; ++step) {
    auto x = values(l.cut(step, 0, 0).tokens);
    auto y = values(l.cut(step, 0, 0).targets);
    for (int i = 0; i < 8; ++i) {
      int start = x[i * 10];
      bool second = start >= 20000;
      seen_shard.insert(second);
      // Consecutive values means the whole window, targets included, came from one shard.
      CHECK(y[i * 10 + 9] == start + 10);
      CHECK(y[i * 10 + 9] <= (second ? 20199 : 299));
    }
  }
  CHECK(seen_shard.size() == 2);
  fs::remove_all(dir);
}

TEST_CASE("a shard shorter than seq_length + 1 tokens is an error naming it") {
  auto dir = scratch_dir("short");
  auto exact = counting_shard(dir / "exact.bin", 0, 65);
  auto l = loader::open(std::vector<std::string>{exact}, opts(64, 1, 1));
  REQUIRE(l.ok());
  CHECK(l->windows() == 1);
  CHECK(values(l->cut(9, 0, 0).tokens)[0] == 0);

  auto p = counting_shard(dir / "short.bin", 0, 64);
  auto bad = loader::open(std::vector<std::string>{p}, opts(64, 1, 1));
  REQUIRE(!bad.ok());
  auto msg = bad.err().to_string();
  CHECK(msg.find(p) != std::string::npos);
  CHECK(msg.find("holds 64 tokens, fewer than the 65") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("loader passes on shard errors and refuses bad options") {
  auto dir = scratch_dir("errors");
  { std::ofstream(dir / "junk.bin") << "not a shard at all"; }
  auto l = loader::open((dir / "junk.bin").string(), opts(8, 1, 1));
  REQUIRE(!l.ok());
  CHECK(l.err().to_string().find("not a token shard") != std::string::npos);

  auto p = counting_shard(dir / "a.bin", 0, 100);
  auto z = loader::open(p, opts(0, 1, 1));
  REQUIRE(!z.ok());
  CHECK(z.err().to_string().find("at least 1") != std::string::npos);

  auto ok = open_or_fail({p}, opts(8, 1, 2));
  CHECK_THROWS_AS(ok.cut(0, 0, 2), core::failure);
  CHECK_THROWS_AS(ok.cut(0, -1, 0), core::failure);
  fs::remove_all(dir);
}

TEST_CASE("resolve_shards takes a file, a folder's sorted *.bin files, or a glob") {
  auto dir = scratch_dir("resolve");
  counting_shard(dir / "b.bin", 0, 20);
  counting_shard(dir / "a.bin", 0, 20);
  { std::ofstream(dir / "readme.txt") << "x"; }
  auto folder = resolve_shards(dir.string());
  REQUIRE(folder.ok());
  CHECK(folder.value() ==
        std::vector<std::string>{(dir / "a.bin").string(), (dir / "b.bin").string()});
  auto pattern = resolve_shards((dir / "*.bin").string());
  REQUIRE(pattern.ok());
  CHECK(pattern.value() == folder.value());
  auto single = resolve_shards((dir / "b.bin").string());
  REQUIRE(single.ok());
  CHECK(single->size() == 1);
  CHECK(!resolve_shards((dir / "missing.bin").string()).ok());
  CHECK(!resolve_shards((dir / "*.none").string()).ok());
  CHECK(!resolve_shards("").ok());
  fs::remove_all(dir);
}

TEST_CASE("loader_options::from takes T, B, M and the seed from a config") {
  core::config c;
  c.model.seq_length = 128;
  c.parallel.micro_batch_size = 4;
  c.parallel.micro_batch_num = 3;
  c.train.gradient_accumulation_steps = 2;
  c.train.seed = 99;
  auto o = loader_options::from(c);
  CHECK(o.seq_length == 128);
  CHECK(o.micro_batch_size == 4);
  CHECK(o.micro_batches == 6);
  CHECK(o.seed == 99);
}

TEST_CASE("a token id not below vocab_size makes cut fail naming the id, its position and the shard") {
  auto dir = scratch_dir("vocab");
  // Tokens 100, 101, ...: with vocab_size 150 every window holding ids >= 150 is refused.
  const auto path = counting_shard(dir / "ids.bin", 100, 200);
  auto o = opts(8, 2, 1);
  o.vocab_size = 150;
  auto l = open_or_fail({path}, o);
  bool refused = false;
  for (std::uint64_t step = 0; step < 40 && !refused; ++step) {
    try {
      auto b = l.cut(step, 0, 0);
      for (auto v : values(b.tokens)) CHECK(v < 150);
      for (auto v : values(b.targets)) CHECK(v < 150);
    } catch (const core::failure& e) {
      refused = true;
      const std::string m = e.what();
      CHECK(m.find("is not below model.vocab_size 150") != std::string::npos);
      CHECK(m.find(path) != std::string::npos);
      CHECK(m.find("token id 1") != std::string::npos);
    }
  }
  CHECK(refused);
  o.vocab_size = 0;  // unchecked: the same cuts go through
  auto unchecked = open_or_fail({path}, o);
  for (std::uint64_t step = 0; step < 40; ++step) CHECK_NOTHROW(unchecked.cut(step, 0, 0));
  fs::remove_all(dir);
}

TEST_CASE("uint32 shards load like uint16 ones; ids past the vocabulary are still refused") {
  auto dir = scratch_dir("wide");
  // Tokens 128000 + j % 256: LLaMA-3's range, beyond what a uint16 shard holds.
  std::vector<std::uint32_t> t(600);
  for (std::size_t j = 0; j < t.size(); ++j) t[j] = 128000u + static_cast<std::uint32_t>(j % 256);
  const auto path = (dir / "wide.bin").string();
  REQUIRE(write_shard(path, std::span<const std::uint32_t>(t)).ok());
  auto o = opts(8, 2, 1);
  o.vocab_size = 128256;
  auto l = open_or_fail({path}, o);
  CHECK(l.tokens() == 600);
  for (std::uint64_t step = 0; step < 5; ++step) {
    auto b = l.cut(step, 0, 0);
    auto x = values(b.tokens), y = values(b.targets);
    for (int i = 0; i < 2; ++i) {
      const std::uint64_t w = l.window_of(step, static_cast<std::uint64_t>(i));
      for (int k = 0; k < 8; ++k) {
        CHECK(x[i * 8 + k] == static_cast<std::int32_t>(t[w + k]));
        CHECK(y[i * 8 + k] == static_cast<std::int32_t>(t[w + k + 1]));
      }
    }
  }
  // A uint16 shard and a uint32 shard mix in one loader.
  const auto narrow = counting_shard(dir / "narrow.bin", 100, 300);
  auto mixed = open_or_fail({narrow, path}, o);
  CHECK(mixed.tokens() == 900);

  o.vocab_size = 128128;  // ids 128128.. are now outside
  auto small = open_or_fail({path}, o);
  bool refused = false;
  for (std::uint64_t step = 0; step < 40 && !refused; ++step) {
    try {
      small.cut(step, 0, 0);
    } catch (const core::failure& e) {
      refused = true;
      CHECK(std::string(e.what()).find("is not below model.vocab_size 128128") != std::string::npos);
      CHECK(std::string(e.what()).find(path) != std::string::npos);
    }
  }
  CHECK(refused);
  fs::remove_all(dir);
}
