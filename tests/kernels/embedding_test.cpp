// embedding_forward / embedding_backward on the CPU backend.
#include <algorithm>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {
namespace {

// out[r] = wte[tok[r]] + wpe[r % seq] (wpe optional) in float64.
vec embedding_ref(const std::vector<int>& tok, const vec& wte, const vec* wpe, int seq, int ch) {
  vec out(tok.size() * ch);
  for (std::size_t r = 0; r < tok.size(); ++r)
    for (int j = 0; j < ch; ++j)
      out[r * ch + j] = wte[tok[r] * ch + j] + (wpe ? (*wpe)[(r % seq) * ch + j] : 0.0);
  return out;
}

std::vector<int> ints(const tensor& t) {
  return std::vector<int>(t.data<std::int32_t>(), t.data<std::int32_t>() + t.numel());
}

}  // namespace

TEST_CASE("embedding forward adds token and position rows, position = row % seq") {
  auto be = make_backend("cpu");
  const int vocab = 11, ch = 6, seq = 4, batch = 3;
  tensor tok = random_tokens(batch * seq, vocab, 1);
  tensor wte = randn({vocab, ch}, 2), wpe = randn({seq + 2, ch}, 3);  // wpe may be longer than seq
  tensor out = be->empty({batch * seq, ch}, dtype::f32);
  be->embedding_forward(tok, wte, wpe, seq, out);
  const vec pv = to_vec(wpe);
  check_close(out, embedding_ref(ints(tok), to_vec(wte), &pv, seq, ch), 1.2e-7, 0, "out with wpe");
  be->embedding_forward(tok, wte, tensor(), seq, out);
  check_close(out, embedding_ref(ints(tok), to_vec(wte), nullptr, seq, ch), 0, 0,
              "out without wpe");
}

TEST_CASE("embedding backward matches central differences and adds repeated tokens") {
  auto be = make_backend("cpu");
  const int vocab = 5, ch = 3, seq = 4, batch = 2;
  // Token 1 appears three times, so its row must receive three rows of dout.
  tensor tok = tensor::zeros({batch * seq}, dtype::i32);
  const int ids[] = {1, 3, 1, 0, 4, 1, 2, 3};
  std::copy(ids, ids + batch * seq, tok.data<std::int32_t>());
  tensor wte = randn({vocab, ch}, 4), wpe = randn({seq, ch}, 5), dout = randn({batch * seq, ch}, 6);
  const vec tev = to_vec(wte), pev = to_vec(wpe), dv = to_vec(dout);
  const auto t = ints(tok);
  const vec want_te =
      numeric_grad([&](const vec& v) { return embedding_ref(t, v, &pev, seq, ch); }, tev, dv);
  const vec want_pe =
      numeric_grad([&](const vec& v) { return embedding_ref(t, tev, &v, seq, ch); }, pev, dv);
  tensor dwte = randn({vocab, ch}, 7), dwpe = randn({seq, ch}, 8);
  const vec te0 = to_vec(dwte), pe0 = to_vec(dwpe);
  be->embedding_backward(dout, tok, seq, dwte, dwpe);
  check_close(dwte, plus(te0, want_te), 1e-6, 1e-6, "dwte");
  check_close(dwpe, plus(pe0, want_pe), 1e-6, 1e-6, "dwpe");
}

TEST_CASE("embedding backward over 2B rows equals two calls over B rows, with any thread count") {
  auto be = make_backend("cpu");
  const int vocab = 50, ch = 256, seq = 64, batch = 8;
  tensor tok = random_tokens(batch * seq, vocab, 9);
  tensor dout = randn({batch * seq, ch}, 10);
  auto run = [&](bool split) {
    tensor dwte = randn({vocab, ch}, 11), dwpe = randn({seq, ch}, 12);
    if (split) {
      const int half = batch * seq / 2;
      tensor t0 = tok.rows(0, half), t1 = tok.rows(half, 2 * half);
      be->embedding_backward(dout.rows(0, half), t0, seq, dwte, dwpe);
      be->embedding_backward(dout.rows(half, 2 * half), t1, seq, dwte, dwpe);
    } else {
      be->embedding_backward(dout, tok, seq, dwte, dwpe);
    }
    return std::pair{dwte, dwpe};
  };
  std::pair<tensor, tensor> one, two, split;
  with_threads(1, [&] { one = run(false); });
  with_threads(2, [&] {
    two = run(false);
    split = run(true);
  });
  CHECK(same_bits(one.first, two.first));
  CHECK(same_bits(one.second, two.second));
  CHECK(same_bits(two.first, split.first));
  CHECK(same_bits(two.second, split.second));
}

TEST_CASE("embedding rejects tokens outside the vocabulary and mismatched shapes") {
  auto be = make_backend("cpu");
  tensor tok = tensor::zeros({4}, dtype::i32);
  tok.data<std::int32_t>()[2] = 9;
  tensor wte = randn({9, 3}, 1), out = be->empty({4, 3}, dtype::f32);
  const std::string msg =
      failure_message([&] { be->embedding_forward(tok, wte, tensor(), 2, out); });
  CHECK(msg.find("token 9 at row 2") != std::string::npos);
  tok.data<std::int32_t>()[2] = 0;
  tensor narrow = be->empty({4, 2}, dtype::f32);
  const std::string shape_msg =
      failure_message([&] { be->embedding_forward(tok, wte, tensor(), 2, narrow); });
  CHECK(shape_msg.find("embedding_forward: out must be [4, 3]") != std::string::npos);
  CHECK(shape_msg.find("out fp32 [4, 2]") != std::string::npos);
  CHECK(failure_message([&] {
          be->embedding_forward(tok, wte, tensor(), 3, out);
        }).find("multiple of seq = 3") != std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
