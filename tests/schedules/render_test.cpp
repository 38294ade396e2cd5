// Pictures: the SVG has a row per rank, a box per instruction with its micro-batch, hatched idle
// time; the Chrome trace is valid JSON with one event per instruction at the simulated times.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "schedules/registry.hpp"
#include "schedules/render.hpp"

using namespace troupe::schedules;

namespace {

std::size_t count(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (auto pos = text.find(part); pos != std::string::npos; pos = text.find(part, pos + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("the SVG draws one row per rank and one labelled box per instruction") {
  const schedule s = make_schedule("1f1b", 4, 8, {}).value();
  const simulation sim = simulate(s).value();
  const std::string svg = render_svg(s, sim, "costs F=1 B=2");
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("</svg>") != std::string::npos);
  for (int r = 0; r < 4; ++r) CHECK(count(svg, ">rank " + std::to_string(r) + "<") == 1);
  CHECK(count(svg, "<title>") == size(s));
  CHECK(count(svg, "<title>2B5 ") == 1);
  CHECK(count(svg, "fill=\"url(#idle)\"") == 4 + 1);  // each row's background, and the legend
  CHECK(svg.find("costs F=1 B=2") != std::string::npos);
  CHECK(svg.find("bubble 27.3%") != std::string::npos);
}

TEST_CASE("the SVG escapes names that are not XML") {
  schedule s = make_schedule("gpipe", 1, 1, {}).value();
  s.name = "a<b&c";
  const std::string svg = render_svg(s, simulate(s).value());
  CHECK(svg.find("a&lt;b&amp;c") != std::string::npos);
  CHECK(svg.find("a<b") == std::string::npos);
}

TEST_CASE("the Chrome trace has one complete event per instruction at the simulated times") {
  schedule_options o;
  o.virtual_stages = 2;
  const schedule s = make_schedule("interleaved_1f1b", 2, 4, o).value();
  const simulation sim = simulate(s).value();
  const auto trace = nlohmann::json::parse(render_trace(s, sim));
  std::size_t events = 0;
  for (auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ++events;
    const int r = e["tid"];
    const auto& t = *std::find_if(sim.timeline[r].begin(), sim.timeline[r].end(),
                                  [&](const timed_instruction& x) { return to_string(x.op) == e["name"]; });
    CHECK(e["ts"].get<double>() == doctest::Approx(t.start * 1000));
    CHECK(e["dur"].get<double>() == doctest::Approx((t.end - t.start) * 1000));
  }
  CHECK(events == size(s));
  CHECK(trace["otherData"]["makespan"].get<double>() == doctest::Approx(sim.makespan));
}
