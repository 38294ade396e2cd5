#include "schedules/schedule_file.hpp"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "core/files.hpp"

namespace troupe::schedules {

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool blank(char ch) { return ch == ' ' || ch == '\t' || ch == '\r'; }

struct token {
  std::string_view text;
  int column;  // 1-based
};

// Splits a line into tokens at spaces, tabs and commas (every comma is a cell boundary in CSV).
std::vector<token> split(std::string_view line) {
  std::vector<token> out;
  std::size_t k = 0;
  while (k < line.size()) {
    while (k < line.size() && (blank(line[k]) || line[k] == ',')) ++k;
    std::size_t end = k;
    while (end < line.size() && !blank(line[end]) && line[end] != ',') ++end;
    if (end > k) {
      std::string_view t = line.substr(k, end - k);
      int column = static_cast<int>(k) + 1;
      if (t.size() >= 2 && t.front() == '"' && t.back() == '"') t = t.substr(1, t.size() - 2), ++column;
      if (!t.empty()) out.push_back({t, column});
    }
    k = end;
  }
  return out;
}

}  // namespace

core::result<schedule> parse_schedule_text(std::string_view text, const std::string& source, bool csv) {
  schedule s;
  s.name = source;
  std::vector<std::string_view> lines;
  for (std::size_t pos = 0; pos < text.size();) {
    std::size_t end = std::min(text.find('\n', pos), text.size());
    lines.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  int max_chunk = -1, max_mb = -1;
  std::int64_t instructions = 0;
  for (int line_no = 1; line_no <= static_cast<int>(lines.size()); ++line_no) {
    std::string_view line = lines[line_no - 1];
    if (!csv)
      if (auto hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    // A blank text line is nothing; a blank CSV row would be a rank without work, which no
    // pipeline has, so it is read as nothing too.
    if (std::all_of(line.begin(), line.end(), [](char ch) { return blank(ch) || ch == ','; })) continue;
    auto tokens = split(line);
    const int rank = static_cast<int>(s.ranks.size());
    if (!csv && !tokens.empty() && tokens[0].text == "placement") {
      const bool known = tokens.size() == 2 && (tokens[1].text == "v" || tokens[1].text == "interleaved");
      if (!known)
        return core::error::at_key(source, "", line_no, tokens[0].column,
                                   "expected 'placement v' or 'placement interleaved'",
                                   "write 'placement v' for chunks in a V (ZB-V), or leave the line out for "
                                   "chunk c on rank c % p");
      if (rank > 0)
        return core::error::at_key(source, "", line_no, tokens[0].column,
                                   "the placement line comes after rank lines",
                                   "put 'placement " + std::string(tokens[1].text) + "' before 'rank 0:'");
      s.place = tokens[1].text == "v" ? placement::v : placement::interleaved;
      continue;
    }
    std::size_t first = 0;
    if (!csv && !tokens.empty() && tokens[0].text == "rank") {
      if (tokens.size() < 2 || tokens[1].text.empty() || tokens[1].text.back() != ':')
        return core::error::at_key(source, "", line_no, tokens[0].column, "expected 'rank N:' at the start of the line",
                                   "write 'rank " + std::to_string(rank) + ": 0F0 0F1 ...'");
      const std::string label(tokens[1].text.substr(0, tokens[1].text.size() - 1));
      if (label != std::to_string(rank))
        return core::error::at_key(source, "", line_no, tokens[1].column,
                                   "this line is labelled rank " + label + " but it is rank " +
                                       std::to_string(rank) + "'s line",
                                   "list the ranks in order 0, 1, 2, ..., one line each");
      first = 2;
    }
    if (rank >= max_stages)
      return core::error::at_key(source, "", line_no, 1,
                                 "more than " + std::to_string(max_stages) +
                                     " rank lines: a pipeline has at most " +
                                     std::to_string(max_stages) + " stages",
                                 "one line per pipeline rank; parallel.pipeline_stage is at most " +
                                     std::to_string(max_stages));
    s.ranks.emplace_back();
    for (std::size_t k = first; k < tokens.size(); ++k) {
      auto op = parse_instruction(tokens[k].text);
      if (!op) {
        auto e = op.err();
        return core::error::at_key(source, "", line_no, tokens[k].column, e.message, e.hint);
      }
      // Chunk and micro-batch numbers size the checks that follow: refuse absurd ones here, at
      // their line, before anything of their size is built.
      if (op->chunk >= max_stages * max_virtual_stages || op->mb >= max_microbatches)
        return core::error::at_key(
            source, "", line_no, tokens[k].column,
            "'" + std::string(tokens[k].text) + "' names " +
                (op->mb >= max_microbatches ? "micro-batch " + std::to_string(op->mb)
                                            : "chunk " + std::to_string(op->chunk)) +
                ", above the largest a schedule may have (chunks < " +
                std::to_string(max_stages * max_virtual_stages) + ", micro-batches < " +
                std::to_string(max_microbatches) + ")",
            "chunks are numbered 0 .. p*v-1 and micro-batches 0 .. m-1");
      if (++instructions > 5 * max_passes())
        return core::error::at_key(source, "", line_no, tokens[k].column,
                                   "more than " + std::to_string(5 * max_passes()) +
                                       " instructions, more than the largest schedule this "
                                       "machine holds",
                                   "is this the right file?");
      s.ranks.back().push_back(*op);
      if (op->kind != op_kind::STEP) max_chunk = std::max(max_chunk, op->chunk);
      if (op->kind != op_kind::STEP && op->kind != op_kind::REDUCE_GRAD) max_mb = std::max(max_mb, op->mb);
    }
  }
  if (s.ranks.empty() || max_chunk < 0)
    return core::error::at_file(source, "the file holds no instructions",
                                "write one line per rank, e.g. 'rank 0: 0F0 0B0'");
  s.stages = static_cast<int>(s.ranks.size());
  s.virtual_stages = max_chunk / s.stages + 1;
  s.microbatches = std::max(max_mb + 1, 1);
  if (auto st = check_size("schedule file " + source, s.stages, s.virtual_stages, s.microbatches); !st)
    return st.err();
  // Fill the peers a hand-written file left out; a wrong peer stays for validate to report.
  for (int r = 0; r < s.stages; ++r)
    for (auto& op : s.ranks[r]) {
      if (!is_transfer(op.kind) || op.peer >= 0) continue;
      const int other = op.chunk + (op.kind == op_kind::SEND_F || op.kind == op_kind::RECV_B ? 1 : -1);
      if (other >= 0 && other < s.chunks()) op.peer = s.rank_of(other);
    }
  return s;
}

core::result<schedule> load_schedule_file(const std::string& path) {
  // A line per rank of instructions of a few bytes each: the largest schedule fits in this.
  constexpr std::uint64_t max_schedule_file_bytes = std::uint64_t(1) << 30;
  core::input_spec spec;
  spec.what = "schedule file";
  spec.max_bytes = max_schedule_file_bytes;
  spec.hint = "check the path; a file is read when the name is not a registered schedule "
              "(docs/schedules.md describes the text and .csv forms)";
  auto text = core::read_input(path, spec);
  if (!text) return text.err();
  return parse_schedule_text(text.value(), path, ends_with(path, ".csv"));
}

std::string format_schedule_text(const schedule& s) {
  std::string out = "# schedule '" + s.name + "': p=" + std::to_string(s.stages) + " m=" +
                    std::to_string(s.microbatches) + " v=" + std::to_string(s.virtual_stages) + "\n";
  if (s.place != placement::interleaved) out += "placement " + std::string(placement_name(s.place)) + "\n";
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    out += "rank " + std::to_string(r) + ":";
    for (auto& op : s.ranks[r]) out.append(" ").append(to_string(op));
    out += "\n";
  }
  return out;
}

}  // namespace troupe::schedules
