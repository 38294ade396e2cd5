// Hugging Face directories: export, import back, shards, dtypes, and every refusal with its message.
#include "model/hf.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <nlohmann/json.hpp>

#include "kernels/select.hpp"
#include "model/checkpoint.hpp"
#include "model/params.hpp"
#include "model/safetensors.hpp"
#include "tests/model/chunk_harness.hpp"
#include "tests/model/trainer_fixture.hpp"

namespace {

namespace fs = std::filesystem;
namespace hf = troupe::model::hf;
namespace st = troupe::model::safetensors;
using troupe::core::arch_kind;
using troupe::core::dtype;
using troupe::core::model_config;
using troupe::core::tensor;
using troupe::model::chunk;
using troupe::model::testing::scratch_dir;
using troupe::model::testing::tiny_config;
using json = nlohmann::json;

// Every stored parameter of a randomly initialised whole model.
hf::param_map random_params(const model_config& m, std::uint64_t seed) {
  auto be = troupe::kernels::make_backend("cpu");
  chunk c(m, troupe::model::chunk_spec{0, m.num_layers, true, true}, *be);
  c.init(seed);
  hf::param_map out;
  for (const auto& p : c.params())
    if (!p.tied) out[p.name] = be->to_host(c.param(p.name)).clone();
  return out;
}

// The whole model loaded from `dir` through a chunk, by name (tied copy left out).
hf::param_map import_params(const std::string& dir, const model_config& m) {
  auto w = hf::weights::open(dir, m);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.err().to_string()));
  auto be = troupe::kernels::make_backend("cpu");
  chunk c(m, troupe::model::chunk_spec{0, m.num_layers, true, true}, *be);
  c.init(999);
  auto st = hf::load_chunk(*w.value(), *be, m, c);
  REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.err().to_string()));
  hf::param_map out;
  for (const auto& p : c.params())
    if (!p.tied) out[p.name] = be->to_host(c.param(p.name)).clone();
  return out;
}

bool same_bits(const tensor& a, const tensor& b) {
  return a.shape() == b.shape() && a.type() == b.type() &&
         std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

void check_same(const hf::param_map& a, const hf::param_map& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& entry : a) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    const auto& t = entry.second;
    INFO("tensor " << name);
    REQUIRE(b.count(name));
    CHECK(same_bits(t, b.at(name)));
  }
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

std::string open_error(const std::string& dir, const model_config& m) {
  auto w = hf::weights::open(dir, m);
  if (!w.ok()) return w.err().to_string();
  auto be = troupe::kernels::make_backend("cpu");
  chunk c(m, troupe::model::chunk_spec{0, m.num_layers, true, true}, *be);
  auto s = hf::load_chunk(*w.value(), *be, m, c);
  return s.ok() ? std::string("(loaded)") : s.err().to_string();
}

bool has(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return true;
  MESSAGE("'" << part << "' not in: " << text);
  return false;
}

model_config llama_gqa() {
  model_config m = tiny_config(arch_kind::llama);  // 4 heads, 2 kv heads, untied
  m.rope_theta = 500000;
  m.rope_scaling = troupe::core::rope_scaling_kind::llama3;
  m.rope_scaling_factor = 8;
  m.rope_low_freq_factor = 1;
  m.rope_high_freq_factor = 4;
  m.rope_original_max_positions = 4;
  m.norm_eps = 1e-6;
  return m;
}

// A model directory written by export, with its tensors rewritten by `edit`.
void rewrite_tensors(const std::string& dir,
                     const std::function<void(std::vector<st::named_tensor>&)>& edit) {
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  std::vector<st::named_tensor> ts;
  {
    auto f = st::file::open(path);
    REQUIRE(f.ok());
    for (const auto& e : f->entries()) ts.push_back({e.name, f->load(e.name).value().clone()});
  }
  edit(ts);
  REQUIRE(st::write(path, ts, {{"format", "pt"}}).ok());
}

}  // namespace

