// `troupe report` on real runs, drawn by a real browser: two short `troupe train` runs of
// configs/tiny.toml's model and layout (1f1b and zb_h1) and a damaged copy of the first (a
// foreign line, a line cut mid-write, trace.json cut) are rendered into one page; headless
// Chromium runs its script, dumps the DOM and takes a screenshot. The page must load with no
// console output and no script error, and every plot must hold exactly the points the runs wrote:
// counted from the DOM's SVG paths, expected from metrics.jsonl, trace.json and the checkpoints
// read here independently.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using troupe::model::testing::scratch_dir;

namespace {

const std::string troupe_binary = TROUPE_BINARY_DIR "/troupe";
const std::string tiny_config = TROUPE_SOURCE_DIR "/configs/tiny.toml";

std::string slurp(const fs::path& p) { return troupe::model::testing::file_bytes(p.string()); }

int sh(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/// The Chromium binary (Debian's `chromium`; scripts/setup.sh installs it), or "".
std::string chromium() {
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"})
    if (sh(std::string("command -v ") + name + " >/dev/null 2>&1") == 0) return name;
  return "";
}

/// A short real run of configs/tiny.toml's model (with a 1024-token vocabulary, for speed) and
/// layout (pipeline 2 × data 2, as actors).
void train(const scratch_dir& tmp, const std::string& run, const std::string& schedule,
           const std::string& extra = "") {
  if (!fs::exists(tmp / "train.bin")) {
    troupe::model::testing::write_pattern_shard(tmp / "train.bin", 40000, 1024, 1);
    troupe::model::testing::write_pattern_shard(tmp / "val.bin", 8000, 1024, 2);
  }
  const std::string cmd =
      "'" + troupe_binary + "' train '" + tiny_config + "' --set data.train='" + (tmp / "train.bin") +
      "' --set data.val='" + (tmp / "val.bin") + "' --set data.tokenizer_dir='' --set runtime.run_dir='" +
      (tmp / run) + "' --set schedule.name=" + schedule + " --set model.vocab_size=1024" +
      " --set train.steps=4 --set train.warmup_steps=1 --set train.eval_interval=2"
      " --set train.eval_batches=1 --set checkpoint.interval=2 --set parallel.micro_batch_size=2"
      " --set runtime.threads=1 --set runtime.record=false " + extra + " > '" + (tmp / (run + ".out")) + "' 2>&1";
  const int rc = sh(cmd);
  if (rc != 0) MESSAGE(slurp(tmp / (run + ".out")));
  REQUIRE(rc == 0);
}

std::vector<json> metrics_lines(const fs::path& run) {
  std::ifstream in(run / "metrics.jsonl");
  std::vector<json> out;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(json::parse(l));
  return out;
}

/// Events trace.json holds for step `step` (the whole file parsed).
int trace_events(const fs::path& run, int step) {
  std::ifstream in(run / "trace.json");
  json t = json::parse(in);
  int n = 0;
  for (const auto& e : t["traceEvents"]) n += e["args"]["step"].get<int>() == step;
  return n;
}

int checkpoints(const fs::path& run) {
  int n = 0;
  for (auto& e : fs::directory_iterator(run / "checkpoints"))
    n += fs::exists(e.path() / "manifest.json");
  return n;
}

/// The attributes of every element `tag` in `dom` with class `cls`.
std::vector<std::map<std::string, std::string>> elements(const std::string& dom, const std::string& tag,
                                                         const std::string& cls) {
  std::vector<std::map<std::string, std::string>> out;
  static const std::regex attr("([a-zA-Z][a-zA-Z0-9-]*)=\"([^\"]*)\"");
  for (std::size_t at = dom.find("<" + tag + " "); at != std::string::npos;
       at = dom.find("<" + tag + " ", at + 1)) {
    const std::string text = dom.substr(at, dom.find('>', at) - at);
    std::map<std::string, std::string> a;
    for (std::sregex_iterator it(text.begin(), text.end(), attr), end; it != end; ++it)
      a[(*it)[1].str()] = (*it)[2].str();
    std::istringstream classes(a["class"]);
    for (std::string c; classes >> c;)
      if (c == cls) out.push_back(a);
  }
  return out;
}

/// Points of a path's d attribute: one per M or L command.
int points_of(const std::string& d) {
  int n = 0;
  for (char c : d) n += c == 'M' || c == 'L';
  return n;
}

/// Points drawn for (chart, run, series): the sum over its paths (-1 when there is none).
int drawn(const std::string& dom, const std::string& chart, int run, const std::string& series) {
  int n = -1;
  for (auto& p : elements(dom, "path", "series"))
    if (p["data-chart"] == chart && p["data-run"] == std::to_string(run) && p["data-series"] == series) {
      CHECK(std::to_string(points_of(p["d"])) == p["data-points"]);
      n = std::max(n, 0) + points_of(p["d"]);
    }
  return n;
}

int count(const std::string& dom, const std::string& tag, const std::string& cls,
          const std::map<std::string, std::string>& want) {
  int n = 0;
  for (auto& e : elements(dom, tag, cls)) {
    bool all = true;
    for (auto& [k, v] : want) all = all && e[k] == v;
    n += all;
  }
  return n;
}

struct browser_result {
  std::string dom, log;
};

/// Loads `page` (with `fragment`) in headless Chromium: the DOM after its scripts ran, and what
/// the browser logged (console messages appear as ":CONSOLE" lines). With `screenshot`, a PNG.
browser_result load(const scratch_dir& tmp, const std::string& browser, const fs::path& page,
                    const std::string& fragment, const std::string& screenshot = "") {
  const std::string base = browser + " --headless --disable-gpu --no-sandbox --hide-scrollbars"
                           " --user-data-dir='" + (tmp / "profile") + "' --enable-logging=stderr --v=0 ";
  const std::string url = "'file://" + fs::absolute(page).string() + fragment + "'";
  const int rc = sh("timeout 120 " + base + "--dump-dom " + url + " > '" + (tmp / "dom.html") +
                    "' 2> '" + (tmp / "browser.log") + "'");
  browser_result r{slurp(tmp / "dom.html"), slurp(tmp / "browser.log")};
  if (rc != 0) MESSAGE(r.log);
  REQUIRE(rc == 0);
  if (!screenshot.empty()) {
    REQUIRE(sh("timeout 120 " + base + "--window-size=1400,2600 --screenshot='" + screenshot + "' " +
               url + " > /dev/null 2>> '" + (tmp / "browser.log") + "'") == 0);
    r.log = slurp(tmp / "browser.log");
  }
  return r;
}

/// No console output, no script error, every chart drawn.
void require_clean(const browser_result& r) {
  for (std::istringstream in(r.log); !in.eof();) {
    std::string l;
    std::getline(in, l);
    CHECK_MESSAGE(l.find(":CONSOLE") == std::string::npos, l);
  }
  CHECK(r.dom.find("<div id=\"app\" data-state=\"ready\">") != std::string::npos);
  CHECK(r.dom.find("<pre id=\"errors\" hidden=\"\"></pre>") != std::string::npos);
}

}  // namespace

TEST_CASE("troupe report draws real runs in headless Chromium with every point the runs wrote") {
  const std::string browser = chromium();
  REQUIRE_MESSAGE(!browser.empty(), "chromium is not installed: scripts/setup.sh installs it");
  scratch_dir tmp("report_cli");
  train(tmp, "a", "1f1b", "--set runtime.report_interval=3");  // pages at steps 3 and 4 (the end)
  train(tmp, "b", "zb_h1");
  // runtime.report_interval: a's run left its page, the final one; b's (0) none.
  const std::string live = slurp(tmp.path / "a" / "report.html");
  CHECK(live.find("\"steps_done\":4") != std::string::npos);
  CHECK(!fs::exists(tmp.path / "b" / "report.html"));

  // c: run a as a run still being written would leave it, plus a line of another run.
  const fs::path a = tmp.path / "a", b = tmp.path / "b", c = tmp.path / "c";
  fs::create_directories(c);
  fs::copy_file(a / "config.toml", c / "config.toml");
  const std::vector<json> la = metrics_lines(a), lb = metrics_lines(b);
  REQUIRE(la.size() == 4);
  {
    std::ofstream m(c / "metrics.jsonl");
    m << slurp(a / "metrics.jsonl") << la[1].dump() << "\n" << la[3].dump().substr(0, 40);
  }
  const int last = la.back()["step"].get<int>();
  {
    // trace.json cut inside the last step's events: the page shows the step before it.
    const std::string trace = slurp(a / "trace.json");
    const std::size_t cut = trace.find("\"step\":" + std::to_string(last));
    REQUIRE(cut != std::string::npos);
    std::ofstream(c / "trace.json") << trace.substr(0, trace.rfind('\n', cut) + 20);
  }

  const fs::path page = tmp.path / "compare.html";
  REQUIRE(sh("'" + troupe_binary + "' report '" + a.string() + "' '" + b.string() + "' '" + c.string() +
             "' --out '" + page.string() + "' > '" + (tmp / "report.out") + "' 2>&1") == 0);
  CHECK(slurp(tmp / "report.out").find("wrote " + page.string()) != std::string::npos);
  // Self-contained: no address but SVG's namespace name, which is never fetched.
  std::string html = slurp(page);
  for (std::size_t at; (at = html.find("http://www.w3.org/2000/svg")) != std::string::npos;)
    html.erase(at, 26);
  CHECK(html.find("http") == std::string::npos);
  CHECK(html.find("src=") == std::string::npos);

  const fs::path shot = tmp.path / "compare.png";
  browser_result r = load(tmp, browser, page, "", shot.string());
  require_clean(r);
  const std::string png = slurp(shot);
  REQUIRE(png.size() > 20000);
  CHECK(png.substr(1, 3) == "PNG");

  const std::vector<std::vector<json>> lines = {la, lb, la};
  for (int k = 0; k < 3; ++k) {
    CAPTURE(k);
    const auto& l = lines[k];
    const int n = static_cast<int>(l.size());
    int val = 0;
    for (const auto& j : l) val += j.contains("val_loss");
    CHECK(drawn(r.dom, "loss", k, "train") == n);
    CHECK(drawn(r.dom, "loss", k, "validation") == val);
    CHECK(drawn(r.dom, "lr", k, "lr") == n);
    CHECK(drawn(r.dom, "grad_norm", k, "grad norm") == n);
    CHECK(drawn(r.dom, "tokens_per_s", k, "tokens/s") == n);
    CHECK(drawn(r.dom, "tflops", k, "model TFLOP/s") == n);
    CHECK(drawn(r.dom, "bubble", k, "measured") == n);
    CHECK(drawn(r.dom, "loss_scale", k, "loss scale") == -1);  // fp32: no dynamic loss scaling
    const int stages = static_cast<int>(l.front()["stages"].size());
    CHECK(stages == 4);
    const std::string run = std::to_string(k);
    CHECK(count(r.dom, "g", "bar-row", {{"data-chart", "stages"}, {"data-kind", "measured"}, {"data-run", run}}) == stages);
    CHECK(count(r.dom, "g", "bar-row", {{"data-chart", "stages"}, {"data-kind", "simulated"}, {"data-run", run}}) == 2);
    CHECK(count(r.dom, "g", "bar-row", {{"data-chart", "memory"}, {"data-run", run}}) == stages);
    CHECK(count(r.dom, "line", "mark", {{"data-chart", "loss"}, {"data-kind", "checkpoint"}, {"data-run", run}}) ==
          (k == 2 ? 0 : checkpoints(k == 0 ? a : b)));
  }
  CHECK(count(r.dom, "rect", "event", {{"data-run", "0"}}) == trace_events(a, last));
  CHECK(count(r.dom, "rect", "event", {{"data-run", "1"}}) == trace_events(b, lb.back()["step"].get<int>()));
  CHECK(count(r.dom, "rect", "event", {{"data-run", "2"}}) == trace_events(a, last - 1));
  CHECK(count(r.dom, "rect", "sim-event", {{"data-run", "0"}}) > 0);
  // The damaged run's notes, and the config difference of a and b.
  CHECK(r.dom.find("line 5: step 2 after step 4 (a line of another run") != std::string::npos);
  CHECK(r.dom.find("line 6 is incomplete (the run may still be writing it)") != std::string::npos);
  CHECK(r.dom.find("trace.json is not closed") != std::string::npos);
  CHECK(r.dom.find("<td>schedule.name</td><td>1f1b</td><td>zb_h1</td><td>1f1b</td>") != std::string::npos);

  // The wall-time axis (#x=time) draws the same points.
  browser_result t = load(tmp, browser, page, "#x=time");
  require_clean(t);
  // Seven plots over time; the loss scale's is empty (fp32), so six axes.
  CHECK(count(t.dom, "svg", "chart", {{"data-x", "time"}}) == 6);
  CHECK(count(t.dom, "svg", "chart", {{"data-x", "step"}}) == 0);
  for (int k = 0; k < 3; ++k) CHECK(drawn(t.dom, "loss", k, "train") == static_cast<int>(lines[k].size()));
}
