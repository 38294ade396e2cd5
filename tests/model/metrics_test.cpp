#include "model/metrics.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/rng.hpp"

namespace {

namespace fs = std::filesystem;
using troupe::model::step_metrics;

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

}  // namespace

TEST_CASE("metrics lines are JSON whose floats read back to the same bits") {
  troupe::core::rng_stream rng(troupe::core::stream_key(7, 1));
  for (int i = 0; i < 2000; ++i) {
    step_metrics m;
    m.step = i;
    // Random bit patterns cover every exponent; non-finite ones are tested separately.
    auto any_float = [&] {
      float f;
      do f = std::bit_cast<float>(static_cast<std::uint32_t>(rng.next_u64()));
      while (!std::isfinite(f));
      return f;
    };
    m.loss = any_float();
    m.lr = any_float();
    m.grad_norm = any_float();
    m.tokens_per_s = any_float();
    m.elapsed_s = any_float();
    if (i % 2) m.val_loss = any_float();
    const std::string line = troupe::model::to_json_line(m);
    CHECK(nlohmann::json::accept(line));
    auto back = troupe::model::parse_json_line(line);
    REQUIRE(back.ok());
    CHECK(back->step == i);
    CHECK(std::bit_cast<std::uint32_t>(back->loss) == std::bit_cast<std::uint32_t>(m.loss));
    CHECK(std::bit_cast<std::uint32_t>(back->lr) == std::bit_cast<std::uint32_t>(m.lr));
    CHECK(std::bit_cast<std::uint32_t>(back->grad_norm) == std::bit_cast<std::uint32_t>(m.grad_norm));
    CHECK(std::bit_cast<std::uint32_t>(back->elapsed_s) == std::bit_cast<std::uint32_t>(m.elapsed_s));
    REQUIRE(back->val_loss.has_value() == m.val_loss.has_value());
    if (m.val_loss)
      CHECK(std::bit_cast<std::uint32_t>(*back->val_loss) == std::bit_cast<std::uint32_t>(*m.val_loss));
  }
}

TEST_CASE("a non-finite loss is written as null and reads back as NaN") {
  step_metrics m;
  m.loss = std::nanf("");
  m.grad_norm = INFINITY;
  const std::string line = troupe::model::to_json_line(m);
  CHECK(line.find("\"loss\":null") != std::string::npos);
  auto back = troupe::model::parse_json_line(line);
  REQUIRE(back.ok());
  CHECK(std::isnan(back->loss));
  CHECK_FALSE(troupe::model::parse_json_line("{\"step\":1}").ok());
}

TEST_CASE("the progress line shows step, loss, lr, norm, throughput, elapsed time and ETA") {
  step_metrics m;
  m.step = 2;
  m.loss = 7.25f;
  m.lr = 3e-4f;
  m.grad_norm = 1.5f;
  m.tokens_per_s = 1350.4f;
  m.elapsed_s = 72;
  std::string line = troupe::model::progress_line(m, 300, 3725);
  CHECK(line == "step   3/300 | loss 7.2500 | lr 3.00e-04 | norm 1.500 | 1350 tok/s | 1:12 | ETA 1:02:05");
  m.val_loss = 6.5f;
  CHECK(troupe::model::progress_line(m, 300, -1).find("| 1:12 | val 6.5000") != std::string::npos);
}

TEST_CASE("a resumed run's metrics writer keeps the earlier steps and drops the repeated ones") {
  const fs::path dir = fs::temp_directory_path() / ("troupe_metrics_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    auto w = troupe::model::metrics_writer::open(dir.string(), 0);
    REQUIRE(w.ok());
    for (int s = 0; s < 4; ++s) {
      step_metrics m;
      m.step = s;
      m.loss = 10.0f - s;
      REQUIRE(w->write(m).ok());
    }
  }
  const std::string path = (dir / "metrics.jsonl").string();
  REQUIRE(lines_of(path).size() == 4);
  {
    auto w = troupe::model::metrics_writer::open(dir.string(), 2);
    REQUIRE(w.ok());
    step_metrics m;
    m.step = 2;
    m.loss = 1.0f;
    REQUIRE(w->write(m).ok());
  }
  auto lines = lines_of(path);
  REQUIRE(lines.size() == 3);
  CHECK(troupe::model::parse_json_line(lines[1])->loss == 9.0f);
  CHECK(troupe::model::parse_json_line(lines[2])->loss == 1.0f);
  {
    auto w = troupe::model::metrics_writer::open(dir.string(), 0);  // a fresh run starts over
    REQUIRE(w.ok());
  }
  CHECK(lines_of(path).empty());
  fs::remove_all(dir);
}
