// `troupe config check CONFIG [--set key=value]... [--json] [--no-file-check]`: validates a run
// configuration and prints every resolved key (marking those left at their default or set on the
// command line) and the derived numbers a user plans with: global batch, tokens per step, worker
// count, layers per stage, parameter count. Exit 0 when valid, 1 with the error otherwise.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "core/chunk_placement.hpp"
#include "core/config.hpp"
#include "core/machine.hpp"
#include "model/params.hpp"
#include "runtime/build.hpp"
#include "runtime/preflight.hpp"

namespace troupe::cli {

namespace {

struct check_options {
  std::string path;
  std::vector<std::string> sets;
  bool json = false;
  bool no_file_check = false;
};

// Where the chunks sit, which sets the layers per pipeline rank: "interleaved" (chunk c on rank
// c % p), "v" (zb_v's V: c on rank c for c < p, 2p-1-c after), or, for a schedule file under
// --no-file-check, "unknown": the file's `placement` line is not read, and the ranks' layers are
// shown as if interleaved.
struct placement_info {
  bool v = false;
  std::string name = "interleaved";
};

placement_info chunk_placement(const check_options& o, const core::config& c) {
  placement_info pl;
  pl.v = core::chunks_in_v(c);
  if (!o.no_file_check) {
    // The schedule as the runtime builds it (a name, a plugin's generator or a file) says.
    auto s = actors::build_schedule(c, actors::layout_of(c).microbatches);
    if (s.ok()) pl.v = s.value().place == schedules::placement::v;
  } else if (!c.schedule.file.empty()) {
    pl.name = "unknown";
    return pl;
  }
  pl.name = pl.v ? "v" : "interleaved";
  return pl;
}

std::string with_commas(std::int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

// 7234432 -> "7.23M", 6738415616 -> "6.74B".
std::string short_count(std::int64_t n) {
  if (n >= 1'000'000'000) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1'000'000) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1'000) return fmt::format("{:.1f}k", n / 1e3);
  return std::to_string(n);
}

// Ordered, so keys print in documentation order rather than alphabetically.
using json = nlohmann::ordered_json;

json value_json(const core::config_value& v) {
  return std::visit([](const auto& x) { return json(x); }, v);
}

std::string value_text(const core::config_value& v) {
  if (const auto* s = std::get_if<std::string>(&v)) return nlohmann::json(*s).dump();
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const auto* i = std::get_if<std::int64_t>(&v)) return std::to_string(*i);
  return nlohmann::json(std::get<double>(v)).dump();
}

json error_json(const core::error& e) {
  return {{"message", e.message}, {"file", e.where.file}, {"key", e.where.key},
          {"line", e.where.line}, {"column", e.where.column}, {"hint", e.hint}};
}

// Parameters that train ([lora]: adapters and the modules lora.trainable names), the tied head
// copy counted once.
std::int64_t trainable_parameters(const core::config& c) {
  std::int64_t n = 0;
  for (const auto& d : model::define_params(c.model, model::partition(c.model, 1)[0]))
    if (!d.info.tied) n += d.info.numel;
  return n;
}

void print_text(const check_options& o, const core::config& c, const core::derived_values& d,
                const placement_info& pl) {
  std::printf("%s: valid%s\n", o.path.c_str(),
              o.no_file_check ? " (data files not checked)" : "");
  std::string table;
  for (const auto& e : core::config_entries(c)) {
    const auto dot = e.key.find('.');
    if (e.key.substr(0, dot) != table) {
      table = e.key.substr(0, dot);
      std::printf("\n[%s]\n", table.c_str());
    }
    const std::string line = fmt::format("  {:<28}= {}", e.key.substr(dot + 1), value_text(e.value));
    if (e.origin == "file")
      std::printf("%s\n", line.c_str());
    else
      std::printf("%-60s # %s\n", line.c_str(), e.origin.c_str());
  }
  const auto& p = c.parallel;
  std::printf("\nderived\n");
  const auto row = [](const char* name, const std::string& value, const std::string& how) {
    std::printf("  %-18s= %-14s %s\n", name, value.c_str(), how.c_str());
  };
  row("global_batch", with_commas(d.global_batch),
      fmt::format("sequences = micro_batch_size {} x micro_batch_num {} x "
                  "gradient_accumulation_steps {} x data_parallel {}",
                  p.micro_batch_size, p.micro_batch_num, c.train.gradient_accumulation_steps,
                  p.data_parallel));
  row("tokens_per_step", with_commas(d.tokens_per_step),
      fmt::format("= global_batch {} x seq_length {}", d.global_batch, c.model.seq_length));
  row("workers", std::to_string(d.workers),
      fmt::format("= data_parallel {} x model_parallel {} x pipeline_stage {}", p.data_parallel,
                  p.model_parallel, p.pipeline_stage));
  const std::vector<int> split = core::chunk_layers(c);
  if (std::all_of(split.begin(), split.end(), [&](int n) { return n == split.front(); })) {
    row("layers_per_stage", std::to_string(d.layers_per_stage),
        fmt::format("= num_layers {} / pipeline_stage {}", c.model.num_layers, p.pipeline_stage));
  } else {
    std::string chunks, stages;
    for (int n : split) chunks += (chunks.empty() ? "" : ", ") + std::to_string(n);
    for (int n : d.stage_layers) stages += (stages.empty() ? "" : ", ") + std::to_string(n);
    const std::string where =
        p.virtual_pipeline == 1 ? ""
        : pl.name == "v"        ? "; chunks in a V: rank r holds chunks r, 2 x pipeline_stage - 1 - r, ..."
        : pl.name == "unknown"  ? "; taken as interleaved: schedule.file's placement is not read "
                                  "under --no-file-check"
                                : "; interleaved: rank r holds chunks r, r + pipeline_stage, ...";
    row("layers_per_stage", std::to_string(d.layers_per_stage),
        fmt::format("the largest of [{}] per pipeline rank (uneven: chunks [{}]{})", stages, chunks,
                    where));
  }
  row("parameters", with_commas(d.parameters),
      short_count(d.parameters) +
          (c.model.tie_embeddings ? " (embedding and head tied, counted once)" : ""));
  if (c.model.lora.partial()) {
    const std::int64_t t = trainable_parameters(c);
    row("trainable_parameters", with_commas(t),
        fmt::format("{} of the model's with [lora]: adapters and lora.trainable; the rest is frozen",
                    short_count(t)));
  }
}

void print_json(const check_options& o, const core::config& c, const core::derived_values& d,
                const placement_info& pl) {
  json cfg = json::object();
  for (const auto& e : core::config_entries(c)) {
    const auto dot = e.key.find('.');
    cfg[e.key.substr(0, dot)][e.key.substr(dot + 1)] = value_json(e.value);
  }
  const json out = {
      {"file", o.path},
      {"valid", true},
      {"files_checked", !o.no_file_check},
      {"config", cfg},
      {"derived",
       {{"global_batch", d.global_batch},
        {"tokens_per_step", d.tokens_per_step},
        {"workers", d.workers},
        {"layers_per_stage", d.layers_per_stage},
        {"stage_layers", d.stage_layers},
        {"chunk_layers", core::chunk_layers(c)},
        {"chunk_placement", pl.name},
        {"parameters", d.parameters},
        {"trainable_parameters", trainable_parameters(c)}}}};
  std::printf("%s\n", out.dump(2).c_str());
}

int run_check(const check_options& o) {
  auto c = core::load_config(o.path, o.sets);
  // The checks `troupe train` makes before it starts (files, schedule, shards, evaluation).
  core::status st = c ? (o.no_file_check ? core::status{} : actors::preflight(*c))
                      : core::status{c.err()};
  if (!st) {
    if (o.json) {
      const json out = {{"file", o.path}, {"valid", false}, {"error", error_json(st.err())}};
      std::printf("%s\n", out.dump(2).c_str());
    }
    print_error(st.err().to_string());
    return 1;
  }
  const placement_info pl = chunk_placement(o, *c);
  core::derived_values d = core::derive(*c);
  d.stage_layers = core::rank_layers(*c, pl.v);
  d.layers_per_stage = *std::max_element(d.stage_layers.begin(), d.stage_layers.end());
  // Where the workers run is decided at launch: a config too large for this machine as one
  // process is still valid, and `troupe launch` may spread it over nodes.
  const int workers = d.workers;
  if (auto m = core::check_local_workers(*c, workers, false,
                                         std::to_string(workers) + " workers in one process");
      !m)
    std::fprintf(stderr, "troupe: warning: `troupe train` on this machine would refuse: %s\n",
                 m.err().to_string().c_str());
  if (o.json)
    print_json(o, *c, d, pl);
  else
    print_text(o, *c, d, pl);
  return 0;
}

const command_registrar registrar{command{
    "config", "Inspect run configurations", [](CLI::App& app) -> std::function<int()> {
      auto o = std::make_shared<check_options>();
      app.require_subcommand(1);
      CLI::App* check = app.add_subcommand(
          "check", "Validate a config and print its resolved keys and derived values "
                   "(global batch, tokens per step, workers, layers per stage, parameters)");
      check->add_option("CONFIG", o->path, "TOML config file (see configs/README.md)")->required();
      check->add_option("--set", o->sets, "override a key, e.g. --set parallel.pipeline_stage=4 "
                                          "(repeatable; the value is read as TOML, bare words "
                                          "as strings)")
          ->allow_extra_args(false);
      check->add_flag("--json", o->json, "print a JSON object with \"config\" and \"derived\"");
      check->add_flag("--no-file-check", o->no_file_check,
                      "skip checking that the data and tokenizer files exist");
      return [o] { return run_check(*o); };
    }}};

}  // namespace

}  // namespace troupe::cli
