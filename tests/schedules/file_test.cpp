// Custom schedule files: hand-written ones validate, simulate and lower like built-ins; broken
// ones are rejected with the reason and the marked grid; the text form round-trips.
#include <doctest/doctest.h>

#include "schedules/lower.hpp"
#include "schedules/registry.hpp"
#include "schedules/schedule_file.hpp"
#include "schedules/simulate.hpp"
#include "schedules/validate.hpp"

using namespace troupe::schedules;

namespace {

const std::string configs = std::string(TROUPE_SOURCE_DIR) + "/configs/schedules/";
const std::string broken = std::string(TROUPE_SOURCE_DIR) + "/tests/schedules/files/";

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

schedule_options from_file() {
  schedule_options o;
  o.virtual_stages = 0;
  return o;
}

schedule loaded(const std::string& path) {
  auto s = make_schedule(path, 0, 0, from_file());
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.err().to_string()));
  return *s;
}

std::string rejected(const std::string& path) {
  auto s = make_schedule(path, 0, 0, from_file());
  REQUIRE_FALSE(s.ok());
  return s.err().to_string();
}

}  // namespace

TEST_CASE("a hand-written eager 1f1b file validates, simulates and beats 1f1b when transfers take time") {
  const schedule eager = loaded(configs + "eager_1f1b_p4_m8.txt");
  CHECK(eager.stages == 4);
  CHECK(eager.microbatches == 8);
  CHECK(eager.virtual_stages == 1);
  cost_model slow_links;
  slow_links.comm = 0.5;
  auto mine = simulate(eager, slow_links);
  auto builtin = simulate(make_schedule("1f1b", 4, 8, {}).value(), slow_links);
  REQUIRE(mine.ok());
  REQUIRE(builtin.ok());
  CHECK(mine->makespan == doctest::Approx(36));
  CHECK(builtin->makespan == doctest::Approx(41));
  CHECK(mine->ranks[0].peak_activations == 7);
  CHECK(validate(lower(eager)).ok());
}

TEST_CASE("PyTorch's compute-only CSV loads, idle cells skipped, and equals the built-in") {
  const schedule csv = loaded(configs + "1f1b_p2_m4_pytorch.csv");
  CHECK(csv.ranks == make_schedule("1f1b", 2, 4, {})->ranks);
}

TEST_CASE("a file written with its transfers is taken as written and runs") {
  const schedule s = loaded(configs + "1f1b_p2_m2_with_transfers.txt");
  CHECK(has_transfers(s));
  CHECK(simulate(s).ok());
  const schedule low = lower(s);
  CHECK(std::equal(s.ranks[0].begin(), s.ranks[0].end(), low.ranks[0].begin()));
  CHECK(validate(low).ok());
}

TEST_CASE("a file with a missing backward is rejected with the marked grid") {
  const auto e = rejected(broken + "missing_backward.txt");
  CHECK(has(e, "never backwarded"));
  CHECK(has(e, ">1F1<"));
}

TEST_CASE("a file with a send but no receive is rejected with the marked grid") {
  const auto e = rejected(broken + "send_without_receive.txt");
  CHECK(has(e, "a send without its receive"));
  CHECK(has(e, ">0SEND_F1->1<"));
}

TEST_CASE("a file whose ranks wait on each other is rejected as a deadlock with the cycle") {
  const auto e = rejected(broken + "deadlock_cycle.txt");
  CHECK(has(e, "deadlock"));
  CHECK(has(e, "cycle: rank 0 -> rank 1 -> rank 0"));
  CHECK(has(e, ">0B0<"));
  CHECK(has(e, ">1F1<"));
}

TEST_CASE("simulating the deadlocked file also names the waiting ranks") {
  auto s = load_schedule_file(broken + "deadlock_cycle.txt");
  REQUIRE(s.ok());
  auto sim = simulate(*s);
  REQUIRE_FALSE(sim.ok());
  CHECK(has(sim.err().message, "rank 1 is stuck at step 1: waits for 0F1 on rank 0"));
}

TEST_CASE("a bad token names file, line and column") {
  const auto e = rejected(broken + "bad_token.txt");
  CHECK(has(e, "bad_token.txt:4:13: cannot read instruction 'OF1'"));
}

TEST_CASE("a file whose p or m differs from the one asked for is rejected") {
  CHECK(has(make_schedule(configs + "eager_1f1b_p4_m8.txt", 2, 0, from_file()).err().message,
            "pipeline_stage p = 4, but 2 was asked for"));
  CHECK(has(make_schedule(configs + "eager_1f1b_p4_m8.txt", 4, 16, from_file()).err().message,
            "micro_batch_num m = 8, but 16 was asked for"));
  CHECK(make_schedule(configs + "eager_1f1b_p4_m8.txt", 4, 8, from_file()).ok());
}

TEST_CASE("rank labels must come in order") {
  auto s = parse_schedule_text("rank 1: 1F0 1B0\nrank 0: 0F0 0B0\n", "labels.txt", false);
  REQUIRE_FALSE(s.ok());
  CHECK(has(s.err().to_string(), "labels.txt:1:6: this line is labelled rank 1 but it is rank 0's line"));
}

TEST_CASE("lines without labels, commas and comments are accepted") {
  auto s = parse_schedule_text("# two ranks\n0F0, 0B0   # rank 0\n\n1F0 1B0\n", "plain", false);
  REQUIRE(s.ok());
  CHECK(s->stages == 2);
  CHECK(s->ranks[1] == std::vector<instruction>{{1, op_kind::F, 0}, {1, op_kind::B, 0}});
}

TEST_CASE("interleaved files infer v from the largest chunk") {
  auto s = parse_schedule_text("rank 0: 0F0 2F0 2B0 0B0\nrank 1: 1F0 3F0 3B0 1B0\n", "v2", false);
  REQUIRE(s.ok());
  CHECK(s->virtual_stages == 2);
  CHECK(validate(*s).ok());
}

TEST_CASE("transfers written without peers get them from the chunk layout") {
  auto s = parse_schedule_text("rank 0: 0F0 0SEND_F0\nrank 1: 1RECV_F0\n", "peers", false);
  REQUIRE(s.ok());
  CHECK(s->ranks[0][1].peer == 1);
  CHECK(s->ranks[1][0].peer == 0);
}

TEST_CASE("the text form of every built-in, lowered or not, reads back unchanged") {
  for (auto name : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"}) {
    schedule_options o;
    o.virtual_stages = std::string(name) == "interleaved_1f1b" || std::string(name) == "zb_v" ? 2 : 1;
    const schedule s = make_schedule(name, 4, 8, o).value();
    for (const schedule& form : {s, lower(s)}) {
      auto back = parse_schedule_text(format_schedule_text(form), "round-trip", false);
      REQUIRE(back.ok());
      CHECK(back->ranks == form.ranks);
      CHECK(back->stages == form.stages);
      CHECK(back->microbatches == form.microbatches);
      CHECK(back->virtual_stages == form.virtual_stages);
      CHECK(back->place == form.place);
    }
  }
}

TEST_CASE("an empty file is rejected") {
  auto s = parse_schedule_text("# nothing\n\n", "empty.txt", false);
  REQUIRE_FALSE(s.ok());
  CHECK(has(s.err().to_string(), "empty.txt: the file holds no instructions"));
}
