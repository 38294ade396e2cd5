#include "schedules/validate.hpp"

#include <algorithm>
#include <array>
#include <map>
#include <optional>

#include "schedules/execute.hpp"
#include "schedules/grid.hpp"

namespace troupe::schedules {

namespace {

struct site {
  int rank = -1;
  int step = -1;
  bool found() const { return rank >= 0; }
};

// One slot per kind that occurs once per (chunk, micro-batch).
enum slot { F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, slots };

int slot_of(op_kind k) {
  switch (k) {
    case op_kind::F: return F;
    case op_kind::B: return B;
    case op_kind::I: return I;
    case op_kind::W: return W;
    case op_kind::SEND_F: return SEND_F;
    case op_kind::RECV_F: return RECV_F;
    case op_kind::SEND_B: return SEND_B;
    case op_kind::RECV_B: return RECV_B;
    case op_kind::REDUCE_GRAD:
    case op_kind::STEP: return -1;
  }
  return -1;
}

class checker {
 public:
  checker(const schedule& s, const validate_options& options)
      : s_(s), options_(options), p_(s.stages), m_(s.microbatches), chunks_(s.chunks()) {}

  core::status run() {
    if (p_ < 1 || m_ < 1 || s_.virtual_stages < 1)
      return core::error::make(header() + "needs p, m and v of at least 1");
    if (static_cast<int>(s_.ranks.size()) != p_)
      return core::error::make(header() + "has " + std::to_string(s_.ranks.size()) +
                                   " rank lists for p = " + std::to_string(p_) + " ranks",
                               "give one instruction list per pipeline rank");
    for (auto check : {&checker::structure, &checker::completeness, &checker::local_order,
                       &checker::microbatch_order, &checker::transfers, &checker::transfer_order,
                       &checker::reduction_and_step, &checker::progress}) {
      if (auto err = (this->*check)()) return *err;
    }
    return core::status::success();
  }

 private:
  using problem = std::optional<core::error>;

  std::string header() const {
    return "schedule '" + s_.name + "' (p=" + std::to_string(p_) + ", m=" + std::to_string(m_) +
           ", v=" + std::to_string(s_.virtual_stages) + ") ";
  }
  std::string op_at(site at) const {
    if (at.step < static_cast<int>(s_.ranks[at.rank].size())) return to_string(s_.ranks[at.rank][at.step]);
    return "(end)";
  }
  core::error fail(std::vector<site> marks, const std::string& why, std::string hint = {},
                   bool name_cell = true) const {
    std::string text = header() + "is invalid: ";
    if (!marks.empty() && name_cell)
      text += "rank " + std::to_string(marks[0].rank) + ", step " + std::to_string(marks[0].step) +
              ", " + op_at(marks[0]) + ": ";
    text += why + "\n";
    std::vector<grid_mark> gm;
    for (auto& at : marks) gm.push_back({at.rank, at.step});
    text += format_grid(s_, gm);
    text.pop_back();  // the grid's last newline; the hint follows on its own line
    return core::error::make(std::move(text), std::move(hint));
  }
  site& at(int slot, int c, int j) { return sites_[slot][static_cast<std::size_t>(c) * m_ + j]; }
  site end_of(int r) const { return {r, static_cast<int>(s_.ranks[r].size())}; }
  std::string name(op_kind k, int c, int j, int peer = -1) const {
    return to_string(instruction{c, k, j, peer});
  }

