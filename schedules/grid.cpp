#include "schedules/grid.hpp"

#include <algorithm>

namespace troupe::schedules {

std::string format_grid(const schedule& s, const std::vector<grid_mark>& marks, int context) {
  const int p = static_cast<int>(s.ranks.size());
  int rows = 0;
  for (auto& list : s.ranks) rows = std::max(rows, static_cast<int>(list.size()));
  for (auto& mk : marks) rows = std::max(rows, mk.step + 1);
  auto marked = [&](int r, int k) {
    return std::any_of(marks.begin(), marks.end(),
                       [&](const grid_mark& mk) { return mk.rank == r && mk.step == k; });
  };
  auto cell = [&](int r, int k) {
    std::string text = k < static_cast<int>(s.ranks[r].size()) ? to_string(s.ranks[r][k]) : "";
    if (marked(r, k)) return std::string(">").append(text.empty() ? "(end)" : text).append("<");
    return std::string(" ").append(text);
  };
  std::size_t width = 8;
  for (int r = 0; r < p; ++r)
    for (int k = 0; k < rows; ++k) width = std::max(width, cell(r, k).size() + 1);
  const std::size_t step_width = std::max<std::size_t>(4, std::to_string(rows).size());

  // Rows to print: all of them when short or unmarked, otherwise a window around each mark.
  std::vector<bool> show(rows, true);
  if (!marks.empty() && rows > 4 * context + 8) {
    std::fill(show.begin(), show.end(), false);
    for (auto& mk : marks)
      for (int k = std::max(0, mk.step - context); k <= std::min(rows - 1, mk.step + context); ++k)
        show[k] = true;
  }
  auto pad = [](std::string text, std::size_t w) {
    if (text.size() < w) text.append(w - text.size(), ' ');
    return text;
  };
  std::string out = pad("step", step_width) + " |";
  for (int r = 0; r < p; ++r) out += pad(" rank " + std::to_string(r), width) + "|";
  out += "\n";
  bool gap = false;
  for (int k = 0; k < rows; ++k) {
    if (!show[k]) {
      if (!gap) out += pad("...", step_width) + " |\n";
      gap = true;
      continue;
    }
    gap = false;
    std::string num = std::to_string(k);
    out += std::string(step_width - num.size(), ' ') + num + " |";
    for (int r = 0; r < p; ++r) out += pad(cell(r, k), width) + "|";
    out += "\n";
  }
  return out;
}

}  // namespace troupe::schedules
