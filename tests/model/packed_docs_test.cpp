// Packed instruction rows keep their examples apart (model/loader.hpp, batch::doc_starts): an
// example packed into a row after others gets the per-token losses and the gradients it gets alone
// at the start of a padded row — attention sees only its own tokens, and its positions restart at
// 0 (GPT-2's position table, LLaMA's rotary angles). On the CPU backend, for both families, whole
// and split into chunks; the same on the CUDA backend, against the CPU's (skipped without a GPU);
// and the loader reads the starts from version-2 shards.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "kernels/select.hpp"
#include "model/instruction_shards.hpp"
#include "model/loader.hpp"
#include "tests/model/chunk_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

using namespace troupe;
using namespace troupe::model;
using namespace troupe::model::testing;

namespace {

constexpr int kT = 16;
const std::vector<int> kLengths = {5, 4, 6};  // 15 tokens: one row of 16, one padding token

struct rows {
  tensor tokens, targets, doc_starts;
};

// The examples' tokens and targets: random ids; each example's last target masked (−1), as
// prepared data masks the token that follows an example (the next one's first, or padding).
struct examples {
  std::vector<std::vector<std::int32_t>> tokens, targets;
};

examples make_examples(int vocab) {
  core::rng_stream rng(core::stream_key(11, 0x90c5));
  examples e;
  for (int len : kLengths) {
    std::vector<std::int32_t> x(len), y(len);
    for (int t = 0; t < len; ++t) {
      x[t] = static_cast<std::int32_t>(rng.below(vocab));
      y[t] = t + 1 < len ? static_cast<std::int32_t>(rng.below(vocab)) : -1;
    }
    e.tokens.push_back(x);
    e.targets.push_back(y);
  }
  return e;
}

// Every example at the start of a row of its own, padded with token 0 (masked).
rows padded(const examples& e) {
  const auto B = static_cast<std::int64_t>(e.tokens.size());
  rows r{tensor::zeros({B * kT}, core::dtype::i32), tensor::zeros({B * kT}, core::dtype::i32), {}};
  std::fill_n(r.targets.data<std::int32_t>(), B * kT, -1);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < e.tokens[b].size(); ++t) {
      r.tokens.data<std::int32_t>()[b * kT + t] = e.tokens[b][t];
      r.targets.data<std::int32_t>()[b * kT + t] = e.targets[b][t];
    }
  return r;
}

// The examples back to back in one row, the padding counted to the last; with `documents`, their
// starts.
rows packed(const examples& e, bool documents) {
  rows r{tensor::zeros({kT}, core::dtype::i32), tensor::zeros({kT}, core::dtype::i32), {}};
  std::fill_n(r.targets.data<std::int32_t>(), kT, -1);
  tensor starts = tensor::zeros({kT}, core::dtype::i32);
  int at = 0;
  for (std::size_t i = 0; i < e.tokens.size(); ++i) {
    for (std::size_t t = 0; t < e.tokens[i].size(); ++t) {
      r.tokens.data<std::int32_t>()[at + t] = e.tokens[i][t];
      r.targets.data<std::int32_t>()[at + t] = e.targets[i][t];
    }
    std::fill(starts.data<std::int32_t>() + at, starts.data<std::int32_t>() + kT, at);
    at += static_cast<int>(e.tokens[i].size());
  }
  if (documents) r.doc_starts = starts;
  return r;
}

struct result {
  std::vector<float> losses;  // per row
  std::map<std::string, std::vector<float>> grads;
};

result run(const core::model_config& cfg, kernels::backend& be, int parts, const rows& r) {
  auto chunks = make_chunks(cfg, be, parts);
  for (auto& c : chunks) c.init(5);
  tensor h = r.tokens;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const bool last = i + 1 == chunks.size();
    h = chunks[i].forward(0, h, last ? r.targets : tensor{}, last ? 1.0f : 0.0f, {}, r.doc_starts);
  }
  tensor rows_host = be.to_host(chunks.back().loss_rows(0));
  result out;
  out.losses.assign(rows_host.data<float>(), rows_host.data<float>() + rows_host.numel());
  backward_all(chunks, 0);
  out.grads = by_name(chunks, be, true);
  return out;
}

}  // namespace