  problem structure() {
    for (auto& v : sites_) v.assign(static_cast<std::size_t>(chunks_) * m_, site{});
    reduce_.assign(chunks_, site{});
    for (int r = 0; r < p_; ++r) {
      const auto& list = s_.ranks[r];
      for (int k = 0; k < static_cast<int>(list.size()); ++k) {
        const instruction& op = list[k];
        const site here{r, k};
        if (op.kind == op_kind::STEP) continue;
        if (op.chunk < 0 || op.chunk >= chunks_)
          return fail({here}, "chunk " + std::to_string(op.chunk) + " does not exist: the schedule has p*v = " +
                                  std::to_string(chunks_) + " chunks, 0.." + std::to_string(chunks_ - 1));
        if (s_.rank_of(op.chunk) != r)
          return fail({here}, "chunk " + std::to_string(op.chunk) + " lives on rank " +
                                  std::to_string(s_.rank_of(op.chunk)) + ", not on rank " + std::to_string(r),
                      "rank r holds chunks r, r+p, r+2p, ...");
        if (op.kind == op_kind::REDUCE_GRAD) {
          site& slot = reduce_[op.chunk];
          if (slot.found())
            return fail({slot, here}, "chunk " + std::to_string(op.chunk) + " reduces its gradients twice");
          slot = here;
          continue;
        }
        if (op.mb < 0 || op.mb >= m_)
          return fail({here}, "micro-batch " + std::to_string(op.mb) + " does not exist: m = " + std::to_string(m_));
        if (is_transfer(op.kind)) {
          const bool forward = op.kind == op_kind::SEND_F || op.kind == op_kind::RECV_F;
          const bool towards_end = op.kind == op_kind::SEND_F || op.kind == op_kind::RECV_B;
          const int other = op.chunk + (towards_end ? 1 : -1);
          if (other < 0 || other >= chunks_)
            return fail({here}, std::string("chunk ") + std::to_string(op.chunk) + " is the " +
                                    (other < 0 ? "first" : "last") + " chunk: there is no chunk " +
                                    std::to_string(other) + " to " + (is_send(op.kind) ? "send " : "receive ") +
                                    (forward ? "activations" : "gradients") + (is_send(op.kind) ? " to" : " from"));
          const int expected = s_.rank_of(other);
          if (expected == r)
            return fail({here}, "chunks " + std::to_string(op.chunk) + " and " + std::to_string(other) +
                                    " both live on rank " + std::to_string(r) +
                                    ": data between them moves without a transfer");
          if (op.peer != expected)
            return fail({here}, "the peer is rank " + std::to_string(op.peer) + ", but chunk " +
                                    std::to_string(other) + " lives on rank " + std::to_string(expected));
        }
        site& slot = at(slot_of(op.kind), op.chunk, op.mb);
        if (slot.found())
          return fail({slot, here}, to_string(op) + " appears twice (rank " + std::to_string(slot.rank) +
                                        " step " + std::to_string(slot.step) + " and rank " +
                                        std::to_string(r) + " step " + std::to_string(k) + ")",
                      "every micro-batch passes each chunk once per step");
        slot = here;
      }
    }
    return std::nullopt;
  }

  problem completeness() {
    for (int c = 0; c < chunks_; ++c)
      for (int j = 0; j < m_; ++j) {
        const site f = at(F, c, j), b = at(B, c, j), i = at(I, c, j), w = at(W, c, j);
        if (!f.found()) {
          for (site other : {b, i, w})
            if (other.found())
              return fail({other}, "a backward of micro-batch " + std::to_string(j) + " on chunk " +
                                       std::to_string(c) + " without its forward " + name(op_kind::F, c, j));
          return fail({end_of(s_.rank_of(c))}, "chunk " + std::to_string(c) + " never runs micro-batch " +
                                                   std::to_string(j) + ": no " + name(op_kind::F, c, j) +
                                                   " on rank " + std::to_string(s_.rank_of(c)));
        }
        if (!b.found() && !i.found())
          return fail({f}, "micro-batch " + std::to_string(j) + " is never backwarded on chunk " +
                               std::to_string(c) + ": no " + name(op_kind::B, c, j) + " (nor " +
                               name(op_kind::I, c, j) + " and " + name(op_kind::W, c, j) + ")",
                      "every forward needs its backward in the same step");
        if (b.found() && (i.found() || w.found()))
          return fail({b, i.found() ? i : w}, "chunk " + std::to_string(c) + " runs micro-batch " +
                                                  std::to_string(j) + "'s backward both whole (B) and split (I/W)");
        if (i.found() && !w.found())
          return fail({i}, name(op_kind::I, c, j) + " has no " + name(op_kind::W, c, j) +
                               ": the weight gradient of micro-batch " + std::to_string(j) + " would be lost");
        if (w.found() && !i.found())
          return fail({w}, name(op_kind::W, c, j) + " has no " + name(op_kind::I, c, j) + " before it");
      }
    return std::nullopt;
  }

