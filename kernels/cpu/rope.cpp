// Rotary position embedding, rotate-half convention (Hugging Face LLaMA). In each rotated head of
// D elements, element i < D/2 pairs with i + D/2 and the pair turns by the angle of position
// t = row % T:
//   y[i]       = x[i] cos a - x[i+D/2] sin a
//   y[i+D/2]   = x[i+D/2] cos a + x[i] sin a,      a = t · f_i
// with f_i = theta^(-2i/D), or its llama3-scaled value (kernels/rope_freq.hpp). The backward
// applies the transpose (the inverse rotation) to dy. rope_forward_at (generation) takes each
// row's position from a tensor instead of row % T.
//
// The angles are computed in double and rounded once to float:
//   cos_ti = (float) cos((double) t * f_i),  sin likewise,
// so a GPU computing the same double expression gets the same table (Hugging Face's own fp32
// angles differ from it by up to ~1e-4 rad at t ~ 1000, fp32 rounding of t · inv_freq). The
// table for (T, D, rope) is built once per backend and reused.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/parallel.hpp"

namespace troupe::kernels::cpu {
namespace {

constexpr std::size_t max_cached_tables = 8;

// Shape checks shared by forward and backward; returns the row count.
std::int64_t check_rope(const op_check& c, const tensor& x, const char* x_name, const tensor& y,
                        const char* y_name, int seq, int heads_total, int rot_heads, int head_dim) {
  c.host(x, x_name, core::dtype::f32);
  c.host(y, y_name, core::dtype::f32);
  c.require(head_dim > 0 && head_dim % 2 == 0,
            "head_dim must be even and positive, got " + std::to_string(head_dim));
  c.require(heads_total > 0 && rot_heads >= 0 && rot_heads <= heads_total,
            "0 <= rot_heads <= heads_total is required, got rot_heads = " +
                std::to_string(rot_heads) + ", heads_total = " + std::to_string(heads_total));
  const std::int64_t width = static_cast<std::int64_t>(heads_total) * head_dim;
  c.require(x.rank() >= 1 && x.dim(-1) == width, std::string(x_name) +
                                                     " must be [N, heads_total * head_dim] = [N, " +
                                                     std::to_string(width) + "]");
  const std::int64_t n = rows_of(x);
  c.require(seq > 0 && n % seq == 0,
            "the row count must be a multiple of seq = " + std::to_string(seq));
  c.matrix(y, y_name, n, width, std::string("the shape of ") + x_name);
  return n;
}

// Turns the first rot_heads heads of one row of `width` elements by the angles (cs, sn) of the
// row's position; the remaining heads are copied. xr == yr is allowed.
void rotate_row(const float* xr, float* yr, const float* cs, const float* sn, int rot_heads,
                int head_dim, std::int64_t width) {
  const int half = head_dim / 2;
  for (int h = 0; h < rot_heads; ++h) {
    const float* a = xr + h * head_dim;
    float* b = yr + h * head_dim;
    for (int i = 0; i < half; ++i) {
      const float x1 = a[i], x2 = a[i + half];
      b[i] = x1 * cs[i] - x2 * sn[i];
      b[i + half] = x2 * cs[i] + x1 * sn[i];
    }
  }
  if (yr != xr) std::copy(xr + rot_heads * head_dim, xr + width, yr + rot_heads * head_dim);
}

/// The largest of the n positions; every one must be non-negative.
int max_position(const op_check& c, const std::int32_t* pos, std::int64_t n) {
  std::int32_t top = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    c.require(pos[r] >= 0, "positions must not be negative, got " + std::to_string(pos[r]) +
                               " at row " + std::to_string(r));
    top = std::max(top, pos[r]);
  }
  return static_cast<int>(top);
}

}  // namespace

std::shared_ptr<const cpu_backend::rope_table> cpu_backend::rope_angles(int seq, int head_dim,
                                                                        const rope_spec& rope) {
  std::lock_guard<std::mutex> lk(rope_mu_);
  for (const auto& t : rope_tables_)
    if (t->seq >= seq && t->head_dim == head_dim && t->rope == rope) return t;
  auto t = std::make_shared<rope_table>();
  t->seq = seq;
  t->head_dim = head_dim;
  t->rope = rope;
  const int half = head_dim / 2;
  t->cos.resize(static_cast<std::size_t>(seq) * half);
  t->sin.resize(static_cast<std::size_t>(seq) * half);
  for (int i = 0; i < half; ++i) {
    const double inv_freq = rope_inv_freq(rope, i, head_dim);
    for (int p = 0; p < seq; ++p) {
      const double a = static_cast<double>(p) * inv_freq;
      t->cos[static_cast<std::size_t>(p) * half + i] = static_cast<float>(std::cos(a));
      t->sin[static_cast<std::size_t>(p) * half + i] = static_cast<float>(std::sin(a));
    }
  }
  if (rope_tables_.size() == max_cached_tables) rope_tables_.erase(rope_tables_.begin());
  rope_tables_.push_back(t);
  return t;
}

