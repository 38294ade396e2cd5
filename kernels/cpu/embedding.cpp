// Token (+ learned position) embedding: out[r] = wte[tokens[r]] (+ wpe[r % T]); for generation,
// at explicit positions: + wpe[positions[r]].
//
// The backward scatters rows into the tables. Two rows may hit the same table row (a repeated
// token; every batch for the positions), so threads take column ranges, not rows, and each table
// element receives its rows in row order: the result is the same for any thread count, and one
// call over 2B rows equals two calls over B rows each.
#include <algorithm>
#include <string>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

// Throws unless every token indexes a row of a table with `vocab` rows.
void check_tokens(const char* op, const std::int32_t* tok, std::int64_t n, std::int64_t vocab) {
  for (std::int64_t r = 0; r < n; ++r)
    if (tok[r] < 0 || tok[r] >= vocab)
      throw core::failure(std::string(op) + ": token " + std::to_string(tok[r]) + " at row " +
                          std::to_string(r) + " is outside the vocabulary [0, " +
                          std::to_string(vocab) +
                          ") (hint: the data was tokenized with a different vocabulary than "
                          "model.vocab_size)");
}

/// dwte[tok[r]] += dout[r] (when te) and dwpe[position(r)] += dout[r] (when pe) for every row r,
/// split over columns so that rows sharing a token or position add in row order (same bits for
/// any thread count).
template <class Position>
void add_rows(const float* d, const std::int32_t* tok, float* te, float* pe, std::int64_t n,
              std::int64_t ch, Position position) {
  parallel_for(ch, std::max<std::int64_t>(16, (1 << 15) / std::max<std::int64_t>(n, 1)),
               [&](std::int64_t c0, std::int64_t c1) {
                 for (std::int64_t r = 0; r < n; ++r) {
                   const float* src = d + r * ch;
                   if (te) {
                     float* dst = te + tok[r] * ch;
                     for (std::int64_t j = c0; j < c1; ++j) dst[j] += src[j];
                   }
                   if (pe) {
                     float* dst = pe + position(r) * ch;
                     for (std::int64_t j = c0; j < c1; ++j) dst[j] += src[j];
                   }
                 }
               });
}
}  // namespace

void cpu_backend::embedding_forward(const tensor& tokens, const tensor& wte, const tensor& wpe,
                                    int seq, tensor& out) {
  op_check c("embedding_forward",
             {{"tokens", &tokens}, {"wte", &wte}, {"wpe", &wpe}, {"out", &out}});
  c.host(tokens, "tokens", core::dtype::i32);
  c.host(wte, "wte", core::dtype::f32);
  c.optional(wpe, "wpe", core::dtype::f32);
  c.host(out, "out", core::dtype::f32);
  c.require(wte.rank() == 2, "wte must be [V, C]");
  const std::int64_t vocab = wte.dim(0), ch = wte.dim(1), n = tokens.numel();
  c.require(seq > 0 && n % seq == 0,
            "the token count must be a multiple of seq = " + std::to_string(seq));
  c.matrix(out, "out", n, ch, "one row per token, C = wte.dim(1)");
  if (wpe.defined())
    c.require(wpe.rank() == 2 && wpe.dim(0) >= seq && wpe.dim(1) == ch,
              "wpe must be [P, C] with P >= seq = " + std::to_string(seq) + " and C = wte.dim(1)");
  const std::int32_t* tok = tokens.data<std::int32_t>();
  check_tokens("embedding_forward", tok, n, vocab);
  const float* te = wte.data<float>();
  const float* pe = wpe.defined() ? wpe.data<float>() : nullptr;
  float* o = out.data<float>();
  parallel_for(n, std::max<std::int64_t>(1, (1 << 15) / std::max<std::int64_t>(ch, 1)),
               [&](std::int64_t r0, std::int64_t r1) {
                 for (std::int64_t r = r0; r < r1; ++r) {
                   const float* t = te + tok[r] * ch;
                   float* dst = o + r * ch;
                   if (pe) {
                     const float* p = pe + (r % seq) * ch;
                     for (std::int64_t j = 0; j < ch; ++j) dst[j] = t[j] + p[j];
                   } else {
                     std::copy(t, t + ch, dst);
                   }
                 }
               });
}

