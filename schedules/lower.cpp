#include "schedules/lower.hpp"

#include <algorithm>
#include <limits>
#include <tuple>

#include "schedules/execute.hpp"
#include "schedules/validate.hpp"

namespace troupe::schedules {

namespace {

constexpr double eps = 1e-9;
constexpr double infinity = std::numeric_limits<double>::infinity();

// An instruction with its sort key on its rank: time, then transfers (class 0) before compute
// (class 1) at the same time; transfers at the same time go oldest data first, then by a global
// id; compute keeps its list position.
struct placed {
  double time;
  int cls;
  double produced;
  long order;
  instruction op;
  bool operator<(const placed& o) const {
    return std::tie(time, cls, produced, order) < std::tie(o.time, o.cls, o.produced, o.order);
  }
};

// A rank's simulated timeline, asked "is the rank between instructions at time t?".
class rank_times {
 public:
  explicit rank_times(const std::vector<timed_instruction>& ops) : ops_(ops) {}

  bool free_at(double t) const {
    // The last instruction that started strictly before t must have ended by t.
    auto it = std::lower_bound(ops_.begin(), ops_.end(), t - eps,
                               [](const timed_instruction& x, double v) { return x.start < v; });
    if (it == ops_.begin()) return true;
    return std::prev(it)->end <= t + eps;
  }
  // Instruction boundaries (starts and ends) within [lo, hi].
  void boundaries(double lo, double hi, std::vector<double>& out) const {
    auto it = std::lower_bound(ops_.begin(), ops_.end(), lo - eps,
                               [](const timed_instruction& x, double v) { return x.end < v; });
    for (; it != ops_.end() && it->start <= hi + eps; ++it) {
      if (it->start >= lo - eps) out.push_back(it->start);
      if (it->end <= hi + eps) out.push_back(it->end);
    }
  }
  // When the rank can reach a point placed at time t: t itself when it is between instructions,
  // else the end of the instruction running at t.
  double arrival(double t) const {
    auto it = std::lower_bound(ops_.begin(), ops_.end(), t - eps,
                               [](const timed_instruction& x, double v) { return x.start < v; });
    if (it == ops_.begin() || std::prev(it)->end <= t + eps) return t;
    return std::prev(it)->end;
  }
  // The start of the first instruction that begins at or after t (infinity when none).
  double next_start(double t) const {
    auto it = std::lower_bound(ops_.begin(), ops_.end(), t - eps,
                               [](const timed_instruction& x, double v) { return x.start < v; });
    return it == ops_.end() ? infinity : it->start;
  }
  double start_after(int index) const {
    return index + 1 < static_cast<int>(ops_.size()) ? ops_[index + 1].start : infinity;
  }

