#include "schedules/costs.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace troupe::schedules {

namespace {

core::error bad(std::string_view text, const std::string& why) {
  return core::error::make("cannot read costs '" + std::string(text) + "': " + why,
                           "write F,B,W,comm (e.g. 1,2,1,0; I = B - W) or named fields "
                           "f=1,b=2,i=1,w=1,comm=0,reduce=0,step=0");
}

bool read_number(std::string_view field, double& out) {
  const std::string s(field);
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  // strtod reads "nan", "inf" and 1e999 (as inf): a cost must be a finite number.
  return !s.empty() && end == s.c_str() + s.size() && std::isfinite(out) && out >= 0;
}

}  // namespace

double cost_model::of(op_kind k) const {
  switch (k) {
    case op_kind::F: return f;
    case op_kind::B: return b;
    case op_kind::I: return i;
    case op_kind::W: return w;
    case op_kind::SEND_F:
    case op_kind::RECV_F:
    case op_kind::SEND_B:
    case op_kind::RECV_B: return comm;
    case op_kind::REDUCE_GRAD: return reduce;
    case op_kind::STEP: return step;
  }
  return 0;
}

double cost_model::of(op_kind k, int chunk) const {
  if (chunk < 0 || static_cast<std::size_t>(chunk) >= chunks.size() || !is_compute(k)) return of(k);
  const chunk_cost& c = chunks[static_cast<std::size_t>(chunk)];
  switch (k) {
    case op_kind::F: return c.f;
    case op_kind::B: return c.b;
    case op_kind::I: return c.i;
    default: return c.w;
  }
}

core::result<cost_model> parse_costs(std::string_view text) {
  std::vector<std::string_view> fields;
  for (std::size_t pos = 0; pos <= text.size();) {
    std::size_t end = text.find(',', pos);
    if (end == std::string_view::npos) end = text.size();
    fields.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  cost_model c;
  const bool named = text.find('=') != std::string_view::npos;
  if (!named) {
    if (fields.size() > 4) return bad(text, "at most four numbers: F,B,W,comm");
    double v[4] = {c.f, c.b, -1, c.comm};
    for (std::size_t k = 0; k < fields.size(); ++k)
      if (!read_number(fields[k], v[k])) return bad(text, std::string("'") + std::string(fields[k]) + "' is not a number >= 0");
    c.f = v[0];
    c.b = v[1];
    c.w = v[2] >= 0 ? v[2] : c.b / 2;
    if (c.w > c.b) return bad(text, "W is part of B, so W <= B");
    c.i = c.b - c.w;
    c.comm = v[3];
    return c;
  }
  bool got_b = false, got_i = false, got_w = false;
  for (auto field : fields) {
    const auto eq = field.find('=');
    if (eq == std::string_view::npos) return bad(text, std::string("'") + std::string(field) + "' is not key=value");
    const std::string_view key = field.substr(0, eq);
    double value = 0;
    if (!read_number(field.substr(eq + 1), value))
      return bad(text, "the value of '" + std::string(key) + "' is not a number >= 0");
    if (key == "f" || key == "F") c.f = value;
    else if (key == "b" || key == "B") c.b = value, got_b = true;
    else if (key == "i" || key == "I") c.i = value, got_i = true;
    else if (key == "w" || key == "W") c.w = value, got_w = true;
    else if (key == "comm") c.comm = value;
    else if (key == "reduce") c.reduce = value;
    else if (key == "step") c.step = value;
    else return bad(text, "unknown key '" + std::string(key) + "'");
  }
  if (got_b && !got_i && !got_w) c.i = c.w = c.b / 2;
  else if (got_b && got_i && !got_w) c.w = c.b - c.i;
  else if (got_b && got_w && !got_i) c.i = c.b - c.w;
  else if (!got_b && (got_i || got_w)) c.b = c.i + c.w;
  if (c.i < 0 || c.w < 0) return bad(text, "I and W are parts of B, so neither may exceed B");
  return c;
}

std::string format_costs(const cost_model& c) {
  auto n = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", x);
    return std::string(buf);
  };
  std::string out = "F=" + n(c.f) + " B=" + n(c.b) + " I=" + n(c.i) + " W=" + n(c.w) + " comm=" + n(c.comm);
  if (c.reduce != 0) out += " reduce=" + n(c.reduce);
  if (c.step != 0) out += " step=" + n(c.step);
  if (!c.chunks.empty()) {
    // The measured costs replace F, B, I and W: name them per chunk instead.
    out = "per chunk (F/B/I/W):";
    for (std::size_t k = 0; k < c.chunks.size(); ++k)
      out += " " + std::to_string(k) + ":" + n(c.chunks[k].f) + "/" + n(c.chunks[k].b) + "/" +
             n(c.chunks[k].i) + "/" + n(c.chunks[k].w);
    out += " comm=" + n(c.comm);
  }
  return out;
}

}  // namespace troupe::schedules
