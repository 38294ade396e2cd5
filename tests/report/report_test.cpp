// report/: reading run directories with damaged or foreign input, downsampling with the extremes
// kept, the simulator's prediction from a trace, config differences, and the page's embedding.
// The run directories here are written by hand; tests/cli/report_cli_test.cpp draws a real run in
// a browser.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config.hpp"
#include "report/live.hpp"
#include "report/page.hpp"
#include "report/run.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace troupe;

namespace {

struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& tag) {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("troupe_report_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
};

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

std::string line(int step, double loss, double elapsed, const std::string& extra = "") {
  return "{\"step\":" + std::to_string(step) + ",\"loss\":" + std::to_string(loss) +
         ",\"lr\":0.001,\"grad_norm\":1.5,\"tokens_per_s\":1000,\"elapsed_s\":" +
         std::to_string(elapsed) + extra + "}\n";
}

// A valid config.toml for a pp × dp layout with `schedule`.
std::string config_toml(const std::string& schedule, int pp, int steps = 100) {
  core::config c;
  c.model.num_layers = 4;
  c.model.hidden_size = 32;
  c.model.num_heads = 4;
  c.model.seq_length = 16;
  c.model.vocab_size = 64;
  c.parallel.pipeline_stage = pp;
  c.parallel.micro_batch_num = 4;
  c.parallel.micro_batch_size = 2;
  c.schedule.name = schedule;
  c.train.steps = steps;
  c.data.train = "train.bin";
  return core::to_toml(c);
}

json page_of(const std::vector<report::run_data>& runs, report::page_options o = {}) {
  return json::parse(report::page_json(runs, o));
}

bool has_note(const report::run_data& r, const std::string& part) {
  return std::any_of(r.notes.begin(), r.notes.end(),
                     [&](const std::string& n) { return n.find(part) != std::string::npos; });
}

}  // namespace

TEST_CASE("a truncated last line and lines of another run are skipped and named; the rest is read") {
  temp_dir t("damaged");
  write(t.path / "config.toml", config_toml("1f1b", 1, 10));
  std::string text = line(0, 5.0, 1.0) + line(1, 4.5, 2.0) + line(0, 9.9, 0.5) +  // another run
                     line(2, 4.0, 3.0) + line(57, 3.0, 4.0) +  // beyond train.steps = 10
                     "not json at all\n" + line(3, 3.5, 4.0);
  text += "{\"step\":4,\"loss\":3.4,\"lr\":0.0";  // being written
  write(t.path / "metrics.jsonl", text);
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  const auto& run = r.value();
  REQUIRE(run.rows.size() == 4);
  CHECK(run.rows[0].step == 0);
  CHECK(run.rows[3].step == 3);
  CHECK(run.rows[3].line == 7);
  CHECK(has_note(run, "line 3: step 1 after step 2 (a line of another run"));
  CHECK(has_note(run, "line 5: step 58 is beyond config.toml's train.steps = 10"));
  CHECK(has_note(run, "line 6 is not a JSON object"));
  CHECK(has_note(run, "line 8 is incomplete (the run may still be writing it)"));
  // The page still has every accepted row.
  json page = page_of({run});
  CHECK(page["runs"][0]["series"]["loss"]["v"].size() == 4);
  CHECK(page["runs"][0]["notes"].size() == run.notes.size());
}

TEST_CASE("a directory without metrics.jsonl or config.toml still renders, saying what is missing") {
  temp_dir t("empty");
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  CHECK(r->rows.empty());
  CHECK(has_note(r.value(), "no metrics.jsonl"));
  write(t.path / "metrics.jsonl", "");
  CHECK(has_note(report::read_run(t.path.string()).value(), "metrics.jsonl has no lines yet"));
  CHECK(has_note(r.value(), "no config.toml"));
  const std::string html = report::render_page({r.value()});
  CHECK(html.find("<div id=\"app\"") != std::string::npos);
  CHECK(html.find("{{") == std::string::npos);  // every placeholder filled
  json page = page_of({r.value()});
  CHECK(page["runs"][0]["rows"] == 0);
  CHECK(page["runs"][0]["summary"]["steps_done"] == 0);
  CHECK(page["runs"][0]["prediction"].is_null());

  auto missing = report::read_run((t.path / "nope").string());
  REQUIRE(!missing.ok());
  CHECK(missing.err().to_string().find("not a run directory") != std::string::npos);
}

