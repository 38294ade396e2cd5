// Test helper shared by the tcp and rendezvous tests: collects log lines written by IO threads.
#pragma once

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace troupe::transport::testing {

using namespace std::chrono_literals;

// Collects the transports' log lines so tests can check what was refused and why.
struct log_sink {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& l) {
      std::lock_guard<std::mutex> lk(mu);
      lines.push_back(l);
    };
  }
  bool has(const std::string& part) {
    std::lock_guard<std::mutex> lk(mu);
    for (auto& l : lines)
      if (l.find(part) != std::string::npos) return true;
    return false;
  }
  // Log lines arrive from the IO thread; give it a moment (bounded) to write them.
  bool eventually_has(const std::string& part) {
    for (int i = 0; i < 400; ++i) {
      if (has(part)) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }
  std::string all() {
    std::lock_guard<std::mutex> lk(mu);
    std::string s;
    for (auto& l : lines) s += l + "\n";
    return s;
  }
};

}  // namespace troupe::transport::testing