  problem local_order() {
    for (int c = 0; c < chunks_; ++c)
      for (int j = 0; j < m_; ++j) {
        const site f = at(F, c, j), back = at(B, c, j).found() ? at(B, c, j) : at(I, c, j);
        if (back.step < f.step)
          return fail({back, f}, op_at(back) + " runs before its forward " + op_at(f));
        const site i = at(I, c, j), w = at(W, c, j);
        if (i.found() && w.step < i.step)
          return fail({w, i}, op_at(w) + " runs before " + op_at(i) + ", whose results it needs");
      }
    return std::nullopt;
  }

  problem microbatch_order() {
    if (!options_.require_microbatch_order) return std::nullopt;
    for (int r = 0; r < p_; ++r) {
      std::map<std::pair<int, op_kind>, int> last;  // (chunk, kind) -> last micro-batch seen
      for (int k = 0; k < static_cast<int>(s_.ranks[r].size()); ++k) {
        const instruction& op = s_.ranks[r][k];
        if (op.kind != op_kind::B && op.kind != op_kind::I && op.kind != op_kind::W) continue;
        auto [it, fresh] = last.try_emplace({op.chunk, op.kind}, op.mb);
        if (!fresh && op.mb < it->second)
          return fail({{r, k}}, "chunk " + std::to_string(op.chunk) + " runs " + std::string(kind_name(op.kind)) +
                                    " of micro-batch " + std::to_string(op.mb) + " after micro-batch " +
                                    std::to_string(it->second) +
                                    "; gradients must accumulate in micro-batch order 0, 1, 2, ... for "
                                    "bit-exact results",
                      "keep each chunk's backwards in micro-batch order, or set "
                      "allow_any_backward_order for a custom schedule");
        it->second = std::max(it->second, op.mb);
      }
    }
    return std::nullopt;
  }

  // One cross-rank dependency: the producer's send and the consumer's receive must both exist, the
  // send after the producer and the receive before the consumer.
  problem edge(site producer, int send_slot, int recv_slot, site consumer, int send_chunk, int recv_chunk, int j,
               op_kind send_kind, op_kind recv_kind) {
    const int a = s_.rank_of(send_chunk), b = s_.rank_of(recv_chunk);
    const site send = at(send_slot, send_chunk, j), recv = at(recv_slot, recv_chunk, j);
    const std::string send_name = name(send_kind, send_chunk, j, b), recv_name = name(recv_kind, recv_chunk, j, a);
    if (send.found() && !recv.found())
      return fail({send}, "a send without its receive: rank " + std::to_string(b) + " has no " + recv_name,
                  "add " + recv_name + " to rank " + std::to_string(b) + " before " + op_at(consumer));
    if (recv.found() && !send.found())
      return fail({recv}, "a receive without its send: rank " + std::to_string(a) + " has no " + send_name,
                  "add " + send_name + " to rank " + std::to_string(a) + " after " + op_at(producer));
    if (!send.found())
      return fail({consumer}, "needs data from rank " + std::to_string(a) + ", but no transfer carries it: no " +
                                  send_name + " and no " + recv_name,
                  "add both, or leave every transfer out and let lowering insert them");
    if (send.step < producer.step)
      return fail({send, producer}, send_name + " sends before " + op_at(producer) + " has produced the data");
    if (recv.step > consumer.step)
      return fail({consumer, recv}, op_at(consumer) + " runs before its data arrives with " + recv_name);
    return std::nullopt;
  }

  problem transfers() {
    if (!has_transfers(s_)) return std::nullopt;
    for (int c = 0; c + 1 < chunks_; ++c) {
      if (s_.rank_of(c) == s_.rank_of(c + 1)) continue;
      for (int j = 0; j < m_; ++j) {
        if (auto e = edge(at(F, c, j), SEND_F, RECV_F, at(F, c + 1, j), c, c + 1, j, op_kind::SEND_F,
                          op_kind::RECV_F))
          return e;
        const site grad = at(B, c + 1, j).found() ? at(B, c + 1, j) : at(I, c + 1, j);
        const site use = at(B, c, j).found() ? at(B, c, j) : at(I, c, j);
        if (auto e = edge(grad, SEND_B, RECV_B, use, c + 1, c, j, op_kind::SEND_B, op_kind::RECV_B)) return e;
      }
    }
    return std::nullopt;
  }