TEST_CASE("a packed example's losses and gradients are those it has alone in a padded row") {
  auto be = kernels::make_backend("cpu");
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO("arch ", arch == core::arch_kind::gpt2 ? "gpt2" : "llama");
    core::model_config cfg = tiny_config(arch, 2);
    cfg.seq_length = kT;
    const examples ex = make_examples(cfg.vocab_size);
    const result alone = run(cfg, *be, 1, padded(ex));
    for (int parts : {1, 2}) {
      INFO("chunks ", parts);
      const result pack = run(cfg, *be, parts, packed(ex, true));
      // Per-token losses: the same bits (each row's sums run over the same keys in the same order).
      int at = 0;
      for (std::size_t i = 0; i < kLengths.size(); ++i) {
        for (int t = 0; t < kLengths[i]; ++t) {
          INFO("example ", i, " token ", t);
          CHECK(pack.losses[at + t] == alone.losses[i * kT + t]);
        }
        at += kLengths[i];
      }
      // Parameter gradients: the same sums over the same tokens, added up in another order
      // (rows of one example sit elsewhere in the batch): within fp32 rounding.
      REQUIRE(pack.grads.size() == alone.grads.size());
      for (const auto& entry : alone.grads) {  // no structured binding: clang 14 cannot capture one
        const auto& name = entry.first;
        const auto& g = entry.second;
        const auto& p = pack.grads.at(name);
        REQUIRE(p.size() == g.size());
        float scale = 1e-3f, worst = 0;
        for (float v : g) scale = std::max(scale, std::fabs(v));
        for (std::size_t k = 0; k < g.size(); ++k) worst = std::max(worst, std::fabs(p[k] - g[k]));
        INFO(name, ": largest difference ", worst, " at gradient scale ", scale);
        CHECK(worst <= 1e-5f * scale);
      }
    }
    // Without the document starts the later examples see the earlier ones (and sit at later
    // positions): their losses change, so the comparison above can fail.
    const result shared = run(cfg, *be, 1, packed(ex, false));
    CHECK(shared.losses[0] == alone.losses[0]);  // the first example has nothing before it
    bool differs = false;
    for (int t = 0; t < kLengths[1] - 1; ++t)
      differs = differs || shared.losses[kLengths[0] + t] != alone.losses[kT + t];
    CHECK(differs);
  }
}

TEST_CASE("cuda packed examples: the losses and gradients they have alone, and the CPU's") {
  if (!kernels::cuda_available()) {
    MESSAGE("skipped: no CUDA device in this build or on this machine");
    return;
  }
  auto cpu = kernels::make_backend("cpu");
  auto gpu = kernels::make_backend("cuda");
  // Largest difference of b from a, relative to a's largest magnitude (at least 1e-3).
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    float scale = 1e-3f, worst = 0;
    for (float v : a) scale = std::max(scale, std::fabs(v));
    for (std::size_t k = 0; k < a.size(); ++k) worst = std::max(worst, std::fabs(b[k] - a[k]));
    return worst / scale;
  };
  for (auto arch : {core::arch_kind::gpt2, core::arch_kind::llama}) {
    INFO("arch ", arch == core::arch_kind::gpt2 ? "gpt2" : "llama");
    core::model_config cfg = tiny_config(arch, 2);
    cfg.seq_length = kT;
    const examples ex = make_examples(cfg.vocab_size);
    const result alone = run(cfg, *gpu, 1, padded(ex));
    for (int parts : {1, 2}) {
      INFO("chunks ", parts);
      const result pack = run(cfg, *gpu, parts, packed(ex, true));
      const result ref = run(cfg, *cpu, parts, packed(ex, true));
      // fp32 on the GPU: the per-token losses of an example as alone, and as the CPU's, within
      // 1e-5 (other row counts may take other GEMM kernels, so not bit for bit).
      REQUIRE(pack.losses.size() == ref.losses.size());
      CHECK(rel(ref.losses, pack.losses) <= 1e-5f);
      int at = 0;
      for (std::size_t i = 0; i < kLengths.size(); ++i) {
        for (int t = 0; t < kLengths[i]; ++t) {
          INFO("example ", i, " token ", t);
          CHECK(pack.losses[at + t] == doctest::Approx(alone.losses[i * kT + t]).epsilon(1e-5));
        }
        at += kLengths[i];
      }
      REQUIRE(pack.grads.size() == ref.grads.size());
      for (const auto& entry : ref.grads) {  // no structured binding: clang 14 cannot capture one
        const auto& name = entry.first;
        const auto& g = entry.second;
        INFO(name);
        CHECK(rel(g, pack.grads.at(name)) <= 1e-4f);
        CHECK(rel(alone.grads.at(name), pack.grads.at(name)) <= 1e-4f);
      }
    }
    // Without the document starts the later examples see the earlier ones: the losses change.
    const result shared = run(cfg, *gpu, 1, packed(ex, false));
    bool differs = false;
    for (int t = 0; t < kLengths[1] - 1; ++t)
      differs = differs ||
                std::fabs(shared.losses[kLengths[0] + t] - alone.losses[kT + t]) >
                    1e-3f * std::fabs(alone.losses[kT + t]);
    CHECK(differs);
  }
}

