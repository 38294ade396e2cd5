// A check shared by the CPU and GPU trainer tests: a NaN written into one weight makes the next
// step's loss NaN; that step must fail naming the step and micro-batch, with every parameter and
// AdamW moment as it was before it (the device-side guard skips AdamW before the host sees the loss).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "model/trainer.hpp"

namespace troupe::model::testing {

inline void check_poisoned_step(trainer& t, kernels::backend& be, int step) {
  chunk& c = t.chunks().front();
  const std::string name = c.params().front().name;
  tensor nan1 = tensor::zeros({1});
  nan1.data<float>()[0] = std::nanf("");
  tensor w = c.param(name).slice(0, {1});
  be.copy(nan1, w);
  c.params_updated();
  std::vector<tensor> before;
  for (chunk& k : t.chunks()) {
    before.push_back(be.to_host(k.flat_params()));
  }
  auto r = t.train_step(step);
  REQUIRE_FALSE(r.ok());
  CHECK(r.err().message.find("at step " + std::to_string(step) + ", micro-batch 0") !=
        std::string::npos);
  CHECK(r.err().hint.find("not updated") != std::string::npos);
  std::size_t i = 0;
  for (chunk& k : t.chunks()) {
    const tensor now = be.to_host(k.flat_params());
    const tensor& was = before[i++];
    REQUIRE(now.bytes() == was.bytes());
    // Bytes, not values: the poisoned NaN compares unequal to itself.
    CHECK(std::memcmp(now.raw(), was.raw(), now.bytes()) == 0);
  }
}

}  // namespace troupe::model::testing