  // Point-to-point transfers meet in order: the k-th send from a to b carries what the k-th receive
  // on b from a expects, or NCCL would deliver the wrong tensor (or hang on a size mismatch).
  problem transfer_order() {
    std::map<std::pair<int, int>, std::vector<site>> sends, recvs;  // (from, to) -> sites in order
    for (int r = 0; r < p_; ++r)
      for (int k = 0; k < static_cast<int>(s_.ranks[r].size()); ++k) {
        const instruction& op = s_.ranks[r][k];
        if (!is_transfer(op.kind)) continue;
        if (is_send(op.kind)) sends[{r, op.peer}].push_back({r, k});
        else recvs[{op.peer, r}].push_back({r, k});
      }
    for (auto& [route, list] : sends) {
      const auto& other = recvs[route];
      for (std::size_t n = 0; n < list.size() && n < other.size(); ++n) {
        const instruction& send = s_.ranks[list[n].rank][list[n].step];
        const instruction& recv = s_.ranks[other[n].rank][other[n].step];
        const bool forward = send.kind == op_kind::SEND_F;
        const bool match = recv.kind == (forward ? op_kind::RECV_F : op_kind::RECV_B) && recv.mb == send.mb &&
                           recv.chunk == send.chunk + (forward ? 1 : -1);
        if (!match)
          return fail({list[n], other[n]},
                      "transfer " + std::to_string(n) + " from rank " + std::to_string(route.first) + " to rank " +
                          std::to_string(route.second) + " is " + to_string(send) + " on the sender but " +
                          to_string(recv) +
                          " on the receiver; point-to-point transfers between two ranks meet in order",
                      "order rank " + std::to_string(route.second) + "'s receives from rank " +
                          std::to_string(route.first) + " like rank " + std::to_string(route.first) + "'s sends");
      }
    }
    return std::nullopt;
  }

  problem reduction_and_step() {
    const bool any_reduce = std::any_of(reduce_.begin(), reduce_.end(), [](site x) { return x.found(); });
    if (any_reduce)
      for (int c = 0; c < chunks_; ++c) {
        const int r = s_.rank_of(c);
        if (!reduce_[c].found())
          return fail({end_of(r)}, "chunk " + std::to_string(c) + " never reduces its gradients: no " +
                                       std::to_string(c) + "REDUCE_GRAD on rank " + std::to_string(r),
                      "give every chunk one REDUCE_GRAD, or none and let lowering insert them");
        for (int j = 0; j < m_; ++j) {
          const site last = at(W, c, j).found() ? at(W, c, j) : at(B, c, j);
          if (last.step > reduce_[c].step)
            return fail({reduce_[c], last}, "reduces chunk " + std::to_string(c) + "'s gradients before " +
                                                op_at(last) + " has added to them");
        }
      }
    int with_step = 0;
    for (int r = 0; r < p_; ++r) {
      const auto& list = s_.ranks[r];
      for (int k = 0; k < static_cast<int>(list.size()); ++k)
        if (list[k].kind == op_kind::STEP) {
          if (k + 1 != static_cast<int>(list.size()))
            return fail({{r, k}}, "STEP must be the rank's last instruction");
          ++with_step;
        }
    }
    if (with_step > 0 && with_step < p_)
      for (int r = 0; r < p_; ++r)
        if (s_.ranks[r].empty() || s_.ranks[r].back().kind != op_kind::STEP)
          return fail({end_of(r)}, "rank " + std::to_string(r) + " has no STEP while other ranks do");
    return std::nullopt;
  }

  problem progress() {
    if (!options_.check_progress) return std::nullopt;
    const execution run = execute(s_, cost_model{});
    if (run.complete()) return std::nullopt;
    std::vector<site> marks;
    for (auto& st : run.stuck) marks.push_back({st.rank, st.step});
    const bool blocking = has_transfers(s_);
    auto e = fail(marks, run.describe_deadlock(),
                  blocking ? "with blocking in-order transfers, two ranks that send to each other first "
                             "both wait; put one rank's receive before its send"
                           : "reorder the lists so that every instruction's input is produced earlier",
                  false);
    return e;
  }

  const schedule& s_;
  const validate_options& options_;
  const int p_, m_, chunks_;
  std::array<std::vector<site>, slots> sites_;
  std::vector<site> reduce_;
};

}  // namespace

core::status validate(const schedule& s, const validate_options& options) { return checker(s, options).run(); }

}  // namespace troupe::schedules