TEST_CASE("the loader gives packed rows their document starts; padded rows get none") {
  scratch_dir tmp("packed_loader");
  const int T = 16;
  write_packed_rows(tmp / "packed.bin", 20, T, 50, 9);
  write_instruction_rows(tmp / "padded.bin", 20, T, 50, 9);
  loader_options o;
  o.seq_length = T;
  o.micro_batch_size = 3;
  auto pk = loader::open(tmp / "packed.bin", o);
  auto pd = loader::open(tmp / "padded.bin", o);
  REQUIRE(pk.ok());
  REQUIRE(pd.ok());
  CHECK_FALSE(pd->cut(0, 0, 0).doc_starts.defined());
  auto rows = instruction_shard::open(tmp / "packed.bin");
  REQUIRE(rows.ok());
  CHECK(rows->version() == 2);
  for (int i = 0; i < 4; ++i) {
    batch b = pk->eval_cut(i);
    REQUIRE(b.doc_starts.defined());
    const auto* s = b.doc_starts.data<std::int32_t>();
    int examples = 0;
    for (int r = 0; r < 3; ++r)
      for (int t = 0; t < T; ++t) {
        const std::int32_t v = s[r * T + t];
        CHECK(v >= 0);
        CHECK(v <= t);
        if (t > 0) CHECK((v == s[r * T + t - 1] || v == t));
        examples += v == t;
        // An example's first token is never a target of the token before it.
        if (t > 0 && v == t) CHECK(b.targets.data<std::int32_t>()[r * T + t - 1] == -1);
      }
    CHECK(examples > 3);  // rows of 17 tokens hold several examples of 3 to 8
  }
}

TEST_CASE("instruction shards: version 1 is read when padded and refused when packed") {
  scratch_dir tmp("packed_v1");
  const int L = 5;
  std::vector<std::int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  std::vector<std::uint8_t> mask = {0, 1, 1, 1, 1, 0, 1, 1, 0, 0};
  // A version-1 file: the header, the tokens (uint16), the mask; no starts.
  auto write_v1 = [&](const std::string& path, bool packing) {
    std::int32_t header[256] = {};
    header[0] = instruction_shard_magic;
    header[1] = 1;
    header[2] = 2;
    header[3] = L;
    header[4] = 2;
    header[5] = packing ? 1 : 0;
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header), sizeof header);
    for (std::int32_t id : ids) {
      const auto v = static_cast<std::uint16_t>(id);
      out.write(reinterpret_cast<const char*>(&v), 2);
    }
    out.write(reinterpret_cast<const char*>(mask.data()), static_cast<std::streamsize>(mask.size()));
  };
  write_v1(tmp / "v1_padded.bin", false);
  write_v1(tmp / "v1_packed.bin", true);
  auto padded = instruction_shard::open(tmp / "v1_padded.bin");
  REQUIRE_MESSAGE(padded.ok(), (padded.ok() ? "" : padded.err().to_string()));
  CHECK(padded->version() == 1);
  CHECK(padded->rows() == 2);
  CHECK(padded->token(1, 2) == 8);
  CHECK(padded->starts_example(1, 0));
  CHECK_FALSE(padded->starts_example(1, 2));
  auto packed = instruction_shard::open(tmp / "v1_packed.bin");
  REQUIRE_FALSE(packed.ok());
  const std::string m = packed.err().to_string();
  CHECK(m.find("v1_packed.bin") != std::string::npos);
  CHECK(m.find("a version-1 instruction shard of packed rows") != std::string::npos);
  CHECK(m.find("re-create it with this build's `troupe data prepare` (version 2)") != std::string::npos);
}