TEST_CASE("a resumed run's clock is joined to the earlier invocation's and the restart is marked") {
  temp_dir t("restart");
  write(t.path / "metrics.jsonl", line(0, 5, 10) + line(1, 4, 20) + line(2, 3.9, 4) + line(3, 3.8, 8));
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  REQUIRE(r->rows.size() == 4);
  CHECK(r->rows[2].time_s == doctest::Approx(24));
  CHECK(r->rows[3].time_s == doctest::Approx(28));
  REQUIRE(r->marks.size() == 1);
  CHECK(r->marks[0].kind == "restart");
  CHECK(r->marks[0].step == 2);
}

TEST_CASE("checkpoints, skipped steps and logged worker errors become marks") {
  temp_dir t("marks");
  write(t.path / "metrics.jsonl",
        line(0, 5, 1, ",\"loss_scale\":65536,\"skipped\":false") +
            line(1, 5, 2, ",\"loss_scale\":65536,\"skipped\":true") +
            line(2, 5, 3, ",\"loss_scale\":32768,\"skipped\":false"));
  write(t.path / "checkpoints" / "step_000002" / "manifest.json", "{}");
  fs::create_directories(t.path / "checkpoints" / "step_000003.tmp");  // not a checkpoint
  fs::create_directories(t.path / "checkpoints" / "step_000004");      // no manifest yet
  write(t.path / "logs" / "worker_0.log",
        "step 1/3 | loss 5\ntroupe: error: rank 0: no progress for 63 s at step 2; who waits on whom:\n"
        "    stage(dp=0, pp=0) (rank 0) step 2 at 0RECV_B3<-1: waiting\n  hint: check\nlater\n");
  write(t.path / "logs" / "worker_1.log",
        "troupe: error: rank 1: no progress for 63 s at step 2; who waits on whom:\n"
        "    stage(dp=0, pp=0) (rank 0) step 2 at 0RECV_B3<-1: waiting\n  hint: check\n");
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  std::map<std::string, std::vector<int>> by_kind;
  for (const auto& m : r->marks) by_kind[m.kind].push_back(m.step);
  CHECK(by_kind["checkpoint"] == std::vector<int>{2});
  CHECK(by_kind["skipped"] == std::vector<int>{2});
  CHECK(by_kind["fault"] == std::vector<int>{2});  // the same error from two workers, once
  for (const auto& m : r->marks)
    if (m.kind == "fault")
      CHECK(m.label == "worker_0.log: rank 0: no progress for 63 s at step 2; who waits on whom: / "
                       "stage(dp=0, pp=0) (rank 0) step 2 at 0RECV_B3<-1: waiting / hint: check");
  json page = page_of({r.value()});
  CHECK(page["runs"][0]["series"]["loss_scale"]["v"] == json::array({65536, 65536, 32768}));
}

TEST_CASE("a long run is downsampled keeping each bucket's minimum and maximum") {
  temp_dir t("long");
  const int n = 100000;
  {
    std::ofstream out(t.path / "metrics.jsonl");
    for (int i = 0; i < n; ++i) {
      double loss = 10.0 - i * 1e-4;
      if (i == 31337) loss = 99;     // a spike
      if (i == 77777) loss = -1;     // a dip
      out << line(i, loss, i * 0.01);
    }
  }
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  REQUIRE(r->rows.size() == n);
  report::page_options o;
  o.max_points = 2000;
  json run = page_of({r.value()}, o)["runs"][0];
  const json& loss = run["series"]["loss"];
  CHECK(loss["v"].size() <= 2000);
  CHECK(loss["v"].size() >= 1000);
  CHECK(run["downsampled"] == 1000);
  const auto& v = loss["v"];
  CHECK(*std::max_element(v.begin(), v.end()) == 99);
  CHECK(*std::min_element(v.begin(), v.end()) == -1);
  const auto& i = loss["i"];
  CHECK(std::is_sorted(i.begin(), i.end()));
  CHECK(std::find(i.begin(), i.end(), 31337) != i.end());
  // Short series are drawn whole.
  o.max_points = 4000;
  temp_dir s("short");
  write(s.path / "metrics.jsonl", line(0, 3, 1) + line(1, 2, 2) + line(2, 1, 3));
  auto short_run = report::read_run(s.path.string());
  CHECK(page_of({short_run.value()}, o)["runs"][0]["series"]["loss"]["i"] == json::array({0, 1, 2}));
}

