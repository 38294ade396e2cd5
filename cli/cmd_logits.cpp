// `troupe logits MODEL --tokens FILE --out FILE [--device cpu|cuda]`: the model's fp32 logits for
// given token sequences, for comparing troupe with another implementation
// (bench/gpu/hf_check.py compares them with transformers). MODEL is a Hugging Face model
// directory or a troupe checkpoint (a LoRA checkpoint's frozen base remade as `troupe export`
// remakes it, bench/gpu/peft_check.py); FILE holds one sequence per line (token ids separated by
// spaces, every line the same length T <= the model's positions). The output is raw
// little-endian float32 [sequences, T, vocab_size].
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "core/files.hpp"
#include "kernels/select.hpp"
#include "model/checkpoint.hpp"
#include "model/chunk.hpp"
#include "model/hf.hpp"
#include "model/params.hpp"

namespace troupe::cli {
namespace {

struct logits_args {
  std::string model;
  std::string tokens;
  std::string out;
  std::string device = "cpu";
};

int fail(const core::error& e) {
  print_error(e.to_string());
  return 1;
}

int run_logits(const logits_args& a) {
  core::model_config m;
  if (model::hf::is_model_dir(a.model)) {
    auto c = model::hf::read_config(a.model);
    if (!c) return fail(c.err());
    m = c.value();
  } else {
    auto ck = model::hf::read_checkpoint(a.model);
    if (!ck) return fail(ck.err());
    m = ck->first.model;
  }
  core::input_spec spec;
  spec.what = "token file";
  spec.max_bytes = std::uint64_t(1) << 30;
  spec.hint = "one sequence of token ids per line";
  auto text = core::read_input(a.tokens, spec);
  if (!text) return fail(text.err());
  std::vector<std::int32_t> ids;
  int rows = 0, T = 0, line_no = 0;
  std::istringstream lines(text.value());
  for (std::string line; std::getline(lines, line);) {
    ++line_no;
    std::istringstream in(line);
    std::vector<std::int32_t> row;
    for (std::string w; in >> w;) {
      std::size_t used = 0;
      long v = -1;
      try {
        v = std::stol(w, &used);
      } catch (const std::exception&) {
      }
      if (used != w.size() || v < 0 || v >= m.vocab_size)
        return fail(core::error::at_key(a.tokens, "", line_no, 0,
                                        "'" + w + "' is not a token id in 0.." +
                                            std::to_string(m.vocab_size - 1)));
      row.push_back(static_cast<std::int32_t>(v));
    }
    if (row.empty()) continue;
    if (T == 0) T = static_cast<int>(row.size());
    if (static_cast<int>(row.size()) != T)
      return fail(core::error::at_key(a.tokens, "", line_no, 0,
                                      std::to_string(row.size()) + " tokens, the first line has " +
                                          std::to_string(T),
                                      "every sequence has the same length"));
    ids.insert(ids.end(), row.begin(), row.end());
    ++rows;
  }
  if (rows == 0) return fail(core::error::at_file(a.tokens, "holds no token ids"));
  if (T > m.seq_length)
    return fail(core::error::at_file(a.tokens, std::to_string(T) + " tokens per sequence, above the "
                                                   "model's " + std::to_string(m.seq_length) +
                                                   " positions"));
  const int positions = m.seq_length;
  m.seq_length = T;
  std::unique_ptr<kernels::backend> be = kernels::make_backend(a.device);
  model::chunk net(m, model::chunk_spec{0, m.num_layers, true, true}, *be);
  if (m.lora.partial()) {
    // A LoRA (or partly frozen) checkpoint holds only what trains: read_checkpoint remakes the
    // frozen base as the run did and adds the checkpoint's weights, adapters included.
    auto ck = model::hf::read_checkpoint(a.model);
    if (!ck) return fail(ck.err());
    for (const auto* list : {&net.params(), &net.frozen_params()})
      for (const model::param_info& p : *list) {
        auto it = ck->second.find(p.tied ? model::embedding_name(m) : p.name);
        if (it == ck->second.end())
          return fail(core::error::at_file(a.model, "holds no tensor '" + p.name + "'",
                                           "the checkpoint and its manifest do not belong together"));
        core::tensor t = it->second;
        // GPT-2's position table holds the checkpoint's positions; the first T rows serve here.
        if (t.rank() == 2 && p.shape.size() == 2 && t.shape() != p.shape && t.dim(0) == positions &&
            p.shape[0] == T && t.dim(1) == p.shape[1])
          t = t.rows(0, T).clone();
        if (t.shape() != p.shape)
          return fail(core::error::at_file(a.model, "tensor '" + p.name + "' has shape " +
                                                        core::shape_string(t.shape()) + ", the model needs " +
                                                        core::shape_string(p.shape)));
        core::tensor dst = net.param(p.name);
        be->copy(t, dst);
      }
    net.params_updated();
  } else {
    auto w = model::hf::weights::open(a.model, m);
    if (!w) return fail(w.err());
    if (auto st = model::hf::load_chunk(*w.value(), *be, m, net); !st) return fail(st.err());
  }
  core::tensor input = core::tensor::zeros({static_cast<std::int64_t>(ids.size())}, core::dtype::i32);
  std::copy(ids.begin(), ids.end(), input.data<std::int32_t>());
  core::tensor logits =
      be->to_host(net.forward_logits(be->dev().is_cpu() ? input : be->from_host(input)));
  std::ofstream out(a.out, std::ios::binary);
  out.write(static_cast<const char*>(logits.raw()), static_cast<std::streamsize>(logits.bytes()));
  if (!out) return fail(core::error::at_file(a.out, "cannot write the logits"));
  std::printf("logits [%d, %d, %d] of %s on %s -> %s\n", rows, T, m.vocab_size, a.model.c_str(),
              a.device.c_str(), a.out.c_str());
  return 0;
}

const command_registrar reg{command{
    "logits", "Dump a model's fp32 logits for token sequences (checks against other implementations)",
    [](CLI::App& app) {
      auto a = std::make_shared<logits_args>();
      app.add_option("model", a->model, "Hugging Face model directory or troupe checkpoint")
          ->required();
      app.add_option("--tokens", a->tokens, "token ids, one sequence per line")->required();
      app.add_option("--out", a->out, "raw float32 [sequences, T, vocab] output")->required();
      app.add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
      return [a] { return run_logits(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
