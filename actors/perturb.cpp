#include "actors/perturb.hpp"

#include <cctype>
#include <cstdio>

#include "actors/recorder.hpp"

namespace troupe::actors {

core::result<std::shared_ptr<send_perturbation>> parse_perturbation(const std::string& spec,
                                                                    const std::string& source) {
  const auto a = spec.find(':');
  const auto b = a == std::string::npos ? a : spec.find(':', a + 1);
  auto digits = [&](std::size_t from, std::size_t to) {
    if (to <= from || to - from > 9) return false;
    for (std::size_t i = from; i < to; ++i)
      if (!std::isdigit(static_cast<unsigned char>(spec[i]))) return false;
    return true;
  };
  if (b == std::string::npos || !digits(0, a) || !digits(a + 1, b) || b + 1 >= spec.size())
    return core::error::make(source + "='" + spec + "' is not rank:step:instruction",
                             "e.g. " + source + "=3:1:1SEND_B2->0 flips one bit of the gradient "
                             "rank 3 sends for micro-batch 2 at step 1 (instructions as the "
                             "message logs write them, docs/replay.md)");
  auto p = std::make_shared<send_perturbation>();
  p->spec = spec;
  p->rank = std::stoi(spec.substr(0, a));
  p->step = std::stoll(spec.substr(a + 1, b - a - 1));
  p->op = spec.substr(b + 1);
  return p;
}

core::tensor perturb_send(send_perturbation& p, const address& from, int src, const address& to,
                          int dst, const transport::tag& tg, core::tensor t, kernels::backend* be) {
  if (src != p.rank || tg.step != p.step || !t.defined() || t.bytes() == 0) return t;
  if (producer_of(from, to, tg) != p.op) return t;
  if (p.done.exchange(true)) return t;
  // A copy: the sender may still hold the tensor (a saved activation, a snapshot sent twice).
  core::tensor host = t.dev().is_cpu() ? t.clone() : host_view(t, be);
  static_cast<unsigned char*>(host.raw())[0] ^= 1u;
  const message_record r = header_of(from, src, to, dst, tg);
  std::fprintf(stderr, "troupe: TROUPE_PERTURB_SEND=%s: flipped the lowest bit of byte 0 of %s\n",
               p.spec.c_str(), describe(r).c_str());
  std::fflush(stderr);
  if (t.dev().is_cpu()) return host;
  TROUPE_CHECK(be != nullptr, "a device tensor was perturbed without its backend");
  return be->from_host(host);
}

}  // namespace troupe::actors