TEST_CASE("the trace's last complete step is read from the file's end, an unclosed trace noted") {
  temp_dir t("trace");
  std::string text = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  auto event = [](int step, const std::string& name, int pp, double ts, double dur) {
    return "\n{\"args\":{\"step\":" + std::to_string(step) + "},\"cat\":\"compute\",\"dur\":" +
           std::to_string(dur) + ",\"name\":\"" + name + "\",\"ph\":\"X\",\"pid\":0,\"tid\":" +
           std::to_string(pp) + ",\"ts\":" + std::to_string(ts) + "},";
  };
  for (int s = 0; s < 3; ++s)
    for (int k = 0; k < 4; ++k) text += event(s, "0F" + std::to_string(k), 0, s * 1000 + k * 10, 5);
  text += event(3, "0F0", 0, 3000, 5);  // a step metrics.jsonl does not have yet
  write(t.path / "trace.json", text);
  std::vector<std::string> notes;
  auto [step, events] = report::read_trace_tail((t.path / "trace.json").string(), 2, notes);
  CHECK(step == 2);
  REQUIRE(events.size() == 4);
  CHECK(events[0].name == "0F0");
  CHECK(events[3].ts_us == doctest::Approx(2030));
  CHECK(std::any_of(notes.begin(), notes.end(),
                    [](auto& n) { return n.find("trace.json is not closed") != std::string::npos; }));
}

TEST_CASE("the simulator predicts the bubble from the traced step's durations") {
  // A 2-stage 1F1B step over 4 micro-batches with F = 1 ms and B = 2 ms, no transfers: the
  // simulator's bubble is (p - 1) / (m + p - 1) = 1/5.
  temp_dir t("sim");
  write(t.path / "config.toml", config_toml("1f1b", 2));
  std::string trace = "{\"traceEvents\":[";
  for (int pp = 0; pp < 2; ++pp)
    for (int mb = 0; mb < 4; ++mb) {
      for (auto [k, dur] : {std::pair{'F', 1000.0}, {'B', 2000.0}})
        trace += "\n{\"args\":{\"step\":0},\"cat\":\"compute\",\"dur\":" + std::to_string(dur) +
                 ",\"name\":\"" + std::to_string(pp) + k + std::to_string(mb) +
                 "\",\"ph\":\"X\",\"pid\":0,\"tid\":" + std::to_string(pp) + ",\"ts\":0},";
    }
  trace.pop_back();
  trace += "\n]}\n";
  write(t.path / "trace.json", trace);
  write(t.path / "metrics.jsonl", line(0, 5, 1, ",\"bubble\":0.25,\"stages\":[{\"dp\":0,\"pp\":0,"
                                                "\"busy_s\":0.012,\"comm_s\":0,\"wait_s\":0.003,"
                                                "\"bubble\":0.2,\"peak_activation_bytes\":1024}]"));
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  CHECK(r->notes.empty());
  json run = page_of({r.value()})["runs"][0];
  REQUIRE(run["prediction"].is_object());
  CHECK(run["prediction"]["bubble"].get<double>() == doctest::Approx(0.2));
  CHECK(run["prediction"]["costs"]["F"].get<double>() == doctest::Approx(0.001));
  CHECK(run["prediction"]["timeline"].size() == 2);
  CHECK(run["timeline"]["events"] == 16);
  CHECK(run["stages"].size() == 1);
  CHECK(run["stages"][0]["peak_activation_bytes"] == 1024);
}