void cpu_backend::rope_forward(const tensor& x, int seq, int heads_total, int rot_heads,
                               int head_dim, const rope_spec& rope, tensor& y) {
  op_check c("rope_forward", {{"x", &x}, {"y", &y}});
  const std::int64_t n = check_rope(c, x, "x", y, "y", seq, heads_total, rot_heads, head_dim);
  const auto table = rope_angles(seq, head_dim, rope);
  const std::int64_t width = static_cast<std::int64_t>(heads_total) * head_dim;
  const int half = head_dim / 2;
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_for(n, std::max<std::int64_t>(1, (1 << 14) / width),
               [&](std::int64_t r0, std::int64_t r1) {
                 for (std::int64_t r = r0; r < r1; ++r)
                   rotate_row(xp + r * width, yp + r * width, table->cos.data() + (r % seq) * half,
                              table->sin.data() + (r % seq) * half, rot_heads, head_dim, width);
               });
}

void cpu_backend::rope_forward_at(const tensor& x, const tensor& positions, int heads_total,
                                  int rot_heads, int head_dim, const rope_spec& rope, tensor& y) {
  op_check c("rope_forward_at", {{"x", &x}, {"positions", &positions}, {"y", &y}});
  c.host(positions, "positions", core::dtype::i32);
  const std::int64_t n = positions.numel();
  // seq = 1 makes the shared checks accept any row count; the row count is checked next.
  check_rope(c, x, "x", y, "y", 1, heads_total, rot_heads, head_dim);
  c.require(rows_of(x) == n, "one position per row of x");
  const std::int32_t* pos = positions.data<std::int32_t>();
  const auto table = rope_angles(max_position(c, pos, n) + 1, head_dim, rope);
  const std::int64_t width = static_cast<std::int64_t>(heads_total) * head_dim;
  const int half = head_dim / 2;
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t at = static_cast<std::int64_t>(pos[r]) * half;
    rotate_row(xp + r * width, yp + r * width, table->cos.data() + at, table->sin.data() + at,
               rot_heads, head_dim, width);
  }
}

// dx = Rᵀ dy for one row turned by (cs, sn) (dr may be gr); the heads past rot_heads pass dy
// through.
static void unrotate_row(const float* gr, float* dr, const float* cs, const float* sn, int rot_heads,
                  int head_dim, std::int64_t width) {
  const int half = head_dim / 2;
  for (int h = 0; h < rot_heads; ++h) {
    const float* g = gr + h * head_dim;
    float* d = dr + h * head_dim;
    for (int i = 0; i < half; ++i) {
      const float g1 = g[i], g2 = g[i + half];
      d[i] = g1 * cs[i] + g2 * sn[i];
      d[i + half] = g2 * cs[i] - g1 * sn[i];
    }
  }
  if (dr != gr)
    for (std::int64_t j = static_cast<std::int64_t>(rot_heads) * head_dim; j < width; ++j)
      dr[j] = gr[j];
}

void cpu_backend::rope_backward(const tensor& dy, int seq, int heads_total, int rot_heads,
                                int head_dim, const rope_spec& rope, tensor& dx) {
  op_check c("rope_backward", {{"dy", &dy}, {"dx", &dx}});
  const std::int64_t n = check_rope(c, dy, "dy", dx, "dx", seq, heads_total, rot_heads, head_dim);
  const auto table = rope_angles(seq, head_dim, rope);
  const std::int64_t width = static_cast<std::int64_t>(heads_total) * head_dim;
  const int half = head_dim / 2;
  const float* dyp = dy.data<float>();
  float* dxp = dx.data<float>();
  parallel_for(
      n, std::max<std::int64_t>(1, (1 << 14) / width), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r)
          unrotate_row(dyp + r * width, dxp + r * width, table->cos.data() + (r % seq) * half,
                       table->sin.data() + (r % seq) * half, rot_heads, head_dim, width);
      });
}

void cpu_backend::rope_backward_at(const tensor& dy, const tensor& positions, int heads_total,
                                   int rot_heads, int head_dim, const rope_spec& rope, tensor& dx) {
  op_check c("rope_backward_at", {{"dy", &dy}, {"positions", &positions}, {"dx", &dx}});
  c.host(positions, "positions", core::dtype::i32);
  const std::int64_t n = positions.numel();
  check_rope(c, dy, "dy", dx, "dx", 1, heads_total, rot_heads, head_dim);
  c.require(rows_of(dy) == n, "one position per row of dy");
  const std::int32_t* pos = positions.data<std::int32_t>();
  const auto table = rope_angles(max_position(c, pos, n) + 1, head_dim, rope);
  const std::int64_t width = static_cast<std::int64_t>(heads_total) * head_dim;
  const int half = head_dim / 2;
  const float* dyp = dy.data<float>();
  float* dxp = dx.data<float>();
  parallel_for(
      n, std::max<std::int64_t>(1, (1 << 14) / width), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          const std::int64_t at = static_cast<std::int64_t>(pos[r]) * half;
          unrotate_row(dyp + r * width, dxp + r * width, table->cos.data() + at,
                       table->sin.data() + at, rot_heads, head_dim, width);
        }
      });
}

}  // namespace troupe::kernels::cpu
