// The text form of instructions and the small facts about kinds that every pass needs.
#include <array>
#include <charconv>
#include <utility>

#include "schedules/schedule.hpp"

namespace troupe::schedules {

namespace {

// Longest names first so that "SEND_F" is not read as "S"+... and "B" is not taken from "RECV_B".
constexpr std::array<std::pair<std::string_view, op_kind>, 10> kind_names{{
    {"REDUCE_GRAD", op_kind::REDUCE_GRAD},
    {"SEND_F", op_kind::SEND_F},
    {"RECV_F", op_kind::RECV_F},
    {"SEND_B", op_kind::SEND_B},
    {"RECV_B", op_kind::RECV_B},
    {"STEP", op_kind::STEP},
    {"F", op_kind::F},
    {"B", op_kind::B},
    {"I", op_kind::I},
    {"W", op_kind::W},
}};

// Reads a run of decimal digits at `pos`; returns -1 when there is none.
int read_number(std::string_view text, std::size_t& pos) {
  std::size_t end = pos;
  while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
  if (end == pos) return -1;
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data() + pos, text.data() + end, value);
  if (ec != std::errc() || ptr != text.data() + end) return -2;
  pos = end;
  return value;
}

core::error bad(std::string_view text, std::string why) {
  return core::error::make("cannot read instruction '" + std::string(text) + "': " + why,
                           "write <chunk><KIND><micro-batch> such as 1F3, 0B7, 2I0, 2W0, "
                           "1SEND_F3->2, 2RECV_F3<-1, 0REDUCE_GRAD or STEP");
}

}  // namespace

bool is_compute(op_kind k) {
  return k == op_kind::F || k == op_kind::B || k == op_kind::I || k == op_kind::W;
}

bool is_transfer(op_kind k) {
  return k == op_kind::SEND_F || k == op_kind::RECV_F || k == op_kind::SEND_B ||
         k == op_kind::RECV_B;
}

bool is_send(op_kind k) { return k == op_kind::SEND_F || k == op_kind::SEND_B; }

std::string_view kind_name(op_kind k) {
  for (auto& [name, kind] : kind_names)
    if (kind == k) return name;
  return "?";
}

std::string to_string(const instruction& op) {
  if (op.kind == op_kind::STEP) return "STEP";
  std::string out = std::to_string(op.chunk);
  out += kind_name(op.kind);
  if (op.kind == op_kind::REDUCE_GRAD) return out;
  out += std::to_string(op.mb);
  if (is_transfer(op.kind) && op.peer >= 0)
    out += (is_send(op.kind) ? "->" : "<-") + std::to_string(op.peer);
  return out;
}

core::result<instruction> parse_instruction(std::string_view text) {
  if (text == "STEP") return instruction{-1, op_kind::STEP, -1};
  std::size_t pos = 0;
  int chunk = read_number(text, pos);
  if (chunk < 0) return bad(text, "it does not start with a chunk number");
  std::string_view rest = text.substr(pos);
  const std::pair<std::string_view, op_kind>* found = nullptr;
  for (auto& entry : kind_names)
    if (rest.substr(0, entry.first.size()) == entry.first) {
      found = &entry;
      break;
    }
  if (!found || found->second == op_kind::STEP)
    return bad(text, "no instruction kind after the chunk number");
  pos += found->first.size();
  instruction op{chunk, found->second, -1};
  if (op.kind == op_kind::REDUCE_GRAD) {
    if (pos != text.size()) return bad(text, "REDUCE_GRAD takes no micro-batch");
    return op;
  }
  op.mb = read_number(text, pos);
  if (op.mb < 0) return bad(text, "no micro-batch number after the kind");
  if (pos == text.size()) return op;
  if (!is_transfer(op.kind)) return bad(text, "unexpected '" + std::string(text.substr(pos)) + "'");
  std::string_view arrow = is_send(op.kind) ? "->" : "<-";
  if (text.substr(pos, 2) != arrow)
    return bad(text, std::string("a ") + std::string(kind_name(op.kind)) + " names its peer after '" +
                         std::string(arrow) + "'");
  pos += 2;
  op.peer = read_number(text, pos);
  if (op.peer < 0 || pos != text.size()) return bad(text, "no peer rank after the arrow");
  return op;
}

std::string_view placement_name(placement pl) { return pl == placement::v ? "v" : "interleaved"; }

int transfer_peer(const schedule& s, op_kind k, int c) {
  switch (k) {
    case op_kind::SEND_F:
    case op_kind::RECV_B: return s.rank_of(c + 1);
    case op_kind::RECV_F:
    case op_kind::SEND_B: return s.rank_of(c - 1);
    default: return -1;
  }
}

bool has_transfers(const schedule& s) {
  for (auto& list : s.ranks)
    for (auto& op : list)
      if (is_transfer(op.kind)) return true;
  return false;
}

std::size_t size(const schedule& s) {
  std::size_t n = 0;
  for (auto& list : s.ranks) n += list.size();
  return n;
}

}  // namespace troupe::schedules
