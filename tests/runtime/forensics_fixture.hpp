// What the step-forensics tests share (tests/runtime/forensics_test.cpp on the CPU,
// tests/runtime/cuda_runtime_test.cpp on the GPU): a TROUPE_FAULT spec from its text, and the
// forensics records a run wrote to its metrics.
#pragma once

#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/fault.hpp"

namespace troupe::runtime_test {

/// The fault TROUPE_FAULT=`text` would inject; the test fails when the text does not parse.
inline core::fault_spec fault(const std::string& text) {
  auto f = core::parse_fault(text, "TROUPE_FAULT");
  REQUIRE(f.ok());
  return f.value();
}

/// The "forensics" objects of <run_dir>/metrics.jsonl, in order.
inline std::vector<nlohmann::json> forensics_records(const core::config& cfg) {
  std::vector<nlohmann::json> out;
  std::ifstream in(cfg.runtime.run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("forensics")) out.push_back(j["forensics"]);
  }
  return out;
}

}  // namespace troupe::runtime_test
