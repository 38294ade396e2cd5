// Costs as written on the command line.
#include <doctest/doctest.h>

#include "schedules/costs.hpp"

using namespace troupe::schedules;

TEST_CASE("F,B,W,comm sets I to B - W") {
  auto c = parse_costs("1,3,1,0.5");
  REQUIRE(c.ok());
  CHECK(c->f == 1);
  CHECK(c->b == 3);
  CHECK(c->w == 1);
  CHECK(c->i == 2);
  CHECK(c->comm == 0.5);
}

TEST_CASE("F,B alone splits B evenly into I and W") {
  auto c = parse_costs("2,4");
  REQUIRE(c.ok());
  CHECK(c->i == 2);
  CHECK(c->w == 2);
  CHECK(c->comm == 0);
}

TEST_CASE("named costs fill in what they leave out") {
  auto c = parse_costs("f=1,i=1,w=1,comm=0.1,reduce=2,step=3");
  REQUIRE(c.ok());
  CHECK(c->b == 2);
  CHECK(c->reduce == 2);
  CHECK(c->step == 3);
  auto d = parse_costs("b=3,w=1");
  REQUIRE(d.ok());
  CHECK(d->i == 2);
}

TEST_CASE("bad costs are rejected with the accepted forms") {
  for (auto text : {"1,2,3", "1,x", "1,2,1,0,5", "f=1,z=2", "f=-1", "b=1,i=2", ""}) {
    CAPTURE(text);
    auto c = parse_costs(text);
    REQUIRE_FALSE(c.ok());
    CHECK(c.err().hint.find("F,B,W,comm") != std::string::npos);
  }
}

TEST_CASE("costs print with all four kinds and the transfer latency") {
  CHECK(format_costs(cost_model{}) == "F=1 B=2 I=1 W=1 comm=0");
}
