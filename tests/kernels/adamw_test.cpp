// adamw on the CPU backend, and adamw_runs_hashed's default (adamw_runs, then the hash blocks).
#include <cmath>

#include "tests/kernels/cpu_test_util.hpp"
#include "kernels/message_hash.hpp"
#include "kernels/select.hpp"

namespace troupe::kernels::cpu_test {

TEST_CASE("adamw follows the decoupled-weight-decay update over several steps") {
  auto be = make_backend("cpu");
  const int n = 300;
  tensor p = randn({n}, 1), m = be->empty({n}, dtype::f32), v = be->empty({n}, dtype::f32);
  vec pr = to_vec(p), mr(n, 0.0), vr(n, 0.0);
  adamw_params hp;
  hp.lr = 1e-2f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;
  hp.grad_scale = 0.5f;
  tensor none;
  for (int step = 1; step <= 4; ++step) {
    hp.step = step;
    tensor g = randn({n}, 10 + step);
    be->adamw(p, g, m, v, hp, none);
    const vec gv = to_vec(g);
    for (int i = 0; i < n; ++i) {
      const double gi = gv[i] * hp.grad_scale;
      mr[i] = hp.beta1 * mr[i] + (1 - hp.beta1) * gi;
      vr[i] = hp.beta2 * vr[i] + (1 - hp.beta2) * gi * gi;
      const double mhat = mr[i] / (1 - std::pow(hp.beta1, step));
      const double vhat = vr[i] / (1 - std::pow(hp.beta2, step));
      pr[i] -= hp.lr * (mhat / (std::sqrt(vhat) + hp.eps) + hp.weight_decay * pr[i]);
    }
  }
  check_close(p, pr, 1e-5, 1e-6, "param");
  check_close(m, mr, 1e-5, 1e-7, "m");
  check_close(v, vr, 1e-5, 1e-9, "v");
}

TEST_CASE("adamw with zero gradient only decays the weights") {
  auto be = make_backend("cpu");
  tensor p = randn({10}, 2), g = be->empty({10}, dtype::f32), m = be->empty({10}, dtype::f32),
         v = be->empty({10}, dtype::f32);
  const vec p0 = to_vec(p);
  adamw_params hp;
  hp.lr = 0.1f;
  hp.weight_decay = 0.5f;
  tensor none;
  be->adamw(p, g, m, v, hp, none);
  vec want = p0;
  for (auto& x : want) x *= 1 - 0.1 * 0.5;
  check_close(p, want, 1e-6, 0, "param");
}

TEST_CASE("adamw writes the updated params rounded to bf16 and fp16 into low") {
  auto be = make_backend("cpu");
  for (dtype t : {dtype::bf16, dtype::f16}) {
    tensor p = randn({100}, 3), g = randn({100}, 4), m = be->empty({100}, dtype::f32),
           v = be->empty({100}, dtype::f32);
    tensor low = be->empty({100}, t);
    adamw_params hp;
    hp.lr = 1e-3f;
    be->adamw(p, g, m, v, hp, low);
    for (int i = 0; i < 100; ++i) {
      const float want = t == dtype::bf16 ? core::bf16_to_f32(core::f32_to_bf16(p.data<float>()[i]))
                                          : core::f16_to_f32(core::f32_to_f16(p.data<float>()[i]));
      const std::uint16_t bits = low.data<std::uint16_t>()[i];
      CHECK((t == dtype::bf16 ? core::bf16_to_f32(bits) : core::f16_to_f32(bits)) == want);
    }
  }
}

TEST_CASE("adamw gives the same bits with 1 or 2 threads") {
  auto be = make_backend("cpu");
  const int n = 1 << 18;
  tensor g = randn({n}, 5);
  auto run = [&] {
    tensor p = randn({n}, 6), m = randn({n}, 7, 0.01f), v = be->empty({n}, dtype::f32), none;
    adamw_params hp;
    hp.lr = 3e-3f;
    hp.weight_decay = 0.1f;
    hp.step = 3;
    be->adamw(p, g, m, v, hp, none);
    return std::vector<tensor>{p, m, v};
  };
  check_same_bits_any_threads(run);
}

TEST_CASE("adamw rejects mismatched sizes and step 0") {
  auto be = make_backend("cpu");
  tensor p = randn({8}, 1), g = randn({7}, 2), m = be->empty({8}, dtype::f32),
         v = be->empty({8}, dtype::f32), none;
  adamw_params hp;
  const std::string msg = failure_message([&] { be->adamw(p, g, m, v, hp, none); });
  CHECK(msg.find("adamw: grad must have 8 elements") != std::string::npos);
  CHECK(msg.find("grad fp32 [7]") != std::string::npos);
  tensor g8 = randn({8}, 3);
  hp.step = 0;
  CHECK(failure_message([&] { be->adamw(p, g8, m, v, hp, none); }).find("step must be >= 1") !=
        std::string::npos);
}

TEST_CASE("adamw_runs gives the bits of one adamw call per run and leaves gaps untouched") {
  auto be = make_backend("cpu");
  const int n = 3000;
  // Unsorted runs with gaps between them and odd lengths; decay alternates.
  const std::vector<adamw_run> runs = {{1024, 1768, false}, {0, 1000, true}, {2048, 2999, true}};
  adamw_params hp;
  hp.lr = 2e-3f;
  hp.weight_decay = 0.1f;
  hp.grad_scale = 0.7f;
  hp.step = 5;
  tensor g = randn({n}, 21);
  auto start = [&] {
    return std::vector<tensor>{randn({n}, 22), randn({n}, 23, 0.01f), randn({n}, 24, 0.01f),
                               tensor::zeros({n}, dtype::bf16)};
  };
  std::vector<tensor> a = start(), b = start();
  for (std::int64_t i = 0; i < n; ++i) {  // |v| so sqrt(v) is defined, as AdamW keeps it
    a[2].data<float>()[i] = std::fabs(a[2].data<float>()[i]);
    b[2].data<float>()[i] = std::fabs(b[2].data<float>()[i]);
  }
  const std::vector<tensor> before = {a[0].clone(), a[1].clone(), a[2].clone(), a[3].clone()};
  be->adamw_runs(a[0], g, a[1], a[2], runs, hp, a[3]);
  for (const adamw_run& r : runs) {
    const core::shape_t s{r.end - r.begin};
    tensor p = b[0].slice(r.begin, s), m = b[1].slice(r.begin, s), v = b[2].slice(r.begin, s),
           low = b[3].slice(r.begin, s);
    adamw_params q = hp;
    q.weight_decay = r.decay ? hp.weight_decay : 0.0f;
    be->adamw(p, g.slice(r.begin, s), m, v, q, low);
  }
  for (int i = 0; i < 4; ++i) CHECK(same_bits(a[i], b[i]));
  for (std::int64_t gap : {1000, 1767 + 1, 2047, 2999}) {
    INFO("gap element " << gap);
    CHECK(a[0].data<float>()[gap] == before[0].data<float>()[gap]);
    CHECK(a[1].data<float>()[gap] == before[1].data<float>()[gap]);
    CHECK(a[3].data<std::uint16_t>()[gap] == 0);
  }
  CHECK(a[0].data<float>()[5] != before[0].data<float>()[5]);
}

TEST_CASE("adamw_runs_hashed gives adamw_runs's bits and the first level of the written hash") {
  auto be = make_backend("cpu");
  const int n = 3000;  // three blocks of 4096 bytes, the last one short
  const std::vector<adamw_run> runs = {{1024, 1768, false}, {0, 1000, true}, {2048, 2999, true}};
  adamw_params hp;
  hp.lr = 2e-3f;
  hp.weight_decay = 0.1f;
  hp.step = 2;
  tensor g = randn({n}, 31);
  auto start = [&] {
    std::vector<tensor> t{randn({n}, 32), randn({n}, 33, 0.01f), randn({n}, 34, 0.01f),
                          tensor::zeros({n}, dtype::bf16)};
    for (std::int64_t i = 0; i < n; ++i) t[2].data<float>()[i] = std::fabs(t[2].data<float>()[i]);
    return t;
  };
  std::vector<tensor> a = start(), b = start();
  tensor blocks = tensor::zeros({3}, dtype::i64);
  be->adamw_runs_hashed(a[0], g, a[1], a[2], runs, hp, a[3], blocks);
  be->adamw_runs(b[0], g, b[1], b[2], runs, hp, b[3]);
  for (int i = 0; i < 4; ++i) CHECK(same_bits(a[i], b[i]));
  std::uint64_t want[3];
  message_hash_blocks(b[0].raw(), b[0].bytes(), want);
  for (int i = 0; i < 3; ++i) CHECK(blocks.data<std::uint64_t>()[i] == want[i]);
  CHECK(be->message_hash_of_blocks_async(blocks, b[0].bytes())->get() ==
        message_hash(b[0].raw(), b[0].bytes()));
  tensor wrong = tensor::zeros({2}, dtype::i64);
  CHECK(failure_message([&] { be->adamw_runs_hashed(a[0], g, a[1], a[2], runs, hp, a[3], wrong); })
            .find("blocks (message_hash_blocks_of(bytes)) has shape [2], expected 3") !=
        std::string::npos);
}

}  // namespace troupe::kernels::cpu_test
