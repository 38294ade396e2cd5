// A checkpoint manifest (manifest.json), as a resumed run reads it: parsed from its text, then
// written into the newest of two checkpoints that model::checkpoint::save made in a scratch
// directory and opened there with every tensor it lists loaded, then resumed from the root, which
// must fall back to the older, intact checkpoint whenever the newest does not open.
// fuzz/make_seeds.py writes the seed manifests for exactly these checkpoints (same tensors, same
// config text): keep the two in step.
#include <cstring>
#include <filesystem>

#include "fuzz/fuzz_input.hpp"
#include "model/checkpoint.hpp"

namespace {

namespace ck = troupe::model::checkpoint;
namespace fs = std::filesystem;
using troupe::core::tensor;

tensor ramp(troupe::core::shape_t shape, float step) {
  tensor t = tensor::zeros(std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = step * static_cast<float>(i);
  return t;
}

ck::save_request request(int step) {
  tensor bias = tensor::zeros({2}, troupe::core::dtype::bf16);
  const std::uint16_t bits[2] = {0x3f80, 0x4000};  // 1.0, 2.0
  std::memcpy(bias.raw(), bits, sizeof bits);
  ck::save_request r;
  r.step = step;
  r.seed = 1234;
  r.config_toml = "[model]\narch = \"gpt2\"\n";
  r.shards = {{"model.safetensors", "model", {{"wte.weight", ramp({4, 2}, 0.25f)}, {"ln_f.bias", bias}}},
              {"optimizer.safetensors", "optimizer", {{"wte.weight.exp_avg", ramp({4, 2}, 0.5f)}}}};
  return r;
}

struct scratch {
  std::string root;
  std::string newest;  // the checkpoint whose manifest each input replaces
  scratch() {
    const char* tmp = std::getenv("TMPDIR");
    root = std::string(tmp && *tmp ? tmp : "/tmp") + "/troupe_fuzz_checkpoint_" +
           std::to_string(static_cast<long>(::getpid()));
    fs::remove_all(root);
    for (int step : {1, 2}) {
      auto dir = ck::save(root, request(step));
      if (!dir.ok()) {
        std::fprintf(stderr, "fuzz_checkpoint: %s\n", dir.err().to_string().c_str());
        std::abort();
      }
      newest = dir.value();
    }
  }
  ~scratch() {
    std::error_code ignored;
    fs::remove_all(root, ignored);
  }
};

const scratch* checkpoints = nullptr;

}  // namespace

// Saving fsyncs every file: done once, before libFuzzer starts timing inputs.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static const scratch s;
  checkpoints = &s;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const scratch& s = *checkpoints;
  const std::string_view text = troupe::fuzz::as_text(data, size);
  auto parsed = ck::parse_manifest(text, "manifest.json");

  std::FILE* f = std::fopen((s.newest + "/manifest.json").c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  auto opened = ck::reader::open(s.newest);
  if (opened.ok()) {
    if (!parsed.ok()) __builtin_trap();
    for (const auto& [name, record] : opened.value().info().tensors) {
      auto t = opened.value().load(name);
      if (!t.ok() || t.value().shape() != record.shape) __builtin_trap();
    }
  }
  std::vector<std::string> skipped;
  auto resumed = ck::open_for_resume(s.root, &skipped);
  if (!resumed.ok()) __builtin_trap();
  const bool newest = fs::path(resumed.value().dir()) == fs::path(s.newest);
  if (newest != opened.ok() || skipped.size() != (opened.ok() ? 0u : 1u)) __builtin_trap();
  return 0;
}