TEST_CASE("gpt2 export stores Conv1D weights [in, out] under transformer. and imports back bit for bit") {
  scratch_dir d("hf_gpt2");
  const model_config m = tiny_config(arch_kind::gpt2);
  const hf::param_map params = random_params(m, 5);
  REQUIRE(hf::write_dir(d / "out", m, params, {}).ok());

  auto f = st::file::open(d / "out/model.safetensors");
  REQUIRE(f.ok());
  CHECK(f->metadata().at("format") == "pt");
  CHECK(f->find("lm_head.weight") == nullptr);  // tied: transformers re-ties it
  CHECK(f->find("wte.weight") == nullptr);
  const tensor conv = f->load("transformer.h.1.attn.c_attn.weight").value();
  const tensor& ours = params.at("h.1.attn.c_attn.weight");  // [3C, C]
  REQUIRE(conv.shape() == troupe::core::shape_t{ours.dim(1), ours.dim(0)});
  for (std::int64_t o = 0; o < ours.dim(0); ++o)
    for (std::int64_t i = 0; i < ours.dim(1); ++i)
      CHECK(conv.data<float>()[i * ours.dim(0) + o] == ours.data<float>()[o * ours.dim(1) + i]);
  CHECK(same_bits(f->load("transformer.ln_f.bias").value(), params.at("ln_f.bias")));

  const json cj = read_json(d / "out/config.json");
  CHECK(cj["model_type"] == "gpt2");
  CHECK(cj["architectures"][0] == "GPT2LMHeadModel");
  CHECK(cj["n_embd"] == 16);
  CHECK(cj["n_positions"] == 8);
  CHECK(fs::exists(d / "out/generation_config.json"));

  auto back = hf::read_config(d / "out");
  REQUIRE(back.ok());
  model_config want = m;
  want.ffn_hidden_size = m.ffn_size();
  want.num_kv_heads = m.num_heads;
  CHECK(back.value() == want);

  const hf::param_map imported = import_params(d / "out", m);
  check_same(imported, params);
  // Export again from the imported weights: the same file, byte for byte.
  REQUIRE(hf::write_dir(d / "again", m, imported, {}).ok());
  CHECK(troupe::model::testing::file_bytes(d / "out/model.safetensors") ==
        troupe::model::testing::file_bytes(d / "again/model.safetensors"));
}

TEST_CASE("llama with GQA, llama3 rope scaling and an untied head round-trips config and tensors") {
  scratch_dir d("hf_llama");
  const model_config m = llama_gqa();
  const hf::param_map params = random_params(m, 6);
  REQUIRE(hf::write_dir(d / "out", m, params, {}).ok());
  const json cj = read_json(d / "out/config.json");
  CHECK(cj["model_type"] == "llama");
  CHECK(cj["num_key_value_heads"] == 2);
  CHECK(cj["tie_word_embeddings"] == false);
  CHECK(cj["rope_parameters"]["rope_type"] == "llama3");
  CHECK(cj["rope_parameters"]["original_max_position_embeddings"] == 4);
  auto f = st::file::open(d / "out/model.safetensors");
  REQUIRE(f.ok());
  CHECK(f->find("lm_head.weight") != nullptr);
  CHECK(f->find("model.layers.0.self_attn.k_proj.weight")->shape == troupe::core::shape_t{8, 16});

  auto back = hf::read_config(d / "out");
  REQUIRE(back.ok());
  CHECK(back->rope_scaling == troupe::core::rope_scaling_kind::llama3);
  CHECK(back->rope_theta == 500000);
  CHECK(back->rope_original_max_positions == 4);
  CHECK(back->norm_eps == 1e-6);
  CHECK(back->kv_heads() == 2);
  CHECK(back->same_model(m));

  const hf::param_map imported = import_params(d / "out", m);
  check_same(imported, params);
  REQUIRE(hf::write_dir(d / "again", m, imported, {}).ok());
  CHECK(troupe::model::testing::file_bytes(d / "out/model.safetensors") ==
        troupe::model::testing::file_bytes(d / "again/model.safetensors"));
}

