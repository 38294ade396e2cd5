// `troupe schedule simulate --costs-from`: the per-chunk costs a GPU run wrote to metrics.jsonl
// (`device_costs`) drive the simulator: the median of each over the steps after the first two,
// B from I + W (or I and W from B) where only one was measured; a file without them, or costs for
// another number of chunks, is refused naming why.
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/cli/cli_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

using troupe::model::testing::scratch_dir;
using namespace troupe::cli_test;

TEST_CASE("troupe schedule simulate --costs-from takes each chunk's measured costs") {
  scratch_dir tmp("schedule_cli_costs_from");
  const std::string metrics = tmp / "metrics.jsonl";
  {
    std::ofstream out(metrics);
    // Two warm-up steps (ignored), a line without costs, then three steps: chunk 0 F 1 B 2,
    // chunk 1 F 3 B 6 as medians (each kind has one outlier).
    out << R"({"step":1,"device_costs":{"f":[50,50],"b":[50,50]}})" "\n"
        << R"({"step":2,"device_costs":{"f":[50,50],"b":[50,50]}})" "\n"
        << R"({"step":2,"val_loss":3.5})" "\n"
        << R"({"step":3,"device_costs":{"f":[1,3],"b":[2,6]}})" "\n"
        << R"({"step":4,"device_costs":{"f":[9,3],"b":[2,0.5]}})" "\n"
        << R"({"step":5,"device_costs":{"f":[1,7],"b":[7,6]}})" "\n";
  }
  // 1f1b, p = 2, m = 2 with these costs: makespan 21, compute 6 and 18 (tests/schedules).
  const std::string from = " --json --costs-from '" + metrics + "'";
  const run_result r = run_troupe(tmp.path, "schedule simulate -s 1f1b -p 2 -m 2" + from);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("makespan").get<double>() == doctest::Approx(21));
  CHECK(j.at("bubble").get<double>() == doctest::Approx(1 - 24.0 / 42));
  REQUIRE(j.at("costs").at("chunks").size() == 2);
  CHECK(j.at("costs").at("chunks")[1].at("b").get<double>() == doctest::Approx(6));
  CHECK(j.at("costs").at("chunks")[1].at("i").get<double>() == doctest::Approx(3));

  // zb_h1 on the same costs: the split backward takes half of each chunk's B for I and for W.
  const run_result zb = run_troupe(tmp.path, "schedule simulate -s zb_h1 -p 2 -m 2" + from);
  REQUIRE_MESSAGE(zb.code == 0, zb.err);
  const auto z = nlohmann::json::parse(zb.out);
  CHECK(z.at("ranks")[1].at("compute").get<double>() == doctest::Approx(2 * (3 + 6)));

  const run_result other =
      run_troupe(tmp.path, "schedule simulate -s 1f1b -p 3 -m 2 --costs-from '" + metrics + "'");
  CHECK(other.code == 1);
  CHECK_MESSAGE(contains(other.err, "the costs name 2 chunks, schedule '1f1b' has 3"), other.err);

  const std::string empty = tmp / "empty.jsonl";
  std::ofstream(empty) << R"({"step":1,"loss":4.0})" "\n";
  const run_result none =
      run_troupe(tmp.path, "schedule simulate -s 1f1b -p 2 -m 2 --costs-from '" + empty + "'");
  CHECK(none.code == 1);
  CHECK_MESSAGE(contains(none.err, "no line has device_costs"), none.err);
}
