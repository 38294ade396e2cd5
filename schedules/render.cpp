#include "schedules/render.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace troupe::schedules {

namespace {

std::string num(double x, const char* format = "%.6g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}


std::string json_escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\', out += ch;
    else if (static_cast<unsigned char>(ch) < 0x20) out += ' ';
    else out += ch;
  }
  return out;
}

struct rgb {
  int r, g, b;
};

rgb base_colour(op_kind k) {
  switch (k) {
    case op_kind::F: return {76, 120, 168};
    case op_kind::B: return {84, 162, 75};
    case op_kind::I: return {245, 133, 24};
    case op_kind::W: return {178, 121, 162};
    case op_kind::REDUCE_GRAD: return {228, 87, 86};
    case op_kind::STEP: return {51, 51, 51};
    default: return {140, 140, 140};
  }
}

// Later chunks of the same rank are drawn lighter, so interleaving reads at a glance.
rgb shade(op_kind k, int local_chunk, int v) {
  rgb c = base_colour(k);
  const double t = v > 1 ? 0.5 * local_chunk / (v - 1) : 0.0;
  auto mix = [t](int x) { return static_cast<int>(std::lround(x + (255 - x) * t)); };
  return {mix(c.r), mix(c.g), mix(c.b)};
}

std::string colour(op_kind k, int local_chunk, int v) {
  const rgb c = shade(k, local_chunk, v);
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", c.r, c.g, c.b);
  return buf;
}

// White numbers on dark boxes, dark ones on light boxes.
std::string text_colour(op_kind k, int local_chunk, int v) {
  const rgb c = shade(k, local_chunk, v);
  return 0.299 * c.r + 0.587 * c.g + 0.114 * c.b > 150 ? "#222" : "white";
}

std::string kind_label(op_kind k) {
  switch (k) {
    case op_kind::F: return "F forward";
    case op_kind::B: return "B backward";
    case op_kind::I: return "I backward (inputs)";
    case op_kind::W: return "W backward (weights)";
    case op_kind::REDUCE_GRAD: return "REDUCE_GRAD";
    case op_kind::STEP: return "STEP";
    default: return "transfer";
  }
}

// A tick spacing of 1, 2 or 5 times a power of ten that gives about `target` ticks.
double tick_step(double span, int target) {
  const double raw = span / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double f : {1.0, 2.0, 5.0, 10.0})
    if (f * mag >= raw) return f * mag;
  return 10 * mag;
}

}  // namespace

