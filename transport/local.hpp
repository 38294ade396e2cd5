// The in-process transport: every rank of the job lives in this process and a tensor handle moves
// from sender to receiver without copying. A `local_hub` holds the tensors in flight; each rank
// gets an endpoint. Tensors that arrive before their recv wait in the hub (stashed, never dropped).
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "transport/transport.hpp"

namespace troupe::transport {

class local_hub {
 public:
  void put(int src, int dst, const tag& tg, tensor t);
  tensor take(int src, int dst, const tag& tg, std::chrono::milliseconds timeout);
  bool has(int src, int dst, const tag& tg);
  /// Tensors sent but not yet received (for end-of-job leak checks and hang reports).
  std::size_t in_flight();
  /// Every take() waiting now or later for a tensor that is not there throws at once, saying
  /// `why`: a job that failed ends without waiting out the receives of its blocked stages.
  void close(const std::string& why);

 private:
  using key = std::tuple<int, int, tag>;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<key, tensor> slots_;
  std::string closed_;  // why close() was called; "" while open
};

class local_transport final : public transport {
 public:
  local_transport(std::shared_ptr<local_hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}
  std::string name() const override { return "local"; }
  int rank() const override { return rank_; }
  void send(int dst, tensor t, const tag& tg) override;
  tensor recv(int src, const tag& tg, std::chrono::milliseconds timeout) override;
  bool ready(int src, const tag& tg) override;

 private:
  std::shared_ptr<local_hub> hub_;
  int rank_;
};

}  // namespace troupe::transport