TEST_CASE("a GPU run's bubble is its device bubble, predicted from each chunk's device costs") {
  // 2-stage 1F1B over 4 micro-batches, chunk 0 F 1 ms B 2 ms, chunk 1 F 3 ms B 6 ms (the medians
  // after two warm-up steps). Rank 1: F0 [1, 4], B0 [4, 10], F1 [10, 13], B1 [13, 19], F2 [19,
  // 22], B2 [22, 28], F3 [28, 31], B3 [31, 37]; rank 0 ends with B3 [37, 39]. Compute 12 + 36 ms
  // in 2 × 39.
  temp_dir t("gpu");
  write(t.path / "config.toml", config_toml("1f1b", 2));
  std::string metrics;
  for (int step = 0; step < 5; ++step) {
    const bool warm = step < 2;
    metrics += line(step, 5, step + 1,
                    ",\"bubble\":0.7,\"device_bubble\":0.4,\"device_span_s\":0.04,"
                    "\"device_costs\":{\"f\":" + std::string(warm ? "[9,9]" : "[1,3]") +
                        ",\"b\":" + (warm ? "[9,9]" : "[2,6]") +
                        "},\"stages\":[{\"dp\":0,\"pp\":0,\"busy_s\":0.01,\"comm_s\":0,"
                        "\"wait_s\":0.03,\"bubble\":0.75,\"device_busy_s\":0.012,"
                        "\"device_bubble\":0.7},{\"dp\":0,\"pp\":1,\"busy_s\":0.03,"
                        "\"comm_s\":0,\"wait_s\":0.01,\"bubble\":0.25,"
                        "\"device_busy_s\":0.036,\"device_bubble\":0.1}]");
  }
  write(t.path / "metrics.jsonl", metrics);
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  REQUIRE(r->chunk_costs.size() == 2);
  CHECK(r->chunk_costs[1].f == doctest::Approx(3));
  CHECK(r->chunk_costs[1].i == doctest::Approx(3));  // half of B: 1f1b measured no split
  json run = page_of({r.value()})["runs"][0];
  REQUIRE(run["prediction"].is_object());
  CHECK(run["prediction"]["makespan_s"].get<double>() == doctest::Approx(0.039));
  CHECK(run["prediction"]["bubble"].get<double>() == doctest::Approx(1 - 48.0 / 78));
  CHECK(run["prediction"]["costs"]["chunks"][1]["B"].get<double>() == doctest::Approx(0.006));
  CHECK(run["summary"]["bubble_source"] == "device");
  CHECK(run["summary"]["median_bubble"].get<double>() == doctest::Approx(0.4));
  REQUIRE(run["stages"].size() == 2);
  CHECK(run["stages"][1]["device_busy_s"].get<double>() == doctest::Approx(0.036));
  CHECK(run["stages"][1]["device_idle_s"].get<double>() == doctest::Approx(0.004));
  CHECK(run["stages"][0]["device_bubble"].get<double>() == doctest::Approx(0.7));
}

TEST_CASE("several runs list exactly the config keys that differ") {
  temp_dir a("cfg_a"), b("cfg_b");
  write(a.path / "config.toml", config_toml("1f1b", 2));
  write(b.path / "config.toml", config_toml("zb_h1", 2));
  auto ra = report::read_run(a.path.string()), rb = report::read_run(b.path.string());
  REQUIRE(ra.ok());
  REQUIRE(rb.ok());
  json diff = page_of({ra.value(), rb.value()})["config_diff"];
  REQUIRE(diff.size() == 1);
  CHECK(diff[0]["key"] == "schedule.name");
  CHECK(diff[0]["values"] == json::array({"1f1b", "zb_h1"}));
}

TEST_CASE("text from the run cannot end the page's data block") {
  temp_dir t("script");
  write(t.path / "metrics.jsonl", "</script><script>document.title = 'injected'</script>\n");
  auto r = report::read_run(t.path.string());
  REQUIRE(r.ok());
  const std::string html = report::render_page({r.value()});
  const auto data = html.find("id=\"troupe-data\"");
  REQUIRE(data != std::string::npos);
  // The first </script> after the data block's start closes it: the JSON before it is whole.
  const auto json_start = html.find('>', data) + 1;
  const auto end = html.find("</script>", data);
  json page = json::parse(html.substr(json_start, end - json_start));
  CHECK(page["runs"][0]["notes"].dump().find("</script><script>") != std::string::npos);
}

TEST_CASE("the live report rewrites report.html every interval steps and once at the end") {
  temp_dir t("live");
  write(t.path / "metrics.jsonl", line(0, 5, 1));
  report::live_report live(t.path.string(), 2);
  const fs::path page = report::live_report_path(t.path.string());
  REQUIRE(live.step_end(1).ok());
  CHECK(!fs::exists(page));
  REQUIRE(live.step_end(2).ok());
  REQUIRE(fs::exists(page));
  fs::remove(page);
  REQUIRE(live.finish().ok());  // nothing ran since the last page
  CHECK(!fs::exists(page));
  REQUIRE(live.step_end(3).ok());
  REQUIRE(live.finish().ok());
  CHECK(fs::exists(page));
  // No temporary file is left beside it.
  int files = 0;
  for (auto& e : fs::directory_iterator(t.path)) files += e.path().filename().string()[0] == '.';
  CHECK(files == 0);
  report::live_report off(t.path.string(), 0);
  fs::remove(page);
  REQUIRE(off.step_end(2).ok());
  REQUIRE(off.finish().ok());
  CHECK(!fs::exists(page));
}
