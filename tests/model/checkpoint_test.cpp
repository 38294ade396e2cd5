#include "model/checkpoint.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/params.hpp"
#include "tests/model/trainer_fixture.hpp"
#include "kernels/select.hpp"

namespace {

namespace fs = std::filesystem;
namespace ck = troupe::model::checkpoint;
using troupe::core::tensor;
using troupe::model::testing::file_bytes;
using troupe::model::testing::scratch_dir;

tensor ramp(troupe::core::shape_t shape, float start) {
  tensor t = tensor::zeros(std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + 0.125f * i;
  return t;
}

ck::save_request sample_request(int step) {
  ck::save_request r;
  r.step = step;
  r.seed = 77;
  r.config_toml = "[model]\narch = \"gpt2\"\n";
  r.shards = {{"model.safetensors", "model", {{"a.weight", ramp({4, 8}, 1)}, {"a.bias", ramp({8}, -3)}}},
              {"optimizer.safetensors", "optimizer",
               {{"a.weight.exp_avg", ramp({4, 8}, 0.5f)}, {"a.weight.exp_avg_sq", ramp({4, 8}, 2)}}}};
  return r;
}

std::string error_of(const std::string& dir) {
  auto r = ck::reader::open(dir);
  return r.ok() ? std::string("(opened)") : r.err().to_string();
}

void overwrite(const std::string& path, std::size_t offset, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::size_t data_offset_of(const std::string& file, const std::string& tensor_name) {
  auto f = troupe::model::safetensors::file::open(file);
  REQUIRE(f.ok());
  auto [p, n] = f->bytes(*f->find(tensor_name));
  return static_cast<std::size_t>(p - f->file_bytes().first);
}

troupe::core::model_config tiny_gpt2() {
  troupe::core::model_config m;
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_heads = 2;
  m.seq_length = 8;
  m.vocab_size = 40;
  return m;
}

}  // namespace

TEST_CASE("a checkpoint keeps tensors by name with step, seed, config and hashes, and moves latest") {
  scratch_dir tmp("ckpt");
  const std::string root = tmp / "run/checkpoints";
  auto dir = ck::save(root, sample_request(3));
  REQUIRE_MESSAGE(dir.ok(), dir.err().to_string());
  CHECK(fs::path(dir.value()).filename() == "step_000003");
  CHECK(file_bytes(root + "/latest") == "step_000003\n");
  for (auto& e : fs::directory_iterator(root))  // no temporary left behind
    CHECK(e.path().filename().string()[0] != '.');

  auto r = ck::reader::open(dir.value());
  REQUIRE_MESSAGE(r.ok(), r.err().to_string());
  CHECK(r->info().step == 3);
  CHECK(r->info().next_step == 3);
  CHECK(r->info().seed == 77);
  CHECK(r->info().config_toml == sample_request(3).config_toml);
  REQUIRE(r->info().files.size() == 2);
  CHECK(r->info().files[1].kind == "optimizer");
  CHECK(r->info().tensors.at("a.bias").file == "model.safetensors");
  CHECK(r->info().tensors.at("a.weight").shape == troupe::core::shape_t{4, 8});
  auto w = r->load("a.weight.exp_avg_sq");
  REQUIRE(w.ok());
  tensor want = ramp({4, 8}, 2);
  CHECK(std::memcmp(w->raw(), want.raw(), want.bytes()) == 0);
  CHECK_FALSE(r->load("a.nothing").ok());

  // The newest checkpoint is found from the checkpoint dir, the root and the run dir alike.
  REQUIRE(ck::save(root, sample_request(5)).ok());
  for (std::string p : {root, tmp / "run", root + "/step_000005"}) {
    auto res = ck::resolve(p);
    REQUIRE_MESSAGE(res.ok(), res.err().to_string());
    CHECK(fs::path(res.value()).filename() == "step_000005");
  }
  CHECK(fs::path(ck::resolve(root + "/step_000003").value()).filename() == "step_000003");
  CHECK_FALSE(ck::resolve(tmp / "nowhere").ok());
}

TEST_CASE("a checkpoint whose tensor bytes changed is refused naming the tensor and the file") {
  scratch_dir tmp("ckpt");
  auto dir = ck::save(tmp / "c", sample_request(1));
  REQUIRE(dir.ok());
  const std::string file = dir.value() + "/optimizer.safetensors";
  overwrite(file, data_offset_of(file, "a.weight.exp_avg_sq") + 17, "\x55");
  const std::string msg = error_of(dir.value());
  CHECK(msg.find("a.weight.exp_avg_sq") != std::string::npos);
  CHECK(msg.find("optimizer.safetensors") != std::string::npos);
  CHECK(msg.find("hash") != std::string::npos);
}

TEST_CASE("resuming from a root whose newest checkpoint is corrupt falls back to the previous one, naming why") {
  scratch_dir tmp("ckpt");
  const std::string root = tmp / "c";
  for (int s : {2, 4, 6}) REQUIRE(ck::save(root, sample_request(s)).ok());
  // The newest is damaged on disk, the one before it loses a file.
  const std::string newest = root + "/step_000006/optimizer.safetensors";
  overwrite(newest, data_offset_of(newest, "a.weight.exp_avg_sq") + 3, "\x55");
  fs::remove(root + "/step_000004/model.safetensors");

  std::vector<std::string> skipped;
  auto r = ck::open_for_resume(root, &skipped);
  REQUIRE_MESSAGE(r.ok(), r.err().to_string());
  CHECK(r->info().step == 2);
  REQUIRE(skipped.size() == 2);
  CHECK(skipped[0].find("step_000006") != std::string::npos);
  CHECK(skipped[0].find("a.weight.exp_avg_sq") != std::string::npos);
  CHECK(skipped[1].find("step_000004") != std::string::npos);
  CHECK(skipped[1].find("model.safetensors") != std::string::npos);

  // A checkpoint named directly is used as it is or not at all.
  skipped.clear();
  CHECK_FALSE(ck::open_for_resume(root + "/step_000006", &skipped).ok());
  CHECK(skipped.empty());
  // Nothing whole left: an error that says so.
  fs::remove(root + "/step_000002/model.safetensors");
  auto none = ck::open_for_resume(root, &skipped);
  REQUIRE_FALSE(none.ok());
  CHECK(none.err().hint.find("no older checkpoint") != std::string::npos);
}

TEST_CASE("a truncated checkpoint is refused naming the file and the cut tensor") {
  scratch_dir tmp("ckpt");
  auto dir = ck::save(tmp / "c", sample_request(1));
  REQUIRE(dir.ok());
  const std::string file = dir.value() + "/model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 8);
  const std::string msg = error_of(dir.value());
  CHECK(msg.find("model.safetensors") != std::string::npos);
  CHECK(msg.find("a.bias") != std::string::npos);
  CHECK(msg.find("truncated") != std::string::npos);
}

TEST_CASE("a checkpoint file whose header was edited is refused") {
  scratch_dir tmp("ckpt");
  auto dir = ck::save(tmp / "c", sample_request(1));
  REQUIRE(dir.ok());
  const std::string file = dir.value() + "/model.safetensors";
  std::string bytes = file_bytes(file);
  std::size_t at = bytes.find("\"pt\"");
  REQUIRE(at != std::string::npos);
  overwrite(file, at + 1, "PT");  // still valid safetensors, but not the file that was saved
  const std::string msg = error_of(dir.value());
  CHECK(msg.find("model.safetensors") != std::string::npos);
  CHECK(msg.find("header") != std::string::npos);
}

TEST_CASE("a checkpoint without a readable manifest is refused with a hint") {
  scratch_dir tmp("ckpt");
  auto dir = ck::save(tmp / "c", sample_request(1));
  REQUIRE(dir.ok());
  const std::string manifest = dir.value() + "/manifest.json";
  std::string text = file_bytes(manifest);
  std::ofstream(manifest) << text.substr(0, text.size() / 2);
  CHECK(error_of(dir.value()).find("malformed checkpoint manifest") != std::string::npos);
  fs::remove(manifest);
  CHECK(error_of(dir.value()).find("hint") != std::string::npos);
}

TEST_CASE("a disk that fills during a save fails naming the file and leaves the previous checkpoint whole and latest") {
  scratch_dir tmp("ckpt_full");
  const std::string root = tmp / "ckpt";
  auto first = ck::save(root, sample_request(2));
  REQUIRE(first.ok());
  ck::save_request second = sample_request(4);
  second.full_at_shard = 1;  // the second file runs out of space halfway (TROUPE_FAULT=enospc)
  auto failed = ck::save(root, second);
  REQUIRE_FALSE(failed.ok());
  const std::string e = failed.err().to_string();
  CHECK_MESSAGE(e.find(".step_000004.tmp/optimizer.safetensors") != std::string::npos, e);
  CHECK_MESSAGE(e.find("No space left on device") != std::string::npos, e);
  // Nothing of the failed save remains that a resume could take; the older one reads whole.
  CHECK_FALSE(fs::exists(fs::path(root) / "step_000004"));
  CHECK_FALSE(fs::exists(fs::path(root) / ".step_000004.tmp"));
  CHECK(file_bytes(root + "/latest") == "step_000002\n");
  auto resolved = ck::resolve(root);
  REQUIRE(resolved.ok());
  CHECK(resolved.value() == first.value());
  CHECK(error_of(first.value()) == "(opened)");
}

TEST_CASE("saving a step again replaces it, and keep deletes the oldest checkpoints") {
  scratch_dir tmp("ckpt");
  const std::string root = tmp / "c";
  for (int s : {1, 2, 3}) REQUIRE(ck::save(root, sample_request(s), 2).ok());
  CHECK_FALSE(fs::exists(root + "/step_000001"));
  CHECK(fs::exists(root + "/step_000002"));
  auto again = sample_request(3);
  again.seed = 99;
  REQUIRE(ck::save(root, again, 2).ok());
  auto r = ck::reader::open(root + "/step_000003");
  REQUIRE(r.ok());
  CHECK(r->info().seed == 99);
}

TEST_CASE("restore loads weights and moments by name into another split; the tied head takes wte") {
  auto be = troupe::kernels::make_backend("cpu");
  const auto cfg = tiny_gpt2();
  troupe::model::chunk whole(cfg, troupe::model::partition(cfg, 1)[0], *be);
  whole.init(5);
  auto state = troupe::model::make_optimizer_state(*be, whole);
  for (std::int64_t i = 0; i < state.exp_avg.numel(); ++i) {
    state.exp_avg.data<float>()[i] = 0.001f * static_cast<float>(i % 1000);
    state.exp_avg_sq.data<float>()[i] = 0.002f * static_cast<float>(i % 777);
  }
  scratch_dir tmp("ckpt");
  ck::save_request req;
  req.step = 2;
  req.shards = {ck::model_shard(*be, whole), ck::optimizer_shard(*be, whole, state)};
  bool stored_head = false;
  for (auto& t : req.shards[0].tensors) stored_head |= t.name == "lm_head.weight";
  CHECK_FALSE(stored_head);  // Hugging Face GPT-2 ties it too
  auto dir = ck::save(tmp / "c", req);
  REQUIRE(dir.ok());
  auto r = ck::reader::open(dir.value());
  REQUIRE(r.ok());

  std::vector<troupe::model::chunk> parts;
  std::vector<troupe::model::optimizer_state> states;
  for (const auto& spec : troupe::model::partition(cfg, 2)) {
    parts.emplace_back(cfg, spec, *be);
    parts.back().init(6);
    states.push_back(troupe::model::make_optimizer_state(*be, parts.back()));
  }
  for (std::size_t i = 0; i < parts.size(); ++i) {
    auto st = ck::restore(r.value(), *be, cfg, parts[i], &states[i]);
    REQUIRE_MESSAGE(st.ok(), st.err().to_string());
  }
  int compared = 0;
  for (std::size_t i = 0; i < parts.size(); ++i)
    for (const auto& p : parts[i].params()) {
      const std::string src = p.tied ? troupe::model::embedding_name(cfg) : p.name;
      const auto& w = *std::find_if(whole.params().begin(), whole.params().end(),
                                    [&](auto& q) { return q.name == src; });
      CHECK(std::memcmp(parts[i].param(p.name).raw(), whole.param(src).raw(), w.numel * 4) == 0);
      CHECK(std::memcmp(states[i].exp_avg.slice(p.offset, p.shape).raw(),
                        state.exp_avg.slice(w.offset, w.shape).raw(), w.numel * 4) == 0);
      CHECK(std::memcmp(states[i].exp_avg_sq.slice(p.offset, p.shape).raw(),
                        state.exp_avg_sq.slice(w.offset, w.shape).raw(), w.numel * 4) == 0);
      ++compared;
    }
  // The split's head copy on top of the whole model's tensors, whose head reads its embedding.
  CHECK(whole.shares_head());
  CHECK(compared == static_cast<int>(whole.params().size()) + 1);
}

TEST_CASE("restore refuses a checkpoint of another model shape, naming the tensor") {
  auto be = troupe::kernels::make_backend("cpu");
  auto cfg = tiny_gpt2();
  troupe::model::chunk small(cfg, troupe::model::partition(cfg, 1)[0], *be);
  small.init(1);
  scratch_dir tmp("ckpt");
  ck::save_request req;
  req.shards = {ck::model_shard(*be, small)};
  auto dir = ck::save(tmp / "c", req);
  REQUIRE(dir.ok());
  auto r = ck::reader::open(dir.value());
  REQUIRE(r.ok());
  cfg.hidden_size = 32;
  troupe::model::chunk big(cfg, troupe::model::partition(cfg, 1)[0], *be);
  auto st = ck::restore(r.value(), *be, cfg, big, nullptr);
  REQUIRE_FALSE(st.ok());
  CHECK(st.err().to_string().find("tensor 'wte.weight'") != std::string::npos);
  CHECK(st.err().to_string().find("different model configuration") != std::string::npos);
}
