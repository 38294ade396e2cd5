// Tests of the run configuration: parsing, every class of bad input (with its file, line, column,
// key and message), overrides, architecture defaults, derived values, parameter counts, the file
// checks and the TOML round trip.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "core/chunk_placement.hpp"
#include "core/config.hpp"

using namespace troupe;

namespace {

const std::string configs_dir = std::string(TROUPE_SOURCE_DIR) + "/configs/";

core::config parse_ok(const std::string& text, const std::vector<std::string>& sets = {}) {
  auto r = core::parse_config(text, "test.toml", sets);
  if (!r) FAIL_CHECK(r.err().to_string());
  REQUIRE(r.ok());
  return *r;
}

core::error parse_bad(const std::string& text, const std::vector<std::string>& sets = {}) {
  auto r = core::parse_config(text, "test.toml", sets);
  REQUIRE_FALSE(r.ok());
  CHECK_FALSE(r.err().hint.empty());  // every error says what to do
  return r.err();
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

core::config load_ok(const std::string& name) {
  auto r = core::load_config(configs_dir + name);
  if (!r) FAIL_CHECK(r.err().to_string());
  REQUIRE(r.ok());
  return *r;
}

// A scratch folder under the system temp dir, removed at the end of the test.
struct scratch_dir {
  std::filesystem::path path;
  scratch_dir() {
    path = std::filesystem::temp_directory_path() /
           ("troupe_config_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::create_directories(path);
  }
  ~scratch_dir() { std::filesystem::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string touch(const std::string& name) const {
    const auto p = path / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << "x";
    return p.string();
  }
};

}  // namespace

TEST_CASE("an empty file gives the documented defaults, resolved for gpt2") {
  const core::config c = parse_ok("");
  CHECK(c.model.arch == core::arch_kind::gpt2);
  CHECK(c.model.num_kv_heads == c.model.num_heads);
  CHECK(c.model.ffn_hidden_size == 4 * c.model.hidden_size);
  CHECK(c.model.tie_embeddings);
  CHECK(c.checkpoint.dir.empty());  // stays "" = <run_dir>/checkpoints, so it follows run_dir
  CHECK(c.origins.empty());
  CHECK(c.source == "test.toml");
}

TEST_CASE("tiny.toml parses to the documented values and derived numbers") {
  const core::config c = load_ok("tiny.toml");
  CHECK(c.model.arch == core::arch_kind::gpt2);
  CHECK(c.model.vocab_size == 50257);
  CHECK(c.model.num_layers == 4);
  CHECK(c.model.hidden_size == 128);
  CHECK(c.model.num_heads == 4);
  CHECK(c.model.seq_length == 64);
  CHECK(c.parallel.micro_batch_size == 4);
  CHECK(c.parallel.micro_batch_num == 4);
  CHECK(c.parallel.pipeline_stage == 2);
  CHECK(c.parallel.data_parallel == 2);
  CHECK(c.train.steps == 140);
  CHECK(c.optimizer.lr == doctest::Approx(3e-3));
  CHECK(c.train.warmup_steps == 10);
  CHECK(c.train.eval_interval == 20);
  CHECK(c.data.train == "data/tokens/train.bin");
  CHECK(c.data.val == "data/tokens/val.bin");
  CHECK(c.data.tokenizer_dir == "data/gpt2");
  CHECK(c.runtime.run_dir == "runs/tiny");

  const core::derived_values d = core::derive(c);
  CHECK(d.global_batch == 32);        // 4 x 4 x 1 x 2
  CHECK(d.tokens_per_step == 2048);   // 32 x 64
  CHECK(d.workers == 4);              // 2 x 1 x 2
  CHECK(d.layers_per_stage == 2);     // 4 / 2
  // wte 50257*128 + wpe 64*128 + 4 layers * 198,272 + ln_f 256
  CHECK(d.parameters == 7'234'432);
}

TEST_CASE("global batch multiplies in gradient accumulation and data parallelism") {
  const core::config c = parse_ok(
      "[parallel]\nmicro_batch_size = 3\nmicro_batch_num = 5\ndata_parallel = 7\nmodel_parallel = 2\n"
      "pipeline_stage = 2\n[train]\ngradient_accumulation_steps = 11\n[model]\nseq_length = 13\n");
  const core::derived_values d = core::derive(c);
  CHECK(d.global_batch == 3 * 5 * 7 * 11);
  CHECK(d.tokens_per_step == 3 * 5 * 7 * 11 * 13);
  CHECK(d.workers == 7 * 2 * 2);
  CHECK(d.layers_per_stage == 2);
}

TEST_CASE("per-rank layers follow the chunk placement: interleaved, or the V of zb_v") {
  // 8 chunks on 4 ranks. Interleaved: rank r holds chunks r and r + 4. V: rank r holds r and 7 - r.
  const std::string text =
      "[model]\nnum_layers = 12\n[parallel]\npipeline_stage = 4\nvirtual_pipeline = 2\n"
      "micro_batch_num = 8\nstage_layers = [1, 1, 2, 2, 1, 1, 2, 2]\n";
  const core::config inter = parse_ok(text, {"schedule.name=interleaved_1f1b"});
  CHECK_FALSE(core::chunks_in_v(inter));
  CHECK(core::derive(inter).stage_layers == std::vector<int>{2, 2, 4, 4});  // 1+1, 1+1, 2+2, 2+2
  CHECK(core::derive(inter).layers_per_stage == 4);
  const core::config v = parse_ok(text, {"schedule.name=zb_v"});
  CHECK(core::chunks_in_v(v));
  CHECK(core::derive(v).stage_layers == std::vector<int>{3, 3, 3, 3});  // 1+2, 1+2, 2+1, 2+1
  CHECK(core::derive(v).layers_per_stage == 3);
  // A caller that built the schedule passes its placement (a schedule file's `placement v`).
  CHECK(core::rank_layers(inter, true) == std::vector<int>{3, 3, 3, 3});
  CHECK(core::rank_layers(v, false) == std::vector<int>{2, 2, 4, 4});
  // A schedule file wins over the name: its placement is not known from the config.
  CHECK_FALSE(core::chunks_in_v(parse_ok(text, {"schedule.name=zb_v", "schedule.file=s.txt"})));
  // Odd rounds fold back for any v (v = 4, p = 2: ranks 0 1 | 1 0 | 0 1 | 1 0).
  const core::config v4 = parse_ok(
      "[model]\nnum_layers = 36\n[parallel]\npipeline_stage = 2\nvirtual_pipeline = 4\n"
      "micro_batch_num = 4\nstage_layers = [1, 2, 3, 4, 5, 6, 7, 8]\n");
  CHECK(core::rank_layers(v4, true) == std::vector<int>{1 + 4 + 5 + 8, 2 + 3 + 6 + 7});
  CHECK(core::rank_layers(v4, false) == std::vector<int>{1 + 3 + 5 + 7, 2 + 4 + 6 + 8});
}

TEST_CASE("GPT-2 124M has 124,439,808 parameters with tied embeddings") {
  const core::config c = load_ok("gpt2_124m.toml");
  CHECK(c.model.ffn_hidden_size == 3072);
  CHECK(c.model.tie_embeddings);
  CHECK(core::parameter_count(c.model) == 124'439'808);
  CHECK(core::derive(c).tokens_per_step == 524'288);
  core::model_config untied = c.model;
  untied.tie_embeddings = false;
  CHECK(core::parameter_count(untied) == 124'439'808 + 50257LL * 768);
}

TEST_CASE("llama parameter count matches a hand computation") {
  const core::config c = load_ok("llama_tiny.toml");
  CHECK(c.model.num_kv_heads == 2);
  CHECK(c.model.ffn_hidden_size == 512);  // 8*128/3 = 341, rounded up to 512
  CHECK_FALSE(c.model.tie_embeddings);
  // V=50257 C=128 L=4 Hkv*D=2*32=64 F=512:
  // embed 6,432,896; per layer 128 + 128*128 + 2*64*128 + 128*128 + 128 + 3*512*128 = 246,016;
  // norm 128; head 6,432,896.
  CHECK(core::parameter_count(c.model) == 6'432'896 + 4 * 246'016 + 128 + 6'432'896);

  // LLaMA-7B: the published 6,738,415,616.
  const core::config big = parse_ok(
      "[model]\narch = \"llama\"\nvocab_size = 32000\nnum_layers = 32\nhidden_size = 4096\n"
      "num_heads = 32\nseq_length = 2048\n");
  CHECK(big.model.ffn_hidden_size == 11008);
  CHECK(core::parameter_count(big.model) == 6'738'415'616);
}

TEST_CASE("architecture defaults resolve unless the file sets them") {
  const core::config llama = parse_ok("[model]\narch = \"llama\"\nhidden_size = 256\nnum_heads = 8\n");
  CHECK_FALSE(llama.model.tie_embeddings);
  CHECK(llama.model.ffn_hidden_size == 768);  // 8*256/3 = 682 -> 768
  CHECK(llama.model.num_kv_heads == 8);
  const core::config tied = parse_ok("[model]\narch = \"llama\"\ntie_embeddings = true\nffn_hidden_size = 100\n");
  CHECK(tied.model.tie_embeddings);
  CHECK(tied.model.ffn_hidden_size == 100);
  const core::config untied_gpt2 = parse_ok("[model]\ntie_embeddings = false\n");
  CHECK_FALSE(untied_gpt2.model.tie_embeddings);
}

TEST_CASE("a TOML syntax error names file, line and column with toml++'s description") {
  const core::error e = parse_bad("[model]\nnum_layers = 4\nhidden_size = = 3\n");
  CHECK(e.where.file == "test.toml");
  CHECK(e.where.line == 3);
  CHECK(e.where.column > 0);
  CHECK(contains(e.message, "TOML syntax error"));
  CHECK(contains(e.to_string(), "test.toml:3:"));

  const core::error dup = parse_bad("[train]\nsteps = 1\nsteps = 2\n");
  CHECK(dup.where.line == 3);
  CHECK(contains(dup.message, "steps"));
}

TEST_CASE("an unknown key names the nearest valid key") {
  const core::error e = parse_bad("[model]\narch = \"gpt2\"\n  num_layer = 4\n");
  CHECK(e.where.file == "test.toml");
  CHECK(e.where.key == "model.num_layer");
  CHECK(e.where.line == 3);
  CHECK(e.where.column == 3);
  CHECK(e.message == "unknown key 'model.num_layer'; did you mean 'model.num_layers'?");
  CHECK(contains(e.hint, "num_layers"));
  CHECK(e.to_string().rfind("test.toml:3:3: model.num_layer: unknown key", 0) == 0);

  SUBCASE("a swap of two letters is one edit") {
    CHECK(contains(parse_bad("[train]\nsetps = 4\n").message, "did you mean 'train.steps'?"));
  }
  SUBCASE("a right name in the wrong table") {
    CHECK(contains(parse_bad("[train]\nlr = 0.1\n").message, "did you mean 'optimizer.lr'?"));
  }
  SUBCASE("a key outside any table") {
    const core::error top = parse_bad("seed = 3\n");
    CHECK(top.where.key == "seed");
    CHECK(contains(top.message, "did you mean 'train.seed'?"));
  }
  SUBCASE("nothing close gets no guess") {
    const core::error far = parse_bad("[model]\nquux = 1\n");
    CHECK(far.message == "unknown key 'model.quux'");
    CHECK(contains(far.hint, "num_layers"));  // the hint lists the table's keys
  }
  SUBCASE("a nested table inside a known table") {
    CHECK(parse_bad("[model.extra]\nx = 1\n").where.key == "model.extra");
  }
}

TEST_CASE("an unknown table names the nearest table") {
  const core::error e = parse_bad("[model]\nnum_layers = 4\n\n[modle]\nhidden_size = 8\n");
  CHECK(e.where.line == 4);
  CHECK(e.where.key == "modle");
  CHECK(e.message == "unknown table [modle]; did you mean [model]?");
  CHECK(contains(e.hint, "[parallel]"));
  CHECK(contains(parse_bad("model = 3\n").message, "expected a table [model], got an integer"));
}

TEST_CASE("the first error in document order is reported") {
  const core::error e = parse_bad("[train]\nsteps = \"x\"\n[model]\nnum_layer = 4\n");
  CHECK(e.where.line == 2);
  CHECK(contains(e.message, "expected an integer"));
}

TEST_CASE("a wrong type names the expected and the given type at the value") {
  const core::error e = parse_bad("[model]\nnum_layers = \"4\"\n");
  CHECK(e.where.key == "model.num_layers");
  CHECK(e.where.line == 2);
  CHECK(e.where.column == 14);
  CHECK(e.message == "expected an integer, got a string \"4\"");
  CHECK(contains(e.hint, "without quotes"));

  CHECK(parse_bad("[model]\nnum_layers = 4.5\n").message == "expected an integer, got a float (4.5)");
  CHECK(contains(parse_bad("[optimizer]\nlr = \"fast\"\n").message, "expected a number, got a string"));
  CHECK(contains(parse_bad("[runtime]\ndeterministic = \"yes\"\n").message,
                 "expected a boolean, got a string"));
  CHECK(contains(parse_bad("[data]\ntrain = 5\n").message, "expected a string, got an integer"));
  CHECK(contains(parse_bad("[model]\narch = 2\n").message, "expected a string, got an integer"));
  CHECK(contains(parse_bad("[model]\nnum_layers = [4]\n").message, "got an array"));
  CHECK(contains(parse_bad("[train]\nsteps = 1979-05-27\n").message, "got a date"));
}

TEST_CASE("an integer is accepted where a float is expected") {
  const core::config c = parse_ok("[train]\ngrad_clip = 2\n[optimizer]\nlr = 1\n");
  CHECK(c.train.grad_clip == 2.0);
  CHECK(c.optimizer.lr == 1.0);
}

TEST_CASE("out-of-range values give the range and a hint") {
  const core::error layers = parse_bad("[model]\nnum_layers = 0\n");
  CHECK(layers.where.key == "model.num_layers");
  CHECK(layers.where.line == 2);
  CHECK(layers.message == "value 0 is out of range [1, 10000]");

  const core::error zero = parse_bad("[optimizer]\nzero_stage = 3\n");
  CHECK(zero.message == "value 3 is out of range [0, 2]");
  CHECK(contains(zero.hint, "ZeRO-3 is not supported"));

  const core::error beta = parse_bad("[optimizer]\nbeta2 = 1.0\n");
  CHECK(beta.message == "value 1.0 is out of range [0.0, 1.0)");
  CHECK(contains(parse_bad("[optimizer]\neps = 0.0\n").message, "(0.0, inf]"));
  CHECK(contains(parse_bad("[optimizer]\nlr = nan\n").message, "expected a finite number, got nan"));
  CHECK(contains(parse_bad("[optimizer]\nlr = -0.1\n").message, "out of range"));
  CHECK(contains(parse_bad("[model]\nseq_length = -1\n").message, "out of range"));
  CHECK(contains(parse_bad("[train]\nsteps = 3000000000\n").message, "out of range"));
  const core::error vocab = parse_bad("[model]\nvocab_size = 20000000\n");
  CHECK(vocab.message == "value 20000000 is out of range [1, 16777216]");
  CHECK(contains(vocab.hint, "uint32"));
  CHECK(parse_ok("[model]\nvocab_size = 128256\n").model.vocab_size == 128256);
}

TEST_CASE("an enum value outside its set lists the allowed values") {
  const core::error arch = parse_bad("[model]\narch = \"gpt3\"\n");
  CHECK(arch.where.key == "model.arch");
  CHECK(arch.where.line == 2);
  CHECK(arch.where.column == 8);
  CHECK(arch.message == "'gpt3' is not one of the allowed values: gpt2, llama");
  CHECK(arch.hint == "did you mean 'gpt2'?");
  const core::error mode = parse_bad("[recompute]\nmode = \"everything\"\n");
  CHECK(mode.message == "'everything' is not one of the allowed values: none, full, selective");
  CHECK(contains(mode.hint, "choose one of"));
  CHECK(contains(parse_bad("[precision]\ncompute = \"fp8\"\n").message, "fp32, bf16, fp16"));
  CHECK(contains(parse_bad("[runtime]\ndevice = \"tpu\"\n").message, "cpu, cuda"));
}

TEST_CASE("num_layers must divide into pipeline stages and virtual chunks") {
  const core::error e = parse_bad("[model]\nnum_layers = 5\n[parallel]\npipeline_stage = 2\n");
  CHECK(e.where.key == "model.num_layers");
  CHECK(e.where.line == 2);
  CHECK(e.where.column == 14);
  CHECK(e.message == "num_layers 5 is not divisible by pipeline_stage 2 x virtual_pipeline 1 = 2");
  CHECK(contains(e.hint, "num_layers = 4 or 6"));

  const core::error v = parse_bad("[model]\nnum_layers = 4\n[parallel]\npipeline_stage = 2\nvirtual_pipeline = 4\n");
  CHECK(contains(v.message, "pipeline_stage 2 x virtual_pipeline 4 = 8"));
  CHECK(parse_ok("[model]\nnum_layers = 8\n[parallel]\npipeline_stage = 2\nvirtual_pipeline = 4\n")
            .model.num_layers == 8);
}

TEST_CASE("hidden_size must be divisible by num_heads") {
  const core::error e = parse_bad("[model]\nhidden_size = 130\nnum_heads = 4\n");
  CHECK(e.where.key == "model.hidden_size");
  CHECK(e.where.line == 2);
  CHECK(e.message == "hidden_size 130 is not divisible by num_heads 4");
  CHECK(contains(e.hint, "num_heads = 2 or 5"));
  CHECK(contains(e.hint, "hidden_size = 128 or 132"));
}

TEST_CASE("num_heads must be divisible by num_kv_heads, and gpt2 has no grouped heads") {
  const core::error e =
      parse_bad("[model]\narch = \"llama\"\nhidden_size = 256\nnum_heads = 8\nnum_kv_heads = 3\n");
  CHECK(e.where.key == "model.num_kv_heads");
  CHECK(e.where.line == 5);
  CHECK(e.message == "num_heads 8 is not divisible by num_kv_heads 3");
  CHECK(contains(e.hint, "num_kv_heads = 2 or 4"));
  CHECK(contains(parse_bad("[model]\narch = \"llama\"\nnum_heads = 4\nnum_kv_heads = 8\n").message,
                 "not divisible"));

  const core::error g = parse_bad("[model]\nnum_heads = 4\nnum_kv_heads = 2\n");
  CHECK(g.where.key == "model.num_kv_heads");
  CHECK(contains(g.message, "gpt2 has one key/value head per query head"));
}

TEST_CASE("llama needs an even head_dim for RoPE") {
  const core::error e = parse_bad("[model]\narch = \"llama\"\nhidden_size = 132\nnum_heads = 4\n");
  CHECK(e.where.key == "model.hidden_size");
  CHECK(contains(e.message, "= 33 is odd"));
  CHECK(contains(e.hint, "RoPE"));
}

TEST_CASE("model_parallel must divide the heads and the feed-forward width") {
  const core::error e = parse_bad("[model]\nnum_heads = 4\n[parallel]\nmodel_parallel = 3\n");
  CHECK(e.where.key == "parallel.model_parallel");
  CHECK(e.where.line == 4);
  CHECK(e.message == "model_parallel 3 does not divide num_heads 4");
  CHECK(contains(e.hint, "near 3: 2 or 4"));

  // The feed-forward width: 8 heads split by 8, but ffn 1020 does not; 4 splits everything.
  const core::error f = parse_bad(
      "[model]\nhidden_size = 256\nnum_heads = 8\nffn_hidden_size = 1020\n[parallel]\n"
      "model_parallel = 8\n");
  CHECK(f.where.key == "parallel.model_parallel");
  CHECK(f.message == "model_parallel 8 does not divide ffn_hidden_size 1020");
  CHECK(contains(f.hint, "near 8: 4"));
  CHECK(parse_ok("[model]\nhidden_size = 256\nnum_heads = 8\n[parallel]\nmodel_parallel = 8\n")
            .parallel.model_parallel == 8);
}

TEST_CASE("key/value heads split when there are at least model_parallel of them, else replicate") {
  const std::string llama = "[model]\narch = \"llama\"\nhidden_size = 384\nnum_heads = 12\nffn_hidden_size = 1536\n";
  // 4 kv heads over 2 ranks: split; over 12: replicated (12 is a multiple of 4).
  CHECK(parse_ok(llama + "num_kv_heads = 4\n[parallel]\nmodel_parallel = 2\n").parallel.model_parallel == 2);
  CHECK(parse_ok(llama + "num_kv_heads = 4\n[parallel]\nmodel_parallel = 12\n")
            .parallel.model_parallel == 12);
  CHECK(parse_ok(llama + "num_kv_heads = 1\n[parallel]\nmodel_parallel = 4\n").parallel.model_parallel == 4);
  // 4 kv heads over 6 ranks: neither split evenly nor replicated evenly.
  const core::error e = parse_bad(llama + "num_kv_heads = 4\n[parallel]\nmodel_parallel = 6\n");
  CHECK(e.where.key == "parallel.model_parallel");
  CHECK(e.where.line == 8);
  CHECK(e.message == "model_parallel 6 neither divides num_kv_heads 4 nor is a multiple of it");
  CHECK(contains(e.hint, "replicated when model_parallel is a multiple of num_kv_heads"));
  CHECK(contains(e.hint, "near 6: 4 or 12"));
  // 6 kv heads over 4 ranks: more kv heads than ranks, so they must split evenly.
  const core::error g = parse_bad(llama + "num_kv_heads = 6\n[parallel]\nmodel_parallel = 4\n");
  CHECK(g.message == "model_parallel 4 neither divides num_kv_heads 6 nor is a multiple of it");
  CHECK(contains(g.hint, "near 4: 3 or 6"));
}

TEST_CASE("sequence_parallel needs model_parallel > 1 and seq_length divisible by it") {
  const core::error e = parse_bad("[parallel]\nsequence_parallel = true\n");
  CHECK(e.where.key == "parallel.sequence_parallel");
  CHECK(e.where.line == 2);
  CHECK(contains(e.message, "sequence_parallel = true needs model_parallel > 1"));
  CHECK(contains(e.hint, "parallel.model_parallel to 2"));

  const core::error t = parse_bad(
      "[model]\nseq_length = 66\n[parallel]\nmodel_parallel = 4\nsequence_parallel = true\n");
  CHECK(t.where.key == "model.seq_length");
  CHECK(t.where.line == 2);
  CHECK(t.message == "seq_length 66 is not divisible by model_parallel 4 with sequence_parallel = true");
  CHECK(contains(t.hint, "seq_length = 64 or 68"));
  // Without sequence parallel the tokens are not split: any seq_length.
  CHECK(parse_ok("[model]\nseq_length = 66\n[parallel]\nmodel_parallel = 4\n").model.seq_length == 66);
  const core::config ok =
      parse_ok("[parallel]\nmodel_parallel = 2\nsequence_parallel = true\n");
  CHECK(ok.parallel.sequence_parallel);
  CHECK(contains(core::to_toml(ok), "sequence_parallel = true"));
}

TEST_CASE("LoRA adapters are refused with tensor parallel") {
  const core::error e = parse_bad("[lora]\nrank = 4\n[parallel]\nmodel_parallel = 2\n");
  CHECK(e.where.key == "lora.rank");
  CHECK(e.where.line == 2);
  CHECK(e.message == "LoRA adapters (lora.rank 4) do not run with tensor parallel (parallel.model_parallel 2)");
  CHECK(parse_ok("[lora]\nrank = 4\n").model.lora.rank == 4);
}

TEST_CASE("fp16 and bf16 compute need a cuda device") {
  const core::error e = parse_bad("[precision]\ncompute = \"bf16\"\n");
  CHECK(e.where.key == "precision.compute");
  CHECK(e.where.line == 2);
  CHECK(e.message == "bf16 compute needs runtime.device = \"cuda\"");
  CHECK(contains(e.hint, "CPU backend computes in fp32"));
  CHECK(contains(parse_bad("[precision]\ncompute = \"fp16\"\n").message, "fp16 compute"));
  CHECK(parse_ok("[precision]\ncompute = \"bf16\"\n[runtime]\ndevice = \"cuda\"\n").precision.compute ==
        core::precision_kind::bf16);
}

TEST_CASE("settings that contradict each other are errors") {
  CHECK(parse_bad("[optimizer]\nlr = 1e-3\nmin_lr = 1e-2\n").where.key == "optimizer.min_lr");
  const core::error eval = parse_bad("[train]\neval_interval = 10\n");
  CHECK(eval.where.key == "train.eval_interval");
  CHECK(contains(eval.message, "data.val is empty"));
  CHECK(parse_bad("[runtime]\nrun_dir = \"\"\n").where.key == "runtime.run_dir");
  CHECK(parse_bad("[schedule]\nname = \"\"\n").where.key == "schedule.name");
  CHECK(parse_bad("[runtime]\nfault_inject = \"rank1\"\n").where.key == "runtime.fault_inject");
  CHECK(parse_ok("[runtime]\nfault_inject = \"1:3:1B2\"\n").runtime.fault_inject == "1:3:1B2");
  const core::error tune = parse_bad("[runtime]\ngemm_tune_file = \"tune.txt\"\n");
  CHECK(tune.where.key == "runtime.gemm_tune_file");
  CHECK(contains(tune.message, "runtime.device = \"cuda\""));
  CHECK(parse_ok("[runtime]\ndevice = \"cuda\"\ngemm_tune_file = \"tune.txt\"\n")
            .runtime.gemm_tune_file == "tune.txt");
  const core::error split = parse_bad("[runtime]\nsplit_gpu = true\n");
  CHECK(split.where.key == "runtime.split_gpu");
  CHECK(contains(split.hint, "runtime.device = \"cuda\""));
  CHECK(parse_ok("[runtime]\ndevice = \"cuda\"\nsplit_gpu = true\n").runtime.split_gpu);
}

TEST_CASE("dropout rates are read in [0, 1), and attention dropout is refused on CUDA") {
  const core::config c = parse_ok("[model]\nattention_dropout = 0.1\nhidden_dropout = 0.2\n");
  CHECK(c.model.attention_dropout == 0.1f);
  CHECK(c.model.hidden_dropout == 0.2f);
  CHECK(parse_ok("").model.hidden_dropout == 0.0f);
  CHECK(parse_bad("[model]\nhidden_dropout = 1.0\n").where.key == "model.hidden_dropout");
  CHECK(parse_bad("[model]\nattention_dropout = -0.1\n").where.key == "model.attention_dropout");
  const core::error cuda =
      parse_bad("[model]\nattention_dropout = 0.1\n[runtime]\ndevice = \"cuda\"\n");
  CHECK(cuda.where.key == "model.attention_dropout");
  CHECK(contains(cuda.message, "CUDA"));
  CHECK(parse_ok("[model]\nhidden_dropout = 0.1\n[runtime]\ndevice = \"cuda\"\n")
            .model.hidden_dropout == 0.1f);
}

TEST_CASE("a cross-key error about a defaulted key points at the file") {
  // num_layers keeps its default 4; the stage count comes from the file.
  const core::error e = parse_bad("[parallel]\npipeline_stage = 3\n");
  CHECK(e.where.key == "model.num_layers");
  CHECK(e.where.file == "test.toml");
  CHECK(e.where.line == 0);
}

TEST_CASE("overrides set every value type and are recorded as --set") {
  const core::config c = load_ok("tiny.toml");
  auto r = core::load_config(configs_dir + "tiny.toml",
                             {"parallel.pipeline_stage=4", "optimizer.lr=1e-4",
                              "runtime.record=false", "runtime.run_dir=runs/other",
                              "data.val=\"a b.bin\"", "checkpoint.dir=2024",
                              "model.arch = llama", "train.steps=10", "train.steps=20"});
  REQUIRE(r.ok());
  CHECK(r->parallel.pipeline_stage == 4);
  CHECK(r->optimizer.lr == 1e-4);
  CHECK_FALSE(r->runtime.record);
  CHECK(r->runtime.run_dir == "runs/other");
  CHECK(r->data.val == "a b.bin");
  CHECK(r->checkpoint.dir == "2024");  // a string key keeps the text even if it looks like a number
  CHECK(r->model.arch == core::arch_kind::llama);
  CHECK_FALSE(r->model.tie_embeddings);  // the llama default follows the overridden arch
  CHECK(r->train.steps == 20);           // the last override wins
  CHECK(r->origins.at("train.steps").file == "--set train.steps=20");
  CHECK(r->origins.at("model.hidden_size").line == c.origins.at("model.hidden_size").line);
  bool found = false;
  for (const auto& e : core::config_entries(*r))
    if (e.key == "parallel.pipeline_stage") {
      found = true;
      CHECK(e.origin == "--set");
      CHECK(std::get<std::int64_t>(e.value) == 4);
    }
  CHECK(found);
}

TEST_CASE("an override replaces a bad file value before it is checked") {
  CHECK(parse_ok("[model]\nnum_layers = 0\n", {"model.num_layers=2"}).model.num_layers == 2);
}

TEST_CASE("overrides are validated like file keys and name the override") {
  const core::error unknown = parse_bad("", {"model.num_layer=3"});
  CHECK(unknown.where.file == "--set model.num_layer=3");
  CHECK(unknown.where.key == "model.num_layer");
  CHECK(unknown.message == "unknown key 'model.num_layer'; did you mean 'model.num_layers'?");

  const core::error type = parse_bad("", {"model.num_layers=four"});
  CHECK(type.where.file == "--set model.num_layers=four");
  CHECK(type.message == "expected an integer, got a string \"four\"");

  CHECK(parse_bad("", {"optimizer.zero_stage=5"}).message == "value 5 is out of range [0, 2]");
  CHECK(contains(parse_bad("", {"model.arch=gpt3"}).message, "gpt2, llama"));
  CHECK(parse_bad("", {"model.num_layers"}).message == "expected key=value");
  CHECK(contains(parse_bad("", {"model=4"}).message, "is a table"));

  const core::error cross = parse_bad("[model]\nnum_layers = 4\n", {"parallel.pipeline_stage=3"});
  CHECK(cross.where.key == "model.num_layers");
  CHECK(contains(cross.message, "pipeline_stage 3"));
}

TEST_CASE("to_toml parses back to an equal config") {
  for (const std::string name : {"tiny.toml", "gpt2_124m.toml", "llama_tiny.toml"}) {
    CAPTURE(name);
    const core::config c = load_ok(name);
    const std::string text = core::to_toml(c);
    const core::config back = parse_ok(text);
    CHECK(back == c);
    // The same text again, apart from the comment naming the source file.
    const std::string again = core::to_toml(back);
    CHECK(again.substr(again.find("[model]")) == text.substr(text.find("[model]")));
    // Every key is written out, so nothing in the copy is left to a default.
    for (const auto& e : core::config_entries(back)) CHECK(e.origin == "file");
  }
  SUBCASE("awkward strings and floats survive") {
    core::config c = parse_ok(
        "[data]\ntrain = 'C:\\dir\\\"quoted\" tab\there'\nval = \"caf\\u00e9 \\n line\"\n"
        "[optimizer]\nlr = 0.1234567890123456789\nweight_decay = 1e-300\n[train]\n"
        "seed = 9223372036854775807\n[model]\ninit_std = 0.017\n");
    const core::config back = parse_ok(core::to_toml(c));
    CHECK(back == c);
    CHECK(back.data.val == "caf\xc3\xa9 \n line");
    CHECK(back.train.seed == 9223372036854775807ULL);
  }
}

TEST_CASE("configs that differ in one key are not equal") {
  const core::config a = parse_ok("");
  CHECK(a == parse_ok("", {"train.seed=1234"}));
  CHECK_FALSE(a == parse_ok("", {"train.seed=1"}));
  CHECK_FALSE(a == parse_ok("", {"runtime.fault_inject=0:1:x"}));
}

TEST_CASE("check_files reports a missing data file at its key") {
  scratch_dir dir;
  const std::string train = dir.touch("train.bin");
  const std::string val = dir.touch("val.bin");
  dir.touch("tok/encoder.json");
  dir.touch("tok/vocab.bpe");
  const std::string head = "[data]\ntrain = '" + train + "'\nval = '" + val + "'\n";
  CHECK(core::check_files(parse_ok(head + "tokenizer_dir = '" + dir.path.string() + "/tok'\n")).ok());

  const core::config missing = parse_ok("[data]\ntrain = '" + train + "'\nval = 'nowhere/val.bin'\n");
  const core::status st = core::check_files(missing);
  REQUIRE_FALSE(st.ok());
  CHECK(st.err().where.key == "data.val");
  CHECK(st.err().where.line == 3);
  CHECK(st.err().where.column == 7);
  CHECK(st.err().message == "validation data 'nowhere/val.bin' does not exist");
  CHECK(contains(st.err().hint, "relative to the current directory"));

  const core::status empty = core::check_files(parse_ok(""));
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.err().where.key == "data.train");

  const core::status tok = core::check_files(
      parse_ok("[data]\ntrain = '" + train + "'\ntokenizer_dir = '" + dir.path.string() + "'\n"));
  REQUIRE_FALSE(tok.ok());
  CHECK(tok.err().where.key == "data.tokenizer_dir");
  CHECK(contains(tok.err().message, "encoder.json"));

  // data.tokenizer: a tokenizer.json file, or a folder holding one; checked at its own key.
  dir.touch("llama/tokenizer.json");
  CHECK(core::check_files(parse_ok(head + "tokenizer = '" + dir.path.string() + "/llama'\n")).ok());
  CHECK(core::check_files(
            parse_ok(head + "tokenizer = '" + dir.path.string() + "/llama/tokenizer.json'\n"))
            .ok());
  CHECK(core::check_files(parse_ok(head + "tokenizer_dir = '" + dir.path.string() + "/llama'\n")).ok());
  const core::status absent = core::check_files(
      parse_ok(head + "tokenizer = '" + dir.path.string() + "/nope/tokenizer.json'\n"));
  REQUIRE_FALSE(absent.ok());
  CHECK(absent.err().where.key == "data.tokenizer");
  CHECK(contains(absent.err().message, "does not exist"));
  CHECK(contains(absent.err().hint, "tokenizer.json"));

  SUBCASE("a glob must match at least one shard") {
    CHECK(core::check_files(parse_ok("[data]\ntrain = '" + dir.path.string() + "/*.bin'\n")).ok());
    const core::status none =
        core::check_files(parse_ok("[data]\ntrain = '" + dir.path.string() + "/*.u16'\n"));
    REQUIRE_FALSE(none.ok());
    CHECK(contains(none.err().message, "matches no file"));
  }
  SUBCASE("a missing path set by an override names the override") {
    const core::status o = core::check_files(parse_ok("", {"data.train=missing.bin"}));
    REQUIRE_FALSE(o.ok());
    CHECK(o.err().where.file == "--set data.train=missing.bin");
  }
}

TEST_CASE("load_config names a config file it cannot open") {
  auto r = core::load_config("no/such/config.toml");
  REQUIRE_FALSE(r.ok());
  CHECK(r.err().where.file == "no/such/config.toml");
  CHECK(contains(r.err().message, "cannot open"));
}

TEST_CASE("a load error carries the file path") {
  scratch_dir dir;
  const std::string path = (dir.path / "bad.toml").string();
  std::ofstream(path) << "[model]\nnum_layers = 4\nnum_heads = 3\n";
  auto r = core::load_config(path);
  REQUIRE_FALSE(r.ok());
  CHECK(r.err().where.file == path);
  CHECK(r.err().where.line == 0);  // hidden_size kept its default: no line to point at
  CHECK(contains(r.err().to_string(), path + ": model.hidden_size: hidden_size 128 is not divisible by num_heads 3"));
}

TEST_CASE("configs/README.md documents every key") {
  std::ifstream in(configs_dir + "README.md");
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  for (const auto& e : core::config_entries(core::config{})) {
    CAPTURE(e.key);
    CHECK(contains(text.str(), "`" + e.key + "`"));
  }
}

TEST_CASE("optimizer.offload is parsed (off by default); nondeterminism is refused, not ignored") {
  CHECK_FALSE(parse_ok("").optimizer.offload);
  CHECK(parse_ok("[optimizer]\noffload = true\n").optimizer.offload);
  const core::error nd = parse_bad("[runtime]\ndeterministic = false\n");
  CHECK(nd.where.key == "runtime.deterministic");
  CHECK(contains(nd.hint, "deterministic = true"));
  const core::error set = parse_bad("", {"runtime.deterministic=false"});
  CHECK(set.where.file == "--set runtime.deterministic=false");
}

TEST_CASE("data.tokenizer and data.tokenizer_dir name one tokenizer; setting both is refused") {
  auto c = parse_ok("[data]\ntokenizer = 'data/llama3'\n");
  CHECK(c.data.tokenizer_spec() == "data/llama3");
  CHECK(parse_ok("[data]\ntokenizer_dir = 'data/gpt2'\n").data.tokenizer_spec() == "data/gpt2");
  auto both = core::parse_config("[data]\ntokenizer = 'a'\ntokenizer_dir = 'b'\n", "both.toml");
  REQUIRE_FALSE(both.ok());
  CHECK(both.err().where.key == "data.tokenizer_dir");
  CHECK(contains(both.err().message, "both name a tokenizer"));
}

TEST_CASE("[lora]: PEFT's default targets, alpha = rank, lists from arrays and --set") {
  const core::config g = parse_ok("[lora]\nrank = 8\n");
  CHECK(g.model.lora.targets == std::vector<std::string>{"c_attn"});
  CHECK(g.model.lora.alpha == 8);
  const core::config l = parse_ok("[model]\narch = \"llama\"\n[lora]\nrank = 4\nalpha = 16\n");
  CHECK(l.model.lora.targets == std::vector<std::string>{"q_proj", "v_proj"});
  CHECK(l.model.lora.alpha == 16);
  const core::config t = parse_ok("[lora]\nrank = 2\ntargets = [\"c_attn\", \"mlp.c_proj\"]\n"
                                  "trainable = [\"ln_f\"]\n");
  CHECK(t.model.lora.targets == std::vector<std::string>{"c_attn", "mlp.c_proj"});
  CHECK(t.model.lora.trainable == std::vector<std::string>{"ln_f"});
  CHECK(parse_ok("", {"lora.rank=2", "lora.targets=c_fc, c_proj"}).model.lora.targets ==
        std::vector<std::string>{"c_fc", "c_proj"});
  CHECK(parse_ok("", {"lora.freeze=[\"wte\"]"}).model.lora.freeze == std::vector<std::string>{"wte"});
  // No table: nothing partial.
  CHECK_FALSE(parse_ok("").model.lora.partial());
  // The resolved config reads back equal, lists written as arrays.
  const std::string text = core::to_toml(t);
  CHECK(contains(text, "targets = [\"c_attn\", \"mlp.c_proj\"]"));
  CHECK(parse_ok(text) == t);
  CHECK(parse_ok(core::to_toml(parse_ok(""))) == parse_ok(""));
}

TEST_CASE("[lora]: bad keys are refused with the key, the valid names and a hint") {
  const core::error name = parse_bad("[lora]\nrank = 4\ntargets = [\"q_porj\"]\n");
  CHECK(name.where.key == "lora.targets");
  CHECK(name.where.line == 3);
  CHECK(contains(name.message, "'q_porj' is not a gpt2 module"));
  CHECK(contains(name.hint, "c_attn"));
  const core::error llama = parse_bad("[model]\narch = \"llama\"\n[lora]\nrank = 4\ntargets = [\"q_porj\"]\n");
  CHECK(contains(llama.message, "did you mean 'q_proj'?"));
  CHECK(contains(parse_bad("[lora]\nrank = -1\n").message, "out of range [0, 65536]"));
  const core::error no_rank = parse_bad("[lora]\ntargets = [\"c_attn\"]\n");
  CHECK(no_rank.where.key == "lora.targets");
  CHECK(contains(no_rank.message, "lora.rank is 0"));
  CHECK(contains(parse_bad("[lora]\nalpha = 16\n").message, "lora.rank is 0"));
  const core::error both = parse_bad("[lora]\nrank = 4\nfreeze = [\"wte\"]\n");
  CHECK(both.where.key == "lora.freeze");
  CHECK(contains(both.hint, "lora.trainable"));
  CHECK(contains(parse_bad("[lora]\nfreeze = [\"wte\"]\ntrainable = [\"ln_f\"]\n").message,
                 "both set"));
  CHECK(contains(parse_bad("[lora]\ntrainable = [\"ln_3\"]\n").message, "'ln_3' is not a gpt2 module"));
  CHECK(contains(parse_bad("[lora]\nrank = 2\ntargets = [\"ln_1\"]\n").message, "not a gpt2 module"));
  CHECK(contains(parse_bad("[lora]\nrank = 2\ntargets = [4]\n").message, "item 0 of the list is an integer"));
  CHECK(contains(parse_bad("[lora]\nrank = 2\ntargets = \"c_attn\"\nalpha = \"x\"\n").message,
                 "expected a number"));
  CHECK(contains(parse_bad("[lora]\nrank = 2\ntargets = 3\n").message, "expected a list of strings"));
  const core::error all = parse_bad(
      "[model]\narch = \"llama\"\n[lora]\nfreeze = [\"embed_tokens\", \"input_layernorm\", \"q_proj\", "
      "\"k_proj\", \"v_proj\", \"o_proj\", \"post_attention_layernorm\", \"gate_proj\", \"up_proj\", "
      "\"down_proj\", \"norm\", \"lm_head\"]\n");
  CHECK(contains(all.message, "nothing would train"));
  CHECK(contains(parse_bad("[lora]\nrank = 2\nrnak = 3\n").message, "did you mean 'lora.rank'?"));
}

TEST_CASE("llama3 rope scaling keys: read for llama, refused for gpt2 and without rope_scaling") {
  const core::config c = parse_ok(
      "[model]\narch = \"llama\"\nrope_scaling = \"llama3\"\nrope_scaling_factor = 32.0\n"
      "rope_original_max_position_embeddings = 4096\n");
  CHECK(c.model.rope_scaling == core::rope_scaling_kind::llama3);
  CHECK(c.model.rope_scaling_factor == 32.0);
  CHECK(c.model.rope_low_freq_factor == 1.0);
  CHECK(c.model.rope_high_freq_factor == 4.0);
  CHECK(c.model.rope_original_max_positions == 4096);
  CHECK(contains(parse_bad("[model]\narch = \"gpt2\"\nrope_scaling = \"llama3\"\n").to_string(),
                 "model.rope_scaling: gpt2 has learned position embeddings"));
  CHECK(contains(parse_bad("[model]\narch = \"llama\"\nrope_scaling_factor = 8.0\n").to_string(),
                 "model.rope_scaling_factor: set while model.rope_scaling = \"none\""));
  CHECK(contains(parse_bad("[model]\narch = \"llama\"\nrope_scaling = \"llama3\"\n"
                           "rope_high_freq_factor = 0.5\n")
                     .to_string(),
                 "rope_high_freq_factor 0.5 must be above rope_low_freq_factor 1"));
  CHECK(contains(parse_bad("[model]\narch = \"llama\"\nrope_scaling = \"yarn\"\n").to_string(),
                 "model.rope_scaling"));
}

TEST_CASE("model.init is a path, checked to exist, and not part of the model's identity") {
  // data.train is checked first: point it at a file that exists.
  core::config c = parse_ok("[model]\ninit = \"no/such/dir\"\n[data]\ntrain = \"" + configs_dir +
                            "tiny.toml\"\n");
  CHECK(c.model.init == "no/such/dir");
  const auto st = core::check_files(c);
  REQUIRE_FALSE(st.ok());
  CHECK(contains(st.err().to_string(), "model.init: initial weights 'no/such/dir' does not exist"));
  core::model_config other = c.model;
  other.init.clear();
  CHECK(other.same_model(c.model));
  CHECK_FALSE(other == c.model);
}

TEST_CASE("uneven pipeline stages: stage_layers and the first/last offsets, checked with hints") {
  const std::string four = "[model]\nnum_layers = 16\n[parallel]\npipeline_stage = 4\n";
  CHECK(core::chunk_layers(parse_ok(four + "stage_layers = [3, 5, 5, 3]\n")) ==
        std::vector<int>{3, 5, 5, 3});
  CHECK(core::chunk_layers(parse_ok(four, {"parallel.stage_layers=3,5,5,3"})) ==
        std::vector<int>{3, 5, 5, 3});
  CHECK(core::chunk_layers(parse_ok(four + "first_stage_layers = 2\nlast_stage_layers = 2\n")) ==
        std::vector<int>{2, 6, 6, 2});
  CHECK(core::chunk_layers(parse_ok(four)) == std::vector<int>{4, 4, 4, 4});
  // An uneven split lets num_layers be any count of at least one per chunk.
  CHECK(core::chunk_layers(parse_ok("[model]\nnum_layers = 5\n[parallel]\npipeline_stage = 2\n"
                                    "stage_layers = [2, 3]\n")) == std::vector<int>{2, 3});

  SUBCASE("the sum must be num_layers") {
    const core::error e = parse_bad(four + "stage_layers = [3, 5, 5, 2]\n");
    CHECK(e.where.key == "parallel.stage_layers");
    CHECK(e.where.line == 5);
    CHECK(e.message == "stage_layers [3, 5, 5, 2] sum to 15, but model.num_layers is 16");
    CHECK(contains(e.hint, "[3, 5, 5, 3]"));
    CHECK(contains(e.hint, "[4, 4, 4, 4] (even)"));
  }
  SUBCASE("one entry per chunk") {
    const core::error e = parse_bad(four + "stage_layers = [8, 8]\n");
    CHECK(e.where.key == "parallel.stage_layers");
    CHECK(contains(e.message, "stage_layers has 2 entries, but pipeline_stage 4 x virtual_pipeline 1 = 4 model chunks"));
    CHECK(contains(e.hint, "[4, 4, 4, 4]"));
    const core::error v = parse_bad(four + "virtual_pipeline = 2\nstage_layers = [3, 5, 5, 3]\n");
    CHECK(contains(v.message, "= 8 model chunks"));
    CHECK(contains(v.hint, "[2, 2, 2, 2, 2, 2, 2, 2]"));
  }
  SUBCASE("no chunk without layers") {
    const core::error e = parse_bad(four + "stage_layers = [4, 0, 6, 6]\n");
    CHECK(e.where.key == "parallel.stage_layers");
    CHECK(contains(e.message, "item 1 of the list, 0, is out of range [1, 10000]"));
    CHECK(contains(e.hint, "at least one layer"));
    const core::error t = parse_bad(four + "stage_layers = [4, \"x\", 6, 6]\n");
    CHECK(contains(t.message, "item 1 of the list is a string"));
    const core::error o = parse_bad(four, {"parallel.stage_layers=4,four"});
    CHECK(contains(o.message, "'four' in the list is not an integer"));
  }
  SUBCASE("offsets that leave an uneven rest name the nearby values that work") {
    const core::error e = parse_bad(four + "first_stage_layers = 3\n");
    CHECK(e.where.key == "parallel.first_stage_layers");
    CHECK(e.message == "num_layers 16 - first_stage_layers 3 - last_stage_layers 0 = 13 layers do "
                       "not split evenly over the other 3 chunk(s) of pipeline_stage 4 x "
                       "virtual_pipeline 1 = 4 model chunks");
    CHECK(contains(e.hint, "use parallel.first_stage_layers = 1 or 4"));
    CHECK(contains(e.hint, "parallel.stage_layers"));
    const core::error two = parse_bad("[model]\nnum_layers = 6\n[parallel]\npipeline_stage = 2\n"
                                      "first_stage_layers = 2\nlast_stage_layers = 3\n");
    CHECK(contains(two.message, "first_stage_layers 2 + last_stage_layers 3 = 5, but the two chunks "
                                "must hold num_layers 6"));
    CHECK(contains(two.hint, "= 3"));
  }
  SUBCASE("offsets need more than one chunk; not both forms at once") {
    const core::error one = parse_bad("[parallel]\nlast_stage_layers = 2\n");
    CHECK(one.where.key == "parallel.last_stage_layers");
    CHECK(contains(one.message, "one chunk holds every layer"));
    const core::error both = parse_bad(four + "stage_layers = [3, 5, 5, 3]\nfirst_stage_layers = 3\n");
    CHECK(both.where.key == "parallel.first_stage_layers");
    CHECK(contains(both.message, "both set"));
  }
  SUBCASE("the even split's error mentions the uneven keys") {
    const core::error e = parse_bad("[model]\nnum_layers = 5\n[parallel]\npipeline_stage = 2\n");
    CHECK(contains(e.hint, "parallel.stage_layers (e.g. [3, 2])"));
  }
  SUBCASE("a resolved config writes the split and reads it back") {
    const core::config c = parse_ok(four + "stage_layers = [3, 5, 5, 3]\n");
    CHECK(contains(core::to_toml(c), "stage_layers = [3, 5, 5, 3]\n"));
    CHECK(parse_ok(core::to_toml(c)) == c);
    CHECK(contains(core::to_toml(parse_ok("")), "stage_layers = []\n"));
  }
}

TEST_CASE("per-layer recompute: recompute.layers and recompute.layer_list, checked with hints") {
  const std::string four = "[model]\nnum_layers = 8\n[parallel]\npipeline_stage = 2\n";
  const core::config n = parse_ok(four + "[recompute]\nmode = \"full\"\nlayers = 3\n");
  CHECK(core::recompute_layers(n) ==
        std::vector<bool>{true, true, true, false, true, true, true, false});
  const core::config l = parse_ok(four + "[recompute]\nmode = \"selective\"\nlayer_list = [7, 1]\n");
  CHECK(core::recompute_layers(l) ==
        std::vector<bool>{false, true, false, false, false, false, false, true});
  CHECK(parse_ok(core::to_toml(l)) == l);
  CHECK(parse_ok(core::to_toml(n)) == n);

  const core::error none = parse_bad(four + "[recompute]\nlayers = 2\n");
  CHECK(none.where.key == "recompute.layers");
  CHECK(contains(none.message, "recompute.mode = \"none\""));
  CHECK(contains(none.hint, "\"full\" or \"selective\""));
  const core::error none_list = parse_bad(four + "[recompute]\nlayer_list = [2]\n");
  CHECK(none_list.where.key == "recompute.layer_list");

  const core::error both =
      parse_bad(four + "[recompute]\nmode = \"full\"\nlayers = 2\nlayer_list = [1]\n");
  CHECK(both.where.key == "recompute.layer_list");
  CHECK(contains(both.message, "both set"));

  const core::error many = parse_bad(four + "[recompute]\nmode = \"full\"\nlayers = 5\n");
  CHECK(many.where.key == "recompute.layers");
  CHECK(many.message == "recompute.layers 5 is more than the 4 layers of the largest model chunk");
  CHECK(contains(many.hint, "use 1..4"));

  const core::error past = parse_bad(four + "[recompute]\nmode = \"full\"\nlayer_list = [1, 8]\n");
  CHECK(past.where.key == "recompute.layer_list");
  CHECK(past.message == "item 1 of recompute.layer_list, 8, is not a layer of the 8-layer model");
  CHECK(contains(past.hint, "0 to num_layers - 1 = 7"));
  const core::error twice = parse_bad(four + "[recompute]\nmode = \"full\"\nlayer_list = [3, 3]\n");
  CHECK(contains(twice.message, "layer 3 is listed twice"));
  const core::error negative = parse_bad(four + "[recompute]\nmode = \"full\"\nlayer_list = [-1]\n");
  CHECK(contains(negative.message, "out of range [0, 9999]"));
}

TEST_CASE("recompute.keep_gelu: the last N layers of a GPT-2 model, whatever the split") {
  const std::string four = "[model]\nnum_layers = 8\n[parallel]\npipeline_stage = 2\n";
  CHECK(core::keep_gelu_layers(parse_ok(four)) == std::vector<bool>(8, false));
  const core::config three = parse_ok(four + "[recompute]\nkeep_gelu = 3\n");
  CHECK(core::keep_gelu_layers(three) ==
        std::vector<bool>{false, false, false, false, false, true, true, true});
  CHECK(core::keep_gelu_layers(parse_ok(four + "[recompute]\nkeep_gelu = 8\nmode = \"full\"\n")) ==
        std::vector<bool>(8, true));
  CHECK(parse_ok(core::to_toml(three)) == three);

  const core::error many = parse_bad(four + "[recompute]\nkeep_gelu = 9\n");
  CHECK(many.where.key == "recompute.keep_gelu");
  CHECK(many.message == "recompute.keep_gelu 9 is more than the model's 8 layers");
  CHECK(contains(many.hint, "use 1..8"));
  const core::error llama =
      parse_bad("[model]\narch = \"llama\"\n[recompute]\nkeep_gelu = 1\n");
  CHECK(llama.where.key == "recompute.keep_gelu");
  CHECK(contains(llama.message, "LLaMA"));
  CHECK(contains(llama.hint, "SwiGLU"));
  const core::error negative = parse_bad(four + "[recompute]\nkeep_gelu = -1\n");
  CHECK(negative.where.key == "recompute.keep_gelu");
}