 private:
  const std::vector<timed_instruction>& ops_;
};

cost_model placement_costs(const cost_model& c) {
  // Placement needs every instruction to take time, or a send could sort before its producer.
  auto positive = [](double x, double fallback) { return x > 0 ? x : fallback; };
  cost_model out;
  out.f = positive(c.f, 1);
  out.b = positive(c.b, 2);
  out.i = positive(c.i, 1);
  out.w = positive(c.w, 1);
  out.comm = std::max(0.0, c.comm);
  return out;
}

}  // namespace

schedule insert_transfers(const schedule& compute_only, const cost_model& costs) {
  TROUPE_CHECK(!has_transfers(compute_only), "insert_transfers takes a compute-only schedule");
  const auto valid = validate(compute_only, {false, true});
  TROUPE_CHECK(valid.ok(), valid.ok() ? std::string() : valid.err().to_string());
  const schedule& s = compute_only;
  const execution run = execute(s, placement_costs(costs));
  const int p = s.stages, m = s.microbatches, chunks = s.chunks();

  // Where each compute instruction ran: (rank, index in the timeline == index in the list).
  struct ran {
    int index = -1;
    double start = 0, end = 0;
  };
  std::vector<ran> fwd(static_cast<std::size_t>(chunks) * m), bwd(fwd.size());
  for (int r = 0; r < p; ++r)
    for (int k = 0; k < static_cast<int>(run.timeline[r].size()); ++k) {
      const auto& t = run.timeline[r][k];
      const std::size_t at = static_cast<std::size_t>(t.op.chunk) * m + t.op.mb;
      if (t.op.kind == op_kind::F) fwd[at] = {k, t.start, t.end};
      if (t.op.kind == op_kind::B || t.op.kind == op_kind::I) bwd[at] = {k, t.start, t.end};
    }
  std::vector<rank_times> times;
  for (int r = 0; r < p; ++r) times.emplace_back(run.timeline[r]);

  std::vector<std::vector<placed>> lists(p);
  for (int r = 0; r < p; ++r)
    for (int k = 0; k < static_cast<int>(run.timeline[r].size()); ++k)
      lists[r].push_back({run.timeline[r][k].start, 1, 0, k, run.timeline[r][k].op});

  long next_id = 0;
  std::vector<double> candidates;
  auto place = [&](int a, const ran& producer, int b, const ran& consumer, instruction send, instruction recv) {
    const double lo = producer.end, hi = consumer.start;
    const double sender_next = times[a].start_after(producer.index);
    candidates.assign({lo, hi});
    times[a].boundaries(lo, hi, candidates);
    times[b].boundaries(lo, hi, candidates);
    std::sort(candidates.begin(), candidates.end());
    auto both_free = [&](double t) { return times[a].free_at(t) && times[b].free_at(t); };
    double when = lo;
    bool chosen = false;
    // Latest common gap before the sender moves on; else the earliest common gap after that.
    for (auto it = candidates.rbegin(); it != candidates.rend() && !chosen; ++it)
      if (*it <= std::min(hi, sender_next) + eps && *it >= lo - eps && both_free(*it)) when = *it, chosen = true;
    for (auto it = candidates.begin(); it != candidates.end() && !chosen; ++it)
      if (*it >= lo - eps && *it <= hi + eps && both_free(*it)) when = *it, chosen = true;
    // No moment finds both ranks between instructions: under blocking transfers one of them will
    // wait. Take the moment that delays the two ranks' next instructions least.
    double least = infinity;
    for (auto it = candidates.begin(); it != candidates.end() && !chosen; ++it) {
      if (*it < lo - eps || *it > hi + eps) continue;
      const double ta = times[a].arrival(*it), tb = times[b].arrival(*it);
      const double meet = std::max(ta, tb);
      const double delay = std::max(0.0, meet - times[a].next_start(ta)) + std::max(0.0, meet - times[b].next_start(tb));
      if (delay < least - eps) least = delay, when = *it;
    }
    const long id = next_id++;
    lists[a].push_back({when, 0, lo, id, send});
    lists[b].push_back({when, 0, lo, id, recv});
  };

  for (int c = 0; c + 1 < chunks; ++c) {
    const int a = s.rank_of(c), b = s.rank_of(c + 1);
    if (a == b) continue;
    for (int j = 0; j < m; ++j) {
      const std::size_t lo_at = static_cast<std::size_t>(c) * m + j, hi_at = lo_at + m;
      place(a, fwd[lo_at], b, fwd[hi_at], {c, op_kind::SEND_F, j, b}, {c + 1, op_kind::RECV_F, j, a});
      place(b, bwd[hi_at], a, bwd[lo_at], {c + 1, op_kind::SEND_B, j, a}, {c, op_kind::RECV_B, j, b});
    }
  }

  schedule out{s.stages, s.microbatches, s.virtual_stages, std::vector<std::vector<instruction>>(p), s.name, s.place};
  for (int r = 0; r < p; ++r) {
    std::sort(lists[r].begin(), lists[r].end());
    for (auto& x : lists[r]) out.ranks[r].push_back(x.op);
  }
  return out;
}

schedule insert_reduction(const schedule& s) {
  schedule out = s;
  bool has_reduce = false, has_step = false;
  for (auto& list : s.ranks)
    for (auto& op : list) {
      has_reduce |= op.kind == op_kind::REDUCE_GRAD;
      has_step |= op.kind == op_kind::STEP;
    }
  if (!has_reduce) {
    for (int r = 0; r < s.stages; ++r) {
      auto& list = out.ranks[r];
      for (int k = 0; k < s.virtual_stages; ++k) {
        const int c = s.chunk_of(r, k);
        int last = -1;
        for (int k = 0; k < static_cast<int>(list.size()); ++k)
          if ((list[k].kind == op_kind::B || list[k].kind == op_kind::W) && list[k].chunk == c) last = k;
        TROUPE_CHECK(last >= 0, "chunk " + std::to_string(c) + " has no backward to reduce after");
        int at = last + 1;
        if (list[last].kind == op_kind::B)
          // The input gradient leaves first; it may sit a few transfers further on.
          for (int k = last + 1; k < static_cast<int>(list.size()) && is_transfer(list[k].kind); ++k)
            if (list[k].kind == op_kind::SEND_B && list[k].chunk == c && list[k].mb == list[last].mb) {
              at = k + 1;
              break;
            }
        list.insert(list.begin() + at, instruction{c, op_kind::REDUCE_GRAD, -1});
      }
    }
  }
  if (!has_step)
    for (auto& list : out.ranks) list.push_back({-1, op_kind::STEP, -1});
  return out;
}

schedule lower(const schedule& s, const cost_model& costs) {
  return insert_reduction(has_transfers(s) ? s : insert_transfers(s, costs));
}

}  // namespace troupe::schedules