TEST_CASE("export writes the run's dropout rates; import leaves the run's own (0) in place") {
  scratch_dir d("hf_dropout");
  for (const arch_kind arch : {arch_kind::gpt2, arch_kind::llama}) {
    model_config m = arch == arch_kind::gpt2 ? tiny_config(arch) : llama_gqa();
    m.attention_dropout = 0.25f;
    m.hidden_dropout = 0.125f;
    const std::string out = d / (arch == arch_kind::gpt2 ? "gpt2" : "llama");
    REQUIRE(hf::write_dir(out, m, random_params(m, 7), {}).ok());
    const json cj = read_json(out + "/config.json");
    if (arch == arch_kind::gpt2) {
      CHECK(cj["attn_pdrop"] == 0.25);
      CHECK(cj["resid_pdrop"] == 0.125);
      CHECK(cj["embd_pdrop"] == 0.125);
    } else {
      CHECK(cj["attention_dropout"] == 0.25);
    }
    auto back = hf::read_config(out);
    REQUIRE(back.ok());
    CHECK(back->attention_dropout == 0.0f);
    CHECK(back->hidden_dropout == 0.0f);
  }
}

TEST_CASE("llama config.json in the transformers 4 form (rope_theta beside rope_scaling) reads the same") {
  scratch_dir d("hf_llama_v4");
  write_text(d / "config.json", R"({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 8, "vocab_size": 50, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 4}})");
  auto c = hf::read_config(d.path.string());
  REQUIRE(c.ok());
  CHECK(c->same_model(llama_gqa()));
}

