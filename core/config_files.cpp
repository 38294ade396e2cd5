// Checks of a config against the file system: the data and tokenizer it names exist. Whether a
// shard's header is valid is the data loader's business; this only catches a wrong path before a
// run starts. Paths are relative to the current directory, as everywhere in a config.
#include <glob.h>

#include <filesystem>
#include <string>

#include "core/config.hpp"

namespace troupe::core {

namespace {

namespace fs = std::filesystem;

bool is_pattern(const std::string& path) { return path.find_first_of("*?[") != std::string::npos; }

// A path exists, or a glob pattern matches at least one path.
bool found(const std::string& path) {
  if (!is_pattern(path)) {
    std::error_code ec;
    return fs::exists(path, ec);
  }
  glob_t g{};
  const bool any = ::glob(path.c_str(), 0, nullptr, &g) == 0 && g.gl_pathc > 0;
  ::globfree(&g);
  return any;
}

std::string cwd_note() {
  std::error_code ec;
  const fs::path cwd = fs::current_path(ec);
  return "paths in a config are relative to the current directory (" + cwd.string() + ")";
}

status need(const config& c, const std::string& key, const std::string& path, const char* what,
            const std::string& remedy) {
  if (found(path)) return {};
  return config_error(c, key,
                      std::string(what) + " '" + path + "' " +
                          (is_pattern(path) ? "matches no file" : "does not exist"),
                      remedy + "; " + cwd_note());
}

}  // namespace

status check_files(const config& c) {
  const std::string prepare = "make token shards with `troupe data prepare --input FILES --out DIR`";
  if (c.data.train.empty())
    return config_error(c, "data.train", "no training data: data.train is empty",
                        "point data.train at a token shard; " + prepare);
  if (auto s = need(c, "data.train", c.data.train, "training data", prepare); !s) return s;
  if (!c.data.val.empty())
    if (auto s = need(c, "data.val", c.data.val, "validation data", prepare); !s) return s;
  if (!c.data.tokenizer_spec().empty()) {
    const char* key = c.data.tokenizer.empty() ? "data.tokenizer_dir" : "data.tokenizer";
    const std::string& spec = c.data.tokenizer_spec();
    const std::string remedy = "name a tokenizer.json, a folder holding one, or a folder holding "
                               "GPT-2's encoder.json and vocab.bpe (scripts/setup.sh writes "
                               "data/gpt2, data/llama2, data/llama3)";
    std::error_code ec;
    if (fs::is_directory(spec, ec)) {
      const fs::path dir(spec);
      if (!fs::exists(dir / "tokenizer.json", ec))
        for (const char* file : {"encoder.json", "vocab.bpe"})
          if (auto s = need(c, key, (dir / file).string(), "tokenizer file", remedy); !s) return s;
    } else if (auto s = need(c, key, spec, "tokenizer", remedy); !s) {
      return s;
    }
  }
  if (!c.model.init.empty())
    if (auto s = need(c, "model.init", c.model.init, "initial weights",
                      "name a Hugging Face model directory (config.json + model.safetensors) or a "
                      "troupe run or checkpoint directory");
        !s)
      return s;
  if (!c.schedule.file.empty())
    if (auto s = need(c, "schedule.file", c.schedule.file, "schedule file",
                      "fix the path, or remove schedule.file to use schedule.name");
        !s)
      return s;
  return {};
}

}  // namespace troupe::core
