// `troupe export`, `troupe import`, `troupe logits` and `--init` / model.init as the built binary:
// a trained checkpoint exported to a Hugging Face directory, imported back and trained from in
// the actor runtime (pipeline and data parallel with ZeRO) and the single-rank loop, starting
// from exactly the checkpoint's weights; re-exported bit for bit; and every bad input with its
// message.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config.hpp"
#include "model/safetensors.hpp"
#include "tests/cli/cli_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace fs = std::filesystem;
using namespace troupe::cli_test;
using troupe::model::testing::scratch_dir;

namespace {

// Each line of a run's metrics.jsonl as JSON.
std::vector<nlohmann::json> metrics(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

double last_val_loss(const std::string& run_dir) {
  double v = -1;
  for (const auto& j : metrics(run_dir))
    if (j.contains("val_loss")) v = j["val_loss"].get<double>();
  return v;
}

double first_loss(const std::string& run_dir) {
  auto m = metrics(run_dir);
  REQUIRE(!m.empty());
  return m.front()["loss"].get<double>();
}

// Tensors of a safetensors file by name, as raw bytes.
std::map<std::string, std::string> tensor_bytes(const std::string& path) {
  auto f = troupe::model::safetensors::file::open(path);
  REQUIRE_MESSAGE(f.ok(), (f.ok() ? "" : f.err().to_string()));
  std::map<std::string, std::string> out;
  for (const auto& e : f->entries()) {
    auto [p, n] = f->bytes(e);
    out[e.name + " " + e.dtype] = std::string(reinterpret_cast<const char*>(p), n);
  }
  return out;
}

std::string q(const std::string& s) { return "'" + s + "'"; }

}  // namespace

TEST_CASE("export, import and --init: a fine-tuning run starts from exactly the checkpoint's weights") {
  scratch_dir tmp("hfcli_roundtrip");
  for (auto arch : {troupe::core::arch_kind::gpt2, troupe::core::arch_kind::llama}) {
    const std::string a = arch == troupe::core::arch_kind::gpt2 ? "gpt2" : "llama";
    INFO("arch " << a);
    auto cfg = troupe::model::testing::tiny_run(tmp, arch);
    cfg.train.steps = 3;
    cfg.train.eval_interval = 0;
    cfg.runtime.run_dir = tmp / (a + "_base");
    const std::string base = tmp / (a + "_base.toml");
    std::ofstream(base) << troupe::core::to_toml(cfg);
    auto t = run_troupe(tmp.path, "train " + q(base) + " --single-rank");
    REQUIRE_MESSAGE(t.code == 0, t.err);
    const double base_val = last_val_loss(cfg.runtime.run_dir);
    REQUIRE(base_val > 0);

    const std::string hf = tmp / (a + "_hf");
    auto e = run_troupe(tmp.path, "export " + q(cfg.runtime.run_dir) + " --out " + q(hf));
    REQUIRE_MESSAGE(e.code == 0, e.err);
    CHECK(contains(e.out, "exported "));
    for (const char* f : {"config.json", "generation_config.json", "model.safetensors"})
      CHECK_MESSAGE(fs::exists(hf + "/" + f), f);

    // import writes a [model] table that describes the same model, and model.init = DIR.
    const std::string ft = tmp / (a + "_ft.toml");
    auto im = run_troupe(tmp.path, "import " + q(hf) + " --out " + q(ft));
    REQUIRE_MESSAGE(im.code == 0, im.err);
    auto imported = troupe::core::load_config(ft);
    REQUIRE_MESSAGE(imported.ok(), (imported.ok() ? "" : imported.err().to_string()));
    CHECK(imported->model.same_model(cfg.model));
    CHECK(imported->model.init == hf);

    // With lr = 0 a step leaves the weights as loaded, so the final validation loss is the base
    // run's final one (same weights, same evaluation batches), and the first step's loss is the
    // same whether the weights come from the checkpoint or from its export.
    const std::string zero = " --set optimizer.lr=0 --set optimizer.min_lr=0 --set train.steps=1";
    const std::string layouts[] = {
        " --single-rank",
        " --set parallel.pipeline_stage=2",
        " --set parallel.data_parallel=2 --set parallel.micro_batch_num=1 --set optimizer.zero_stage=1"};
    double first = -1;
    int i = 0;
    for (const std::string& layout : layouts) {
      INFO("layout" << layout);
      const std::string run = tmp / (a + "_init" + std::to_string(i++));
      auto r = run_troupe(tmp.path, "train " + q(base) + " --init " + q(hf) +
                                        " --set runtime.run_dir=" + q(run) + zero + layout);
      REQUIRE_MESSAGE(r.code == 0, r.err);
      CHECK(contains(r.err + r.out, "starting from the weights in " + hf));
      CHECK(last_val_loss(run) == base_val);
      if (first < 0) first = first_loss(run);
      CHECK(first_loss(run) == doctest::Approx(first).epsilon(1e-6));
    }
    const std::string from_ck = tmp / (a + "_from_ck");
    auto r = run_troupe(tmp.path, "train " + q(base) + " --init " + q(cfg.runtime.run_dir) +
                                      " --set runtime.run_dir=" + q(from_ck) + zero + " --single-rank");
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(first_loss(from_ck) == first_loss(tmp / (a + "_init0")));

    // Exporting the run that started from the export gives the same tensors, bit for bit.
    const std::string hf2 = tmp / (a + "_hf2");
    auto e2 = run_troupe(tmp.path, "export " + q(tmp / (a + "_init0")) + " --out " + q(hf2));
    REQUIRE_MESSAGE(e2.code == 0, e2.err);
    CHECK(tensor_bytes(hf + "/model.safetensors") == tensor_bytes(hf2 + "/model.safetensors"));
    CHECK(slurp(hf + "/config.json") == slurp(hf2 + "/config.json"));

    // logits of the export and of the checkpoint are the same numbers.
    std::ofstream(tmp / "tokens.txt") << "1 2 3 4 5 6 7 8\n8 7 6 5 4 3 2 1\n";
    auto l1 = run_troupe(tmp.path, "logits " + q(hf) + " --tokens " + q(tmp / "tokens.txt") +
                                       " --out " + q(tmp / "l1.bin"));
    auto l2 = run_troupe(tmp.path, "logits " + q(cfg.runtime.run_dir) + " --tokens " +
                                       q(tmp / "tokens.txt") + " --out " + q(tmp / "l2.bin"));
    REQUIRE_MESSAGE(l1.code == 0, l1.err);
    REQUIRE_MESSAGE(l2.code == 0, l2.err);
    CHECK(fs::file_size(tmp / "l1.bin") == 2 * 8 * 64 * sizeof(float));
    CHECK(slurp(tmp / "l1.bin") == slurp(tmp / "l2.bin"));

    // eval of the export is eval of the checkpoint: the same loss, bit for bit, which is the run's
    // own final validation loss (its eval_batches and micro-batch size).
    const std::string data = " --data " + q(cfg.data.val) + " --json";
    auto ev_ck = run_troupe(tmp.path, "eval " + q(cfg.runtime.run_dir) + data);
    auto ev_hf = run_troupe(tmp.path, "eval " + q(hf) + data + " --batches " +
                                          std::to_string(cfg.train.eval_batches) + " --batch-size " +
                                          std::to_string(cfg.parallel.micro_batch_size) +
                                          " --seq-length " + std::to_string(cfg.model.seq_length));
    REQUIRE_MESSAGE(ev_ck.code == 0, ev_ck.err);
    REQUIRE_MESSAGE(ev_hf.code == 0, ev_hf.err);
    const auto j_ck = nlohmann::json::parse(ev_ck.out), j_hf = nlohmann::json::parse(ev_hf.out);
    CHECK(j_hf["model"].get<std::string>() == hf);
    CHECK(j_hf["targets"] == j_ck["targets"]);
    CHECK(j_hf["loss"].get<double>() == j_ck["loss"].get<double>());
    CHECK(j_ck["loss"].get<double>() == doctest::Approx(base_val).epsilon(1e-6));
    // A model directory's sequence length defaults to its positions; longer is refused.
    auto too_long = run_troupe(tmp.path, "eval " + q(hf) + data + " --seq-length 1000");
    CHECK(too_long.code == 1);
    CHECK(contains(too_long.err, "--seq-length 1000 is longer than the model's " +
                                     std::to_string(cfg.model.seq_length) + " positions"));
  }
}

TEST_CASE("logits of a LoRA checkpoint are those of its --merge-lora export") {
  // `troupe logits` remakes a LoRA run's frozen base from model.init and adds the adapters; the
  // merged export folds the same adapters into the weights (rounded once to fp32).
  scratch_dir tmp("hfcli_lora_logits");
  std::ofstream(tmp / "tokens.txt") << "1 2 3 4 5 6 7 8\n8 7 6 5 4 3 2 1\n";
  auto floats = [](const fs::path& p) {
    const std::string b = slurp(p);
    std::vector<float> v(b.size() / sizeof(float));
    std::memcpy(v.data(), b.data(), v.size() * sizeof(float));
    return v;
  };
  for (auto arch : {troupe::core::arch_kind::gpt2, troupe::core::arch_kind::llama}) {
    const std::string a = arch == troupe::core::arch_kind::gpt2 ? "gpt2" : "llama";
    INFO("arch " << a);
    auto cfg = troupe::model::testing::tiny_run(tmp, arch);
    cfg.train.steps = 1;
    cfg.train.eval_interval = 0;
    cfg.runtime.run_dir = tmp / (a + "_base");
    const std::string base = tmp / (a + "_base.toml");
    std::ofstream(base) << troupe::core::to_toml(cfg);
    auto t = run_troupe(tmp.path, "train " + q(base) + " --single-rank");
    REQUIRE_MESSAGE(t.code == 0, t.err);
    const std::string hf = tmp / (a + "_hf");
    auto e = run_troupe(tmp.path, "export " + q(cfg.runtime.run_dir) + " --out " + q(hf));
    REQUIRE_MESSAGE(e.code == 0, e.err);

    const std::string lora = tmp / (a + "_lora");
    const std::string targets = arch == troupe::core::arch_kind::gpt2 ? "c_attn,c_proj,c_fc"
                                                                      : "q_proj,k_proj,v_proj,o_proj,down_proj";
    auto l = run_troupe(tmp.path, "train " + q(base) + " --init " + q(hf) + " --single-rank" +
                                      " --set runtime.run_dir=" + q(lora) + " --set train.steps=4" +
                                      " --set optimizer.lr=0.01 --set train.warmup_steps=0" +
                                      " --set lora.rank=2 --set lora.alpha=4 --set lora.targets=" + targets);
    REQUIRE_MESSAGE(l.code == 0, l.err);
    const std::string merged = tmp / (a + "_merged");
    auto m = run_troupe(tmp.path, "export " + q(lora) + " --merge-lora --out " + q(merged));
    REQUIRE_MESSAGE(m.code == 0, m.err);

    for (const auto& [dir, out] : {std::pair{hf, "base.bin"}, {lora, "lora.bin"}, {merged, "merged.bin"}}) {
      auto r = run_troupe(tmp.path, "logits " + q(dir) + " --tokens " + q(tmp / "tokens.txt") +
                                        " --out " + q(tmp / (a + out)));
      REQUIRE_MESSAGE(r.code == 0, r.err);
    }
    const auto vb = floats(tmp / (a + "base.bin")), vl = floats(tmp / (a + "lora.bin")),
               vm = floats(tmp / (a + "merged.bin"));
    REQUIRE(vl.size() == 2u * 8u * static_cast<std::size_t>(cfg.model.vocab_size));
    REQUIRE(vl.size() == vm.size());
    REQUIRE(vl.size() == vb.size());
    float merged_diff = 0, moved = 0;
    for (std::size_t i = 0; i < vl.size(); ++i) {
      merged_diff = std::max(merged_diff, std::abs(vl[i] - vm[i]));
      moved = std::max(moved, std::abs(vl[i] - vb[i]));
    }
    CHECK(merged_diff <= 1e-5f);
    CHECK(moved > 1e-3f);  // the adapters are not zero: the merged comparison means something
  }
}

TEST_CASE("export writes GPT-2's tokenizer files and shards past --max-shard-size") {
  REQUIRE_MESSAGE(fs::exists(TROUPE_SOURCE_DIR "/data/gpt2/vocab.bpe"), "scripts/setup.sh fetches data/gpt2");
  scratch_dir tmp("hfcli_tok");
  auto cfg = troupe::model::testing::tiny_run(tmp);
  cfg.train.steps = 1;
  cfg.train.eval_interval = 0;
  const std::string gpt2 = TROUPE_SOURCE_DIR "/data/gpt2";
  cfg.model.vocab_size = 50257;  // GPT-2's tokenizer
  cfg.data.tokenizer_dir = gpt2;
  std::ofstream(tmp / "run.toml") << troupe::core::to_toml(cfg);
  REQUIRE(run_troupe(tmp.path, "train " + q(tmp / "run.toml") + " --single-rank").code == 0);
  auto e = run_troupe(tmp.path, "export " + q(cfg.runtime.run_dir) + " --out " + q(tmp / "hf") +
                                    " --max-shard-size 1MB --dtype bf16");
  REQUIRE_MESSAGE(e.code == 0, e.err);
  CHECK(slurp(tmp / "hf/vocab.json") == slurp(gpt2 + "/encoder.json"));
  CHECK(slurp(tmp / "hf/merges.txt") == slurp(gpt2 + "/vocab.bpe"));
  CHECK(contains(slurp(tmp / "hf/tokenizer_config.json"), "GPT2Tokenizer"));
  CHECK(contains(slurp(tmp / "hf/generation_config.json"), "\"eos_token_id\": 50256"));
  // The bf16 embedding alone (50257 x 32 x 2 bytes) passes 1MB: it gets a file of its own.
  CHECK(fs::exists(tmp / "hf/model.safetensors.index.json"));
  CHECK(fs::exists(tmp / "hf/model-00001-of-00002.safetensors"));
  CHECK_FALSE(fs::exists(tmp / "hf/model.safetensors"));
  CHECK(contains(slurp(tmp / "hf/config.json"), "\"torch_dtype\": \"bfloat16\""));
  // The sharded bf16 directory is a weights source too.
  auto r = run_troupe(tmp.path, "train " + q(tmp / "run.toml") + " --init " + q(tmp / "hf") +
                                    " --set runtime.run_dir=" + q(tmp / "again") + " --single-rank");
  CHECK_MESSAGE(r.code == 0, r.err);
}

TEST_CASE("bad --init, import and export inputs stop with a message and a non-zero exit") {
  scratch_dir tmp("hfcli_bad");
  auto cfg = troupe::model::testing::tiny_run(tmp);
  cfg.train.steps = 1;
  cfg.train.eval_interval = 0;
  std::ofstream(tmp / "run.toml") << troupe::core::to_toml(cfg);
  REQUIRE(run_troupe(tmp.path, "train " + q(tmp / "run.toml") + " --single-rank").code == 0);
  REQUIRE(run_troupe(tmp.path, "export " + q(cfg.runtime.run_dir) + " --out " + q(tmp / "hf")).code == 0);

  auto missing = run_troupe(tmp.path, "train " + q(tmp / "run.toml") + " --init " + q(tmp / "nope"));
  CHECK(missing.code == 1);
  CHECK(contains(missing.err, "model.init: initial weights '" + (tmp / "nope") + "' does not exist"));

  auto other = run_troupe(tmp.path, "train " + q(tmp / "run.toml") + " --init " + q(tmp / "hf") +
                                        " --set model.num_layers=4 --single-rank");
  CHECK(other.code == 1);
  CHECK(contains(other.err, (tmp / "hf") + "/config.json: n_layer: is 2, but the run's [model] has num_layers = 4"));

  auto both = run_troupe(tmp.path, "train " + q(tmp / "run.toml") + " --init " + q(tmp / "hf") +
                                       " --resume " + q(cfg.runtime.run_dir));
  CHECK(both.code == 2);
  CHECK(contains(both.err, "--init and --resume together"));

  auto dtype = run_troupe(tmp.path, "export " + q(cfg.runtime.run_dir) + " --out " + q(tmp / "x") +
                                        " --dtype fp16");
  CHECK(dtype.code == 1);
  CHECK(contains(dtype.err, "--dtype: 'fp16' is not an export dtype"));
  auto size = run_troupe(tmp.path, "export " + q(cfg.runtime.run_dir) + " --out " + q(tmp / "x") +
                                       " --max-shard-size 5TB");
  CHECK(size.code == 1);
  CHECK(contains(size.err, "--max-shard-size: size '5TB' is not a positive whole number"));
  auto notck = run_troupe(tmp.path, "export " + q(tmp / "hf") + " --out " + q(tmp / "x"));
  CHECK(notck.code == 1);
  CHECK(contains(notck.err, "no checkpoint here"));

  std::ofstream(tmp / "hf/config.json") << "{\"model_type\": \"t5\"}";
  auto im = run_troupe(tmp.path, "import " + q(tmp / "hf") + " --out " + q(tmp / "ft.toml"));
  CHECK(im.code == 1);
  CHECK(contains(im.err, (tmp / "hf") + "/config.json: model_type: \"t5\" is not supported"));
  CHECK_FALSE(fs::exists(tmp / "ft.toml"));
}
