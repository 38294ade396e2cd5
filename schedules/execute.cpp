// List scheduling of the per-rank lists: an instruction starts when its rank is free and its inputs
// exist. Start times do not depend on the order in which ranks are visited (each is a max over
// times already final), so a simple sweep until nothing moves is exact.
#include "schedules/execute.hpp"

#include <algorithm>
#include <cstdint>
#include <unordered_map>

namespace troupe::schedules {

namespace {

constexpr double not_done = -1;

class engine {
 public:
  engine(const schedule& s, const cost_model& costs)
      : s_(s), costs_(costs), lowered_(has_transfers(s)), p_(s.stages), m_(s.microbatches),
        n_(static_cast<std::size_t>(s.chunks()) * s.microbatches) {
    f_end_.assign(n_, not_done);
    bi_end_.assign(n_, not_done);
    recv_f_end_.assign(n_, not_done);
    recv_b_end_.assign(n_, not_done);
    pc_.assign(p_, 0);
    free_.assign(p_, 0.0);
    out_.timeline.resize(p_);
    for (int r = 0; r < p_; ++r)
      for (int k = 0; k < static_cast<int>(s.ranks[r].size()); ++k) {
        const auto& op = s.ranks[r][k];
        if (op.kind != op_kind::STEP && op.kind != op_kind::REDUCE_GRAD)
          where_.emplace(key(op.kind == op_kind::I ? op_kind::B : op.kind, op.chunk, op.mb),
                         std::pair{r, k});
      }
  }

  execution run() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < p_; ++r)
        while (pc_[r] < static_cast<int>(s_.ranks[r].size()) && try_step(r)) progress = true;
    }
    for (int r = 0; r < p_; ++r)
      if (pc_[r] < static_cast<int>(s_.ranks[r].size())) out_.stuck.push_back(diagnose(r));
    return std::move(out_);
  }

 private:
  static std::int64_t key(op_kind k, int c, int j) {
    return (static_cast<std::int64_t>(k) << 48) | (static_cast<std::int64_t>(c) << 24) | j;
  }
  std::size_t at(int c, int j) const { return static_cast<std::size_t>(c) * m_ + j; }
  const instruction& next(int r) const { return s_.ranks[r][pc_[r]]; }
  bool has_next(int r) const { return pc_[r] < static_cast<int>(s_.ranks[r].size()); }

  void record(int r, double start, double cost) {
    const double end = start + cost;
    const instruction& op = next(r);
    out_.timeline[r].push_back({op, start, end});
    free_[r] = end;
    ++pc_[r];
    switch (op.kind) {
      case op_kind::F: f_end_[at(op.chunk, op.mb)] = end; break;
      case op_kind::B:
      case op_kind::I: bi_end_[at(op.chunk, op.mb)] = end; break;
      case op_kind::RECV_F: recv_f_end_[at(op.chunk, op.mb)] = end; break;
      case op_kind::RECV_B: recv_b_end_[at(op.chunk, op.mb)] = end; break;
      default: break;
    }
  }

  // When the input of a compute instruction is ready on rank r, or not_done.
  double input_ready(int r, const instruction& op) const {
    const int c = op.chunk, j = op.mb;
    double ready = 0;
    if (op.kind == op_kind::W) return bi_end_[at(c, j)];
    if (op.kind == op_kind::B || op.kind == op_kind::I) {
      if (f_end_[at(c, j)] == not_done) return not_done;
      if (c + 1 == s_.chunks()) return 0;
      if (s_.rank_of(c + 1) == r) return bi_end_[at(c + 1, j)];
      if (lowered_) return recv_b_end_[at(c, j)];
      ready = bi_end_[at(c + 1, j)];
    } else {
      if (c == 0) return 0;
      if (s_.rank_of(c - 1) == r) return f_end_[at(c - 1, j)];
      if (lowered_) return recv_f_end_[at(c, j)];
      ready = f_end_[at(c - 1, j)];
    }
    return ready == not_done ? not_done : ready + costs_.comm;
  }

  // The receive that meets `send`, as it must appear on the peer.
  static instruction partner(const instruction& op, int self) {
    switch (op.kind) {
      case op_kind::SEND_F: return {op.chunk + 1, op_kind::RECV_F, op.mb, self};
      case op_kind::SEND_B: return {op.chunk - 1, op_kind::RECV_B, op.mb, self};
      case op_kind::RECV_F: return {op.chunk - 1, op_kind::SEND_F, op.mb, self};
      case op_kind::RECV_B: return {op.chunk + 1, op_kind::SEND_B, op.mb, self};
      default: return op;
    }
  }

  // Whether the data a send carries has been computed on its own rank.
  bool payload_ready(const instruction& send) const {
    return send.kind == op_kind::SEND_F ? f_end_[at(send.chunk, send.mb)] != not_done
                                        : bi_end_[at(send.chunk, send.mb)] != not_done;
  }

  bool try_step(int r) {
    const instruction& op = next(r);
    if (is_compute(op.kind)) {
      const double ready = input_ready(r, op);
      if (ready == not_done) return false;
      record(r, std::max(free_[r], ready), costs_.of(op.kind, op.chunk));
      return true;
    }
    if (is_transfer(op.kind)) {
      const int q = op.peer;
      if (q < 0 || q >= p_ || q == r || !has_next(q) || next(q) != partner(op, r)) return false;
      const instruction& send = is_send(op.kind) ? op : next(q);
      if (!payload_ready(send)) return false;
      const double start = std::max(free_[r], free_[q]);
      record(r, start, costs_.comm);
      record(q, start, costs_.comm);
      return true;
    }
    record(r, free_[r], costs_.of(op.kind));
    return true;
  }

  // Where `wanted` sits: "on rank 1 (its step 7)", "later in its own list (step 7)", or that no
  // rank runs it.
  std::string locate(int r, op_kind kind, int c, int j, int& owner) const {
    auto it = where_.find(key(kind == op_kind::I ? op_kind::B : kind, c, j));
    if (it == where_.end()) {
      owner = kind == op_kind::RECV_F || kind == op_kind::RECV_B ? r : s_.rank_of(c);
      return ", which no rank runs";
    }
    owner = it->second.first;
    if (owner == r) return ", which comes later in its own list (step " +
                           std::to_string(it->second.second) + ")";
    return " on rank " + std::to_string(owner) + " (its step " + std::to_string(it->second.second) +
           ")";
  }

  std::string name_of(op_kind kind, int c, int j) const {
    if (kind == op_kind::B || kind == op_kind::I) {
      auto it = where_.find(key(op_kind::B, c, j));
      if (it != where_.end()) return to_string(s_.ranks[it->second.first][it->second.second]);
    }
    return to_string(instruction{c, kind, j});
  }

  stuck_rank diagnose(int r) const {
    const instruction& op = next(r);
    stuck_rank st{r, pc_[r], r, ""};
    const int c = op.chunk, j = op.mb;
    auto waits_for = [&](op_kind kind, int wc, int wj) {
      std::string what = name_of(kind, wc, wj);
      if (kind == op_kind::RECV_F) what = to_string({wc, kind, wj, s_.rank_of(wc - 1)});
      if (kind == op_kind::RECV_B) what = to_string({wc, kind, wj, s_.rank_of(wc + 1)});
      st.reason = "waits for " + what + locate(r, kind, wc, wj, st.waits_on);
    };
    switch (op.kind) {
      case op_kind::F:
        if (s_.rank_of(c - 1) != r && lowered_) waits_for(op_kind::RECV_F, c, j);
        else waits_for(op_kind::F, c - 1, j);
        break;
      case op_kind::B:
      case op_kind::I:
        if (f_end_[at(c, j)] == not_done) waits_for(op_kind::F, c, j);
        else if (s_.rank_of(c + 1) != r && lowered_) waits_for(op_kind::RECV_B, c, j);
        else waits_for(op_kind::B, c + 1, j);
        break;
      case op_kind::W: waits_for(op_kind::I, c, j); break;
      default: {
        const bool send = is_send(op.kind);
        if (send && !payload_ready(op)) {
          waits_for(op.kind == op_kind::SEND_F ? op_kind::F : op_kind::B, c, j);
          break;
        }
        const instruction other = partner(op, r);
        st.waits_on = op.peer;
        st.reason = "waits for rank " + std::to_string(op.peer) + " to reach " + to_string(other);
        if (op.peer >= 0 && op.peer < p_ && has_next(op.peer))
          st.reason += " (rank " + std::to_string(op.peer) + " is at " + to_string(next(op.peer)) +
                       ")";
        else if (op.peer >= 0 && op.peer < p_)
          st.reason += " (rank " + std::to_string(op.peer) + " has finished)";
      }
    }
    return st;
  }

  const schedule& s_;
  const cost_model& costs_;
  const bool lowered_;
  const int p_, m_;
  const std::size_t n_;
  std::vector<double> f_end_, bi_end_, recv_f_end_, recv_b_end_;
  std::vector<int> pc_;
  std::vector<double> free_;
  std::unordered_map<std::int64_t, std::pair<int, int>> where_;
  execution out_;
};

}  // namespace