std::string render_svg(const schedule& s, const simulation& sim, const std::string& subtitle) {
  const double span = std::max(sim.makespan, 1e-9);
  const double left = 74, right = 96, top = subtitle.empty() ? 46 : 64, row_h = 30, gap = 8;
  const double unit = std::clamp(1100.0 / span, 2.0, 44.0);
  const double plot_w = span * unit;
  const int p = s.stages;
  const double rows_bottom = top + p * (row_h + gap);
  const double width = left + plot_w + right;

  std::vector<op_kind> kinds_present;
  for (auto& list : sim.timeline)
    for (auto& t : list) {
      op_kind k = is_transfer(t.op.kind) ? op_kind::SEND_F : t.op.kind;
      if (t.end > t.start && std::find(kinds_present.begin(), kinds_present.end(), k) == kinds_present.end())
        kinds_present.push_back(k);
    }
  std::sort(kinds_present.begin(), kinds_present.end());
  const double legend_y = rows_bottom + 40;
  const double height = legend_y + 30 + (s.virtual_stages > 1 ? 22 : 0);

  std::string o;
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width, "%.0f") + "\" height=\"" +
       num(height, "%.0f") + "\" viewBox=\"0 0 " + num(width, "%.0f") + " " + num(height, "%.0f") +
       "\" font-family=\"Helvetica, Arial, sans-serif\">\n";
  o += "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
       "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f4f4f4\"/>"
       "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c8c8c8\" stroke-width=\"2\"/></pattern></defs>\n";
  o += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  char title[256];
  std::snprintf(title, sizeof title, "%s \u00b7 p=%d, m=%d, v=%d \u00b7 makespan %.4g \u00b7 bubble %.1f%%", s.name.c_str(),
                s.stages, s.microbatches, s.virtual_stages, sim.makespan, 100 * sim.bubble);
  o += "<text x=\"" + num(left) + "\" y=\"24\" font-size=\"16\" font-weight=\"bold\">" + xml_escape(title) + "</text>\n";
  if (!subtitle.empty())
    o += "<text x=\"" + num(left) + "\" y=\"44\" font-size=\"12\" fill=\"#555\">" + xml_escape(subtitle) + "</text>\n";

  for (int r = 0; r < p; ++r) {
    const double y = top + r * (row_h + gap);
    o += "<text x=\"" + num(left - 10) + "\" y=\"" + num(y + row_h / 2 + 5) +
         "\" font-size=\"13\" text-anchor=\"end\">rank " + std::to_string(r) + "</text>\n";
    o += "<rect x=\"" + num(left) + "\" y=\"" + num(y) + "\" width=\"" + num(plot_w) + "\" height=\"" + num(row_h) +
         "\" fill=\"url(#idle)\"/>\n";
    for (auto& t : sim.timeline[r]) {
      const double w = (t.end - t.start) * unit;
      if (w <= 0) continue;
      const double x = left + t.start * unit;
      const bool transfer = is_transfer(t.op.kind);
      const double h = transfer ? row_h / 4 : row_h;
      const double by = transfer ? y + row_h - h : y;
      const int local = t.op.chunk >= 0 ? t.op.chunk / s.stages : 0;
      o += "<rect x=\"" + num(x) + "\" y=\"" + num(by) + "\" width=\"" + num(w) + "\" height=\"" + num(h) +
           "\" fill=\"" + colour(t.op.kind, local, s.virtual_stages) +
           "\" stroke=\"white\" stroke-width=\"1\"><title>" + xml_escape(to_string(t.op)) + "  [" + num(t.start) +
           ", " + num(t.end) + ")</title></rect>\n";
      if (is_compute(t.op.kind) && w >= 9) {
        const double font = std::min(13.0, std::max(8.0, w * 0.55));
        o += "<text x=\"" + num(x + w / 2) + "\" y=\"" + num(y + row_h / 2 + font * 0.35) + "\" font-size=\"" +
             num(font, "%.1f") + "\" text-anchor=\"middle\" fill=\"" + text_colour(t.op.kind, local, s.virtual_stages) + "\">" +
             std::to_string(t.op.mb) +
             "</text>\n";
      }
    }
    char stats[64];
    std::snprintf(stats, sizeof stats, "idle %.1f%%", 100 * sim.ranks[r].bubble);
    o += "<text x=\"" + num(left + plot_w + 8) + "\" y=\"" + num(y + row_h / 2 + 5) + "\" font-size=\"12\" fill=\"#555\">" +
         stats + "</text>\n";
  }

  // Time axis.
  const double step = tick_step(span, 12);
  o += "<line x1=\"" + num(left) + "\" y1=\"" + num(rows_bottom) + "\" x2=\"" + num(left + plot_w) + "\" y2=\"" +
       num(rows_bottom) + "\" stroke=\"#888\"/>\n";
  for (double t = 0; t <= span + 1e-9; t += step) {
    const double x = left + t * unit;
    o += "<line x1=\"" + num(x) + "\" y1=\"" + num(rows_bottom) + "\" x2=\"" + num(x) + "\" y2=\"" +
         num(rows_bottom + 4) + "\" stroke=\"#888\"/><text x=\"" + num(x) + "\" y=\"" + num(rows_bottom + 16) +
         "\" font-size=\"10\" text-anchor=\"middle\" fill=\"#555\">" + num(t) + "</text>\n";
  }
  o += "<text x=\"" + num(left + plot_w) + "\" y=\"" + num(rows_bottom + 30) +
       "\" font-size=\"10\" text-anchor=\"end\" fill=\"#555\">time (cost units)</text>\n";

  // Legend.
  double lx = left;
  auto legend_item = [&](const std::string& fill, const std::string& label) {
    o += "<rect x=\"" + num(lx) + "\" y=\"" + num(legend_y) + "\" width=\"14\" height=\"14\" fill=\"" + fill +
         "\"/><text x=\"" + num(lx + 19) + "\" y=\"" + num(legend_y + 11) + "\" font-size=\"12\">" + xml_escape(label) +
         "</text>\n";
    lx += 30 + 7.0 * label.size();
  };
  for (op_kind k : kinds_present) legend_item(colour(k, 0, 1), kind_label(k));
  legend_item("url(#idle)", "idle (bubble)");
  o += "<text x=\"" + num(lx) + "\" y=\"" + num(legend_y + 11) +
       "\" font-size=\"12\" fill=\"#555\">numbers: micro-batch</text>\n";
  if (s.virtual_stages > 1)
    o += "<text x=\"" + num(left) + "\" y=\"" + num(legend_y + 34) +
         "\" font-size=\"12\" fill=\"#555\">lighter boxes: later chunks of the rank (rank r holds chunks r, r+" +
         std::to_string(p) + ", ...)</text>\n";
  o += "</svg>\n";
  return o;
}

std::string render_trace(const schedule& s, const simulation& sim) {
  // One cost unit = 1 ms = 1000 trace microseconds.
  std::string o = "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"schedule\": \"" + json_escape(s.name) +
                  "\", \"stages\": " + std::to_string(s.stages) + ", \"microbatches\": " +
                  std::to_string(s.microbatches) + ", \"virtual_stages\": " + std::to_string(s.virtual_stages) +
                  ", \"makespan\": " + num(sim.makespan) + ", \"bubble\": " + num(sim.bubble) +
                  "},\n\"traceEvents\": [\n";
  bool first = true;
  auto add = [&](const std::string& event) {
    o += (first ? "  " : ",\n  ") + event;
    first = false;
  };
  add("{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"args\": {\"name\": \"pipeline\"}}");
  for (int r = 0; r < s.stages; ++r) {
    add("{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + std::to_string(r) +
        ", \"args\": {\"name\": \"rank " + std::to_string(r) + "\"}}");
    for (auto& t : sim.timeline[r]) {
      add("{\"name\": \"" + to_string(t.op) + "\", \"cat\": \"" + std::string(kind_name(t.op.kind)) +
          "\", \"ph\": \"X\", \"pid\": 0, \"tid\": " + std::to_string(r) + ", \"ts\": " + num(t.start * 1000) +
          ", \"dur\": " + num((t.end - t.start) * 1000) + ", \"args\": {\"chunk\": " + std::to_string(t.op.chunk) +
          ", \"microbatch\": " + std::to_string(t.op.mb) + "}}");
    }
  }
  o += "\n]}\n";
  return o;
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

}  // namespace troupe::schedules
