// The instruction text form: every kind prints and parses back, and bad text says what is wrong.
#include <doctest/doctest.h>

#include "schedules/schedule.hpp"

using namespace troupe::schedules;

TEST_CASE("1F3 reads as chunk 1, forward, micro-batch 3") {
  auto op = parse_instruction("1F3");
  REQUIRE(op.ok());
  CHECK(op->chunk == 1);
  CHECK(op->kind == op_kind::F);
  CHECK(op->mb == 3);
  CHECK(op->peer == -1);
}

TEST_CASE("every kind's text form parses back to the same instruction") {
  const instruction ops[] = {
      {1, op_kind::F, 3},          {0, op_kind::B, 7},          {12, op_kind::I, 0},
      {2, op_kind::W, 31},         {1, op_kind::SEND_F, 3, 2},  {2, op_kind::RECV_F, 3, 1},
      {2, op_kind::SEND_B, 5, 1},  {1, op_kind::RECV_B, 5, 2},  {3, op_kind::REDUCE_GRAD, -1},
      {-1, op_kind::STEP, -1},
  };
  for (const auto& op : ops) {
    const std::string text = to_string(op);
    CAPTURE(text);
    auto back = parse_instruction(text);
    REQUIRE(back.ok());
    CHECK(*back == op);
  }
}

TEST_CASE("transfers print their peer with an arrow that points the way the data goes") {
  CHECK(to_string({1, op_kind::SEND_F, 3, 2}) == "1SEND_F3->2");
  CHECK(to_string({2, op_kind::RECV_F, 3, 1}) == "2RECV_F3<-1");
  CHECK(to_string({0, op_kind::REDUCE_GRAD, -1}) == "0REDUCE_GRAD");
  CHECK(to_string({-1, op_kind::STEP, -1}) == "STEP");
}

TEST_CASE("a transfer may be written without its peer, as PyTorch writes it") {
  auto op = parse_instruction("1SEND_F3");
  REQUIRE(op.ok());
  CHECK(op->kind == op_kind::SEND_F);
  CHECK(op->peer == -1);
}

TEST_CASE("bad instruction text is rejected with the reason and the accepted forms") {
  for (auto text : {"F3", "1X3", "1F", "1F3x", "1B3->2", "1SEND_F3<-2", "1SEND_F3->", "0REDUCE_GRAD4", "1STEP2", ""}) {
    CAPTURE(text);
    auto op = parse_instruction(text);
    REQUIRE_FALSE(op.ok());
    CHECK(op.err().message.find(std::string("'") + text + "'") != std::string::npos);
    CHECK(op.err().hint.find("1F3") != std::string::npos);
  }
}

TEST_CASE("kinds are classified as compute, transfer and send") {
  CHECK(is_compute(op_kind::W));
  CHECK_FALSE(is_compute(op_kind::SEND_B));
  CHECK(is_transfer(op_kind::RECV_B));
  CHECK_FALSE(is_transfer(op_kind::REDUCE_GRAD));
  CHECK(is_send(op_kind::SEND_B));
  CHECK_FALSE(is_send(op_kind::RECV_F));
}

TEST_CASE("transfer peers follow the chunk layout c % p") {
  schedule s;
  s.stages = 4;
  s.virtual_stages = 2;
  CHECK(transfer_peer(s, op_kind::SEND_F, 3) == 0);  // chunk 4 lives on rank 0
  CHECK(transfer_peer(s, op_kind::RECV_F, 4) == 3);
  CHECK(transfer_peer(s, op_kind::SEND_B, 4) == 3);
  CHECK(transfer_peer(s, op_kind::RECV_B, 3) == 0);
}