execution execute(const schedule& s, const cost_model& costs) { return engine(s, costs).run(); }

std::string execution::describe_deadlock() const {
  if (stuck.empty()) return {};
  std::string out = "deadlock: no rank can make progress\n";
  std::vector<int> stuck_index(timeline.size(), -1);
  for (std::size_t k = 0; k < stuck.size(); ++k) {
    const auto& st = stuck[k];
    stuck_index[st.rank] = static_cast<int>(k);
    out += "  rank " + std::to_string(st.rank) + " is stuck at step " + std::to_string(st.step) +
           ": " + st.reason + "\n";
  }
  // Follow the waits from the first stuck rank; each stuck rank waits on exactly one rank, so the
  // walk either reaches a rank that is not stuck or closes a cycle.
  std::vector<int> seen_at(timeline.size(), -1);
  std::vector<int> walk;
  int r = stuck.front().rank;
  while (r >= 0 && r < static_cast<int>(timeline.size()) && stuck_index[r] >= 0 && seen_at[r] < 0) {
    seen_at[r] = static_cast<int>(walk.size());
    walk.push_back(r);
    r = stuck[stuck_index[r]].waits_on;
  }
  if (r >= 0 && r < static_cast<int>(timeline.size()) && seen_at[r] >= 0) {
    out += "  cycle: ";
    for (std::size_t k = seen_at[r]; k < walk.size(); ++k) out += "rank " + std::to_string(walk[k]) + " -> ";
    out += "rank " + std::to_string(r);
  } else {
    out += "  nothing will ever arrive for rank " + std::to_string(walk.back());
  }
  return out;
}

}  // namespace troupe::schedules
