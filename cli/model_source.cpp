#include "cli/model_source.hpp"

#include <filesystem>
#include <memory>

#include "model/checkpoint.hpp"
#include "model/hf.hpp"

namespace troupe::cli {

core::result<model_source> open_model_source(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  model_source s;
  if (model::hf::is_model_dir(path) && !fs::exists(fs::path(path) / "manifest.json", ec)) {
    auto c = model::hf::read_config(path);
    if (!c) return c.err();
    s.model = c.value();
    auto w = model::hf::weights::open(path, s.model, path + "/config.json");
    if (!w) return w.err();
    s.path = path;
    s.hf_dir = true;
    std::shared_ptr<const model::hf::weights> weights = w.value();
    s.load = [weights](kernels::backend& be, const core::model_config& m, model::chunk& net) {
      return model::hf::load_chunk(*weights, be, m, net);
    };
    return s;
  }
  auto dir = model::checkpoint::resolve(path);
  if (!dir) return dir.err();
  auto opened = model::checkpoint::reader::open(dir.value());
  if (!opened) return opened.err();
  auto ck = std::make_shared<model::checkpoint::reader>(std::move(opened.value()));
  auto cfg = core::parse_config(ck->info().config_toml, dir.value() + "/manifest.json");
  if (!cfg) return cfg.err();
  s.model = cfg->model;
  s.run = cfg.value();
  s.path = dir.value();
  s.step = ck->info().next_step;
  const core::config run = cfg.value();
  s.load = [ck, run](kernels::backend& be, const core::model_config& m, model::chunk& net) {
    // A LoRA checkpoint holds the trainable weights; the frozen base is the run's starting
    // point: its seeded initialisation, or model.init's weights.
    if (!net.frozen_params().empty()) {
      net.init(run.train.seed);
      if (auto st = model::hf::load_frozen_base(run, be, net); !st) return st;
    }
    return model::checkpoint::restore(*ck, be, m, net, nullptr);
  };
  return s;
}

}  // namespace troupe::cli