void cpu_backend::embedding_forward_at(const tensor& tokens, const tensor& wte, const tensor& wpe,
                                       const tensor& positions, tensor& out) {
  op_check c("embedding_forward_at", {{"tokens", &tokens},
                                      {"wte", &wte},
                                      {"wpe", &wpe},
                                      {"positions", &positions},
                                      {"out", &out}});
  c.host(tokens, "tokens", core::dtype::i32);
  c.host(positions, "positions", core::dtype::i32);
  c.host(wte, "wte", core::dtype::f32);
  c.optional(wpe, "wpe", core::dtype::f32);
  c.host(out, "out", core::dtype::f32);
  c.require(wte.rank() == 2, "wte must be [V, C]");
  const std::int64_t vocab = wte.dim(0), ch = wte.dim(1), n = tokens.numel();
  c.numel(positions, "positions", n, "one position per token");
  c.matrix(out, "out", n, ch, "one row per token, C = wte.dim(1)");
  if (wpe.defined()) c.require(wpe.rank() == 2 && wpe.dim(1) == ch, "wpe must be [P, C]");
  const std::int32_t* tok = tokens.data<std::int32_t>();
  const std::int32_t* pos = positions.data<std::int32_t>();
  check_tokens("embedding_forward_at", tok, n, vocab);
  if (wpe.defined())
    for (std::int64_t r = 0; r < n; ++r)
      c.require(pos[r] >= 0 && pos[r] < wpe.dim(0),
                "position " + std::to_string(pos[r]) + " at row " + std::to_string(r) +
                    " is outside wpe's " + std::to_string(wpe.dim(0)) + " rows");
  const float* te = wte.data<float>();
  const float* pe = wpe.defined() ? wpe.data<float>() : nullptr;
  float* o = out.data<float>();
  for (std::int64_t r = 0; r < n; ++r) {
    const float* t = te + tok[r] * ch;
    float* dst = o + r * ch;
    if (pe) {
      const float* p = pe + static_cast<std::int64_t>(pos[r]) * ch;
      for (std::int64_t j = 0; j < ch; ++j) dst[j] = t[j] + p[j];
    } else {
      std::copy(t, t + ch, dst);
    }
  }
}

void cpu_backend::embedding_backward(const tensor& dout, const tensor& tokens, int seq,
                                     tensor& dwte, tensor& dwpe) {
  op_check c("embedding_backward",
             {{"dout", &dout}, {"tokens", &tokens}, {"dwte", &dwte}, {"dwpe", &dwpe}});
  c.host(dout, "dout", core::dtype::f32);
  c.host(tokens, "tokens", core::dtype::i32);
  c.optional(dwte, "dwte", core::dtype::f32);
  c.optional(dwpe, "dwpe", core::dtype::f32);
  const std::int64_t n = tokens.numel();
  c.require(seq > 0 && n % seq == 0,
            "the token count must be a multiple of seq = " + std::to_string(seq));
  c.require(dout.rank() >= 1 && rows_of(dout) == n, "dout must be [N, C], one row per token");
  const std::int64_t ch = dout.dim(-1);
  if (dwte.defined())
    c.require(dwte.rank() == 2 && dwte.dim(1) == ch, "dwte must be [V, C] with C = dout.dim(-1)");
  if (dwpe.defined())
    c.require(
        dwpe.rank() == 2 && dwpe.dim(0) >= seq && dwpe.dim(1) == ch,
        "dwpe must be [P, C] with P >= seq = " + std::to_string(seq) + " and C = dout.dim(-1)");
  const std::int32_t* tok = tokens.data<std::int32_t>();
  if (dwte.defined()) check_tokens("embedding_backward", tok, n, dwte.dim(0));
  const float* d = dout.data<float>();
  float* te = dwte.defined() ? dwte.data<float>() : nullptr;
  float* pe = dwpe.defined() ? dwpe.data<float>() : nullptr;
  add_rows(d, tok, te, pe, n, ch, [seq](std::int64_t r) { return r % seq; });
}

}  // namespace troupe::kernels::cpu

namespace troupe::kernels::cpu {

void cpu_backend::embedding_backward_at(const tensor& dout, const tensor& tokens,
                                        const tensor& positions, tensor& dwte, tensor& dwpe) {
  op_check c("embedding_backward_at", {{"dout", &dout},
                                       {"tokens", &tokens},
                                       {"positions", &positions},
                                       {"dwte", &dwte},
                                       {"dwpe", &dwpe}});
  c.host(dout, "dout", core::dtype::f32);
  c.host(tokens, "tokens", core::dtype::i32);
  c.host(positions, "positions", core::dtype::i32);
  c.optional(dwte, "dwte", core::dtype::f32);
  c.optional(dwpe, "dwpe", core::dtype::f32);
  const std::int64_t n = tokens.numel();
  c.numel(positions, "positions", n, "one position per token");
  c.require(dout.rank() >= 1 && rows_of(dout) == n, "dout must be [N, C], one row per token");
  const std::int64_t ch = dout.dim(-1);
  if (dwte.defined())
    c.require(dwte.rank() == 2 && dwte.dim(1) == ch, "dwte must be [V, C] with C = dout.dim(-1)");
  const std::int32_t* pos = positions.data<std::int32_t>();
  if (dwpe.defined()) {
    c.require(dwpe.rank() == 2 && dwpe.dim(1) == ch, "dwpe must be [P, C] with C = dout.dim(-1)");
    for (std::int64_t r = 0; r < n; ++r)
      c.require(pos[r] >= 0 && pos[r] < dwpe.dim(0),
                "position " + std::to_string(pos[r]) + " at row " + std::to_string(r) +
                    " is outside dwpe's " + std::to_string(dwpe.dim(0)) + " rows");
  }
  const std::int32_t* tok = tokens.data<std::int32_t>();
  if (dwte.defined()) check_tokens("embedding_backward_at", tok, n, dwte.dim(0));
  const float* d = dout.data<float>();
  float* te = dwte.defined() ? dwte.data<float>() : nullptr;
  float* pe = dwpe.defined() ? dwpe.data<float>() : nullptr;
  add_rows(d, tok, te, pe, n, ch,
           [pos](std::int64_t r) { return static_cast<std::int64_t>(pos[r]); });
}

}  // namespace troupe::kernels::cpu