TEST_CASE("sharded export writes an index past max_shard_bytes and imports back bit for bit") {
  scratch_dir d("hf_shards");
  const model_config m = llama_gqa();
  const hf::param_map params = random_params(m, 7);
  hf::export_options o;
  o.max_shard_bytes = 4000;  // the 50x16 fp32 embedding alone is 3200 bytes
  REQUIRE(hf::write_dir(d / "out", m, params, o).ok());
  CHECK_FALSE(fs::exists(d / "out/model.safetensors"));
  const json index = read_json(d / "out/model.safetensors.index.json");
  std::set<std::string> files;
  std::uint64_t stored = 0;
  for (auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  CHECK(files.size() > 2);
  for (const auto& fn : files) {
    auto f = st::file::open(d / ("out/" + fn));
    REQUIRE(f.ok());
    std::uint64_t bytes = 0;
    for (const auto& e : f->entries()) bytes += e.end - e.begin;
    CHECK((bytes <= 4000 || f->entries().size() == 1));
    stored += bytes;
  }
  CHECK(index["metadata"]["total_size"] == stored);
  CHECK(*files.begin() == "model-00001-of-" + std::string(5 - std::to_string(files.size()).size(), '0') +
                              std::to_string(files.size()) + ".safetensors");
  check_same(import_params(d / "out", m), params);
  // A later single-file export into the same folder removes the shards and the index.
  REQUIRE(hf::write_dir(d / "out", m, params, {}).ok());
  CHECK_FALSE(fs::exists(d / "out/model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(d / ("out/" + *files.begin())));
  check_same(import_params(d / "out", m), params);
}

TEST_CASE("bf16 export stores BF16 and imports as the fp32 masters rounded to bf16") {
  scratch_dir d("hf_bf16");
  const model_config m = tiny_config(arch_kind::llama);
  const hf::param_map params = random_params(m, 8);
  hf::export_options o;
  o.dtype = dtype::bf16;
  REQUIRE(hf::write_dir(d / "out", m, params, o).ok());
  CHECK(read_json(d / "out/config.json")["torch_dtype"] == "bfloat16");
  auto f = st::file::open(d / "out/model.safetensors");
  REQUIRE(f.ok());
  for (const auto& e : f->entries()) CHECK(e.dtype == "BF16");
  const hf::param_map back = import_params(d / "out", m);
  for (const auto& entry : params) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    const auto& t = entry.second;
    INFO(name);
    const float* a = t.data<float>();
    const float* b = back.at(name).data<float>();
    bool all = true;
    for (std::int64_t i = 0; i < t.numel(); ++i)
      all = all && b[i] == troupe::core::bf16_to_f32(troupe::core::f32_to_bf16(a[i]));
    CHECK(all);
  }
}

TEST_CASE("a gpt2 directory without the transformer. prefix, in F16, with more positions than the run uses") {
  scratch_dir d("hf_gpt2_f16");
  model_config m = tiny_config(arch_kind::gpt2);  // seq_length 8
  model_config wide = m;
  wide.seq_length = 16;
  const hf::param_map params = random_params(wide, 9);
  // Written by hand as older GPT-2 files are: bare names, Conv1D layout, fp16, a tied head stored.
  std::vector<st::named_tensor> ts;
  for (const auto& [name, t] : params) {
    tensor src = t;
    const bool conv = name.find("attn.c_") != std::string::npos ||
                      name.find("mlp.c_") != std::string::npos;
    if (conv && t.rank() == 2) {
      src = tensor::zeros({t.dim(1), t.dim(0)});
      for (std::int64_t o = 0; o < t.dim(0); ++o)
        for (std::int64_t i = 0; i < t.dim(1); ++i)
          src.data<float>()[i * t.dim(0) + o] = t.data<float>()[o * t.dim(1) + i];
    }
    tensor h = tensor::zeros(src.shape(), dtype::f16);
    for (std::int64_t i = 0; i < src.numel(); ++i)
      h.data<std::uint16_t>()[i] = troupe::core::f32_to_f16(src.data<float>()[i]);
    ts.push_back({name, h});
  }
  REQUIRE(st::write(d / "model.safetensors", ts).ok());
  write_text(d / "config.json", R"({"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 4,
    "n_positions": 16, "vocab_size": 50})");
  const hf::param_map back = import_params(d.path.string(), m);
  auto f16 = [](float x) { return troupe::core::f16_to_f32(troupe::core::f32_to_f16(x)); };
  for (const auto& entry : back) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    const auto& t = entry.second;
    INFO(name);
    const tensor& src = params.at(name);
    if (name == "wpe.weight") {
      REQUIRE(t.shape() == troupe::core::shape_t{8, 16});
      REQUIRE(src.dim(0) == 16);
    }
    bool all = true;
    for (std::int64_t i = 0; i < t.numel(); ++i) all = all && t.data<float>()[i] == f16(src.data<float>()[i]);
    CHECK(all);
  }
}

TEST_CASE("a troupe checkpoint is a weights source too, and read_checkpoint gives its parameters") {
  scratch_dir d("hf_ck");
  troupe::core::config run;
  run.model = llama_gqa();
  auto parsed = troupe::core::parse_config(troupe::core::to_toml(run), "run");
  REQUIRE(parsed.ok());
  const model_config m = parsed->model;
  const hf::param_map params = random_params(m, 10);
  troupe::model::checkpoint::save_request req;
  req.step = 3;
  req.config_toml = troupe::core::to_toml(parsed.value());
  troupe::model::checkpoint::shard_spec s{"model.safetensors", "model", {}};
  for (const auto& [n, t] : params) s.tensors.push_back({n, t});
  req.shards = {s};
  REQUIRE(troupe::model::checkpoint::save(d / "ck", req).ok());
  check_same(import_params(d / "ck", m), params);
  auto read = hf::read_checkpoint(d / "ck");
  REQUIRE(read.ok());
  CHECK(read->first.model == m);
  check_same(read->second, params);
  model_config other = m;
  other.num_layers = 4;
  CHECK(has(open_error(d / "ck", other), "model.num_layers"));
}

TEST_CASE("bad Hugging Face inputs stop with the file, the key or tensor, and what is supported") {
  scratch_dir d("hf_bad");
  const model_config g = tiny_config(arch_kind::gpt2);
  const model_config l = llama_gqa();
  REQUIRE(hf::write_dir(d / "g", g, random_params(g, 1), {}).ok());
  REQUIRE(hf::write_dir(d / "l", l, random_params(l, 2), {}).ok());
  const auto copy = [&](const std::string& from, const std::string& to) {
    fs::copy(d / from, d / to, fs::copy_options::recursive);
    return d / to;
  };
  const auto set_config = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    json j = read_json(dir + "/config.json");
    edit(j);
    write_text(dir + "/config.json", j.dump());
  };

  SUBCASE("invalid JSON") {
    const std::string dir = copy("g", "json");
    write_text(dir + "/config.json", "{\"model_type\": \"gpt2\",");
    const std::string e = open_error(dir, g);
    CHECK(has(e, dir + "/config.json"));
    CHECK(has(e, "invalid JSON"));
  }
  SUBCASE("another model type") {
    const std::string dir = copy("g", "bert");
    set_config(dir, [](json& j) { j["model_type"] = "bert"; });
    const std::string e = open_error(dir, g);
    CHECK(has(e, "config.json: model_type: \"bert\" is not supported"));
    CHECK(has(e, "supported: \"gpt2\" (GPT2LMHeadModel) and \"llama\" (LlamaForCausalLM)"));
  }
  SUBCASE("an unsupported rope scaling") {
    const std::string dir = copy("l", "yarn");
    set_config(dir, [](json& j) { j["rope_parameters"]["rope_type"] = "yarn"; });
    const std::string e = open_error(dir, l);
    CHECK(has(e, "rope_parameters.rope_type: \"yarn\" is not supported"));
    CHECK(has(e, "supported rope scaling: \"llama3\""));
  }
  SUBCASE("llama3 scaling without its factors") {
    const std::string dir = copy("l", "nofactor");
    set_config(dir, [](json& j) { j["rope_parameters"].erase("low_freq_factor"); });
    CHECK(has(open_error(dir, l), "rope_parameters.low_freq_factor: missing"));
  }
  SUBCASE("an unsupported activation, bias or head_dim") {
    const std::string dir = copy("l", "act");
    set_config(dir, [](json& j) { j["hidden_act"] = "gelu"; });
    CHECK(has(open_error(dir, l), "hidden_act: is \"gelu\""));
    set_config(dir, [](json& j) { j["hidden_act"] = "silu"; j["attention_bias"] = true; });
    CHECK(has(open_error(dir, l), "attention_bias: is true, troupe supports only false"));
    set_config(dir, [](json& j) { j["attention_bias"] = false; j["head_dim"] = 8; });
    CHECK(has(open_error(dir, l), "head_dim: is 8, troupe supports only hidden_size / num_attention_heads = 4"));
  }
  SUBCASE("a wrongly typed key") {
    const std::string dir = copy("g", "typed");
    set_config(dir, [](json& j) { j["n_layer"] = "two"; });
    CHECK(has(open_error(dir, g), "config.json: n_layer: is \"two\", expected a whole number"));
  }
  SUBCASE("a [model] table that describes another model") {
    model_config wrong = g;
    wrong.hidden_size = 32;
    const std::string e = open_error(d / "g", wrong);
    CHECK(has(e, "config.json: n_embd: is 16, but the run's [model] has hidden_size = 32"));
    CHECK(has(e, "troupe import DIR --out CONFIG.toml"));
    model_config longer = g;
    longer.seq_length = 16;
    CHECK(has(open_error(d / "g", longer), "n_positions: is 8, but the run's [model] has seq_length = 16 (above it)"));
    model_config unscaled = l;
    unscaled.rope_scaling = troupe::core::rope_scaling_kind::none;
    CHECK(has(open_error(d / "l", unscaled), "rope_scaling.rope_type: is \"llama3\""));
  }
  SUBCASE("a missing tensor") {
    const std::string dir = copy("l", "missing");
    rewrite_tensors(dir, [](auto& ts) {
      std::erase_if(ts, [](auto& t) { return t.name == "model.layers.1.mlp.up_proj.weight"; });
    });
    const std::string e = open_error(dir, l);
    CHECK(has(e, dir + "/model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight': missing"));
  }
  SUBCASE("a missing untied head") {
    const std::string dir = copy("l", "nohead");
    rewrite_tensors(dir, [](auto& ts) {
      std::erase_if(ts, [](auto& t) { return t.name == "lm_head.weight"; });
    });
    CHECK(has(open_error(dir, l), "tensor 'lm_head.weight': missing"));
  }
  SUBCASE("a misshapen tensor") {
    const std::string dir = copy("g", "shape");
    rewrite_tensors(dir, [](auto& ts) {
      for (auto& t : ts)
        if (t.name == "transformer.h.0.mlp.c_fc.weight") t.value = tensor::zeros({64, 16});
    });
    const std::string e = open_error(dir, g);
    CHECK(has(e, "tensor 'transformer.h.0.mlp.c_fc.weight': has shape [16, 64] after the Conv1D "
                 "transpose (stored [in, out] [64, 16]), the model needs [64, 16]"));
  }
  SUBCASE("a dtype troupe cannot read") {
    const std::string dir = copy("g", "dtype");
    rewrite_tensors(dir, [](auto& ts) {
      for (auto& t : ts)
        if (t.name == "transformer.ln_f.weight") t.value = tensor::zeros({16}, dtype::i32);
    });
    const std::string e = open_error(dir, g);
    CHECK(has(e, "tensor 'transformer.ln_f.weight': has dtype I32, which troupe cannot read"));
    CHECK(has(e, "supported tensor dtypes: F32, BF16, F16"));
  }
  SUBCASE("no weights file, or an index naming a tensor its shard lacks") {
    const std::string dir = copy("g", "noweights");
    fs::remove(dir + "/model.safetensors");
    CHECK(has(open_error(dir, g), "neither model.safetensors nor model.safetensors.index.json"));
    write_text(dir + "/model.safetensors.index.json", "{\"weight_map\": {\"x\": \"../model.safetensors\"}}");
    CHECK(has(open_error(dir, g), "weight_map.x: names '../model.safetensors', not a file in the directory"));
  }
  SUBCASE("neither a model directory nor a checkpoint") {
    fs::create_directories(d / "empty");
    const std::string e = open_error(d / "empty", g);
    CHECK(has(e, "is neither a Hugging Face model directory (no config.json) nor a troupe checkpoint"));
  }
}

TEST_CASE("parse_size reads transformers' units and refuses anything else") {
  CHECK(hf::parse_size("5GB").value() == 5'000'000'000ULL);
  CHECK(hf::parse_size("500MB").value() == 500'000'000ULL);
  CHECK(hf::parse_size("2GiB").value() == 2ULL << 30);
  CHECK(hf::parse_size("1234").value() == 1234);
  for (const char* bad : {"", "GB", "5 GB", "-5GB", "5TB", "0"}) {
    INFO(bad);
    CHECK_FALSE(hf::parse_size(bad).ok());
  }
}

TEST_CASE("the [model] table import writes parses back to the directory's model") {
  for (model_config m : {tiny_config(arch_kind::gpt2), llama_gqa()}) {
    m.num_kv_heads = m.kv_heads();
    m.ffn_hidden_size = m.ffn_size();
    auto c = troupe::core::parse_config(hf::model_table_toml(m), "import");
    REQUIRE_MESSAGE(c.ok(), (c.ok() ? "" : c.err().to_string()));
    CHECK(c->model.same_model(m));
  }
}
