#include "model/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/files.hpp"
#include "model/tensor_parallel.hpp"
#include "model/params.hpp"

namespace troupe::model::checkpoint {

namespace fs = std::filesystem;
using core::error;

namespace {

constexpr const char* manifest_name = "manifest.json";
constexpr const char* latest_name = "latest";

error file_error(const std::string& path, std::string message, std::string hint = {}) {
  return error::at_file(path, std::move(message), std::move(hint));
}

using core::fsync_dir;
using core::write_file_synced;

core::input_spec manifest_spec() {
  core::input_spec spec;
  spec.what = "checkpoint manifest";
  spec.max_bytes = std::uint64_t(1) << 28;  // a manifest lists tensors; even 100k of them fit
  spec.hint = "pass a checkpoint directory (with manifest.json), a checkpoint root with a "
              "`latest` file, or a run directory";
  return spec;
}

std::optional<int> step_of_dir_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0) return std::nullopt;
  int v = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > 100'000'000) return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

core::status prune(const std::string& root, int keep, const std::string& newest) {
  if (keep <= 0) return {};
  std::vector<std::pair<int, fs::path>> dirs;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(root, ec)) {
    auto step = step_of_dir_name(e.path().filename().string());
    if (step && e.is_directory()) dirs.emplace_back(*step, e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  for (std::size_t i = 0; i + keep < dirs.size(); ++i) {
    if (dirs[i].second.filename() == newest) continue;
    fs::remove_all(dirs[i].second, ec);
    if (ec) return file_error(dirs[i].second.string(), "cannot delete old checkpoint: " + ec.message());
  }
  return {};
}

std::uint64_t parse_hex64(const std::string& s, bool& ok) {
  ok = s.size() == 16;
  std::uint64_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) ok = false;
    v = v << 4 | static_cast<unsigned>(d & 15);
  }
  return v;
}

// A field that is not what the manifest format says, thrown out of the parse and reported.
struct bad_field {
  std::string key;
  std::string message;
};

// The whole number at `j` (named `key`) in [lo, hi]. nlohmann's get<int>() narrows silently: a
// step of 2^40 would read as 0 and a resumed run would restart from the beginning.
std::int64_t whole(const nlohmann::json& j, const std::string& key, std::int64_t lo,
                   std::int64_t hi) {
  if (j.is_number_unsigned() && j.get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
    throw bad_field{key, "is " + std::to_string(j.get<std::uint64_t>()) + ", above the largest " +
                             std::to_string(hi) + " this build reads"};
  if (!j.is_number_integer()) throw bad_field{key, "is " + j.dump() + ", expected a whole number"};
  const std::int64_t v = j.get<std::int64_t>();
  if (v < lo || v > hi)
    throw bad_field{key, "is " + std::to_string(v) + ", outside " + std::to_string(lo) + ".." +
                             std::to_string(hi)};
  return v;
}

std::uint64_t whole_unsigned(const nlohmann::json& j, const std::string& key) {
  if (!j.is_number_unsigned() && !(j.is_number_integer() && j.get<std::int64_t>() >= 0))
    throw bad_field{key, "is " + j.dump() + ", expected a whole number of at least 0"};
  return j.get<std::uint64_t>();
}

}  // namespace

core::result<manifest> parse_manifest(std::string_view text, const std::string& path) {
  manifest m;
  try {
    auto j = nlohmann::json::parse(text);
    if (j.value("format", "") != "troupe-checkpoint")
      return file_error(path, "not a troupe checkpoint manifest (format is not \"troupe-checkpoint\")");
    constexpr std::int64_t int_max = std::numeric_limits<int>::max();
    m.version = static_cast<int>(whole(j.at("version"), "version", 0, int_max));
    if (m.version != format_version)
      return file_error(path, "checkpoint format version " + std::to_string(m.version) +
                                  " is not supported (this build reads version " +
                                  std::to_string(format_version) + ")");
    m.step = static_cast<int>(whole(j.at("step"), "step", 0, int_max));
    m.next_step = static_cast<int>(
        whole(j.at("data_position").at("next_step"), "data_position.next_step", 0, int_max));
    m.seed = whole_unsigned(j.at("seed"), "seed");
    m.config_toml = j.at("config").get<std::string>();
    if (j.contains("base")) {
      m.base_source = j.at("base").at("source").get<std::string>();
      m.base_xxh64 = j.at("base").at("xxh64").get<std::string>();
    }
    bool ok = true;
    for (auto& f : j.at("files")) {
      file_record r{f.at("path").get<std::string>(), f.at("kind").get<std::string>(),
                    whole_unsigned(f.at("bytes"), "files[].bytes"),
                    parse_hex64(f.at("xxh64").get<std::string>(), ok)};
      if (!ok) return file_error(path, "file '" + r.path + "' has a malformed xxh64");
      if (r.path.empty() || r.path.find('/') != std::string::npos || r.path[0] == '.')
        return file_error(path, "file name '" + r.path + "' is not a plain file name");
      m.files.push_back(std::move(r));
    }
    for (auto& [name, t] : j.at("tensors").items()) {
      tensor_record r;
      r.file = t.at("file").get<std::string>();
      r.dtype = t.at("dtype").get<std::string>();
      if (!t.at("shape").is_array()) throw bad_field{"tensors." + name + ".shape", "is not an array"};
      for (const auto& d : t.at("shape"))
        r.shape.push_back(whole(d, "tensors." + name + ".shape", 0,
                                std::numeric_limits<std::int64_t>::max()));
      r.xxh64 = parse_hex64(t.at("xxh64").get<std::string>(), ok);
      if (!ok) return file_error(path, "tensor '" + name + "' has a malformed xxh64");
      m.tensors[name] = std::move(r);
    }
  } catch (const nlohmann::json::exception& e) {
    return file_error(path, std::string("malformed checkpoint manifest: ") + e.what(),
                      "the checkpoint is corrupt; resume from an earlier one");
  } catch (const bad_field& b) {
    error e = file_error(path, b.message, "the checkpoint is corrupt or was edited; resume from "
                                          "another one");
    e.where.key = b.key;
    return e;
  }
  return m;
}

namespace {

core::result<manifest> read_manifest(const std::string& path) {
  auto text = core::read_input(path, manifest_spec());
  if (!text) return text.err();
  return parse_manifest(text.value(), path);
}

}  // namespace

std::string dir_name(int step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%06d", step);
  return buf;
}

core::result<std::string> save(const std::string& root, const save_request& req, int keep) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return file_error(root, "cannot create the checkpoint directory: " + ec.message());
  const std::string name = dir_name(req.step);
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp_dir = fs::path(root) / ("." + name + ".tmp");
  fs::remove_all(tmp_dir, ec);
  fs::create_directory(tmp_dir, ec);
  if (ec) return file_error(tmp_dir.string(), "cannot create: " + ec.message());
  // A failed write leaves nothing half-made behind: the temporary directory goes (it is never
  // read: only step_* directories are), `latest` and the older checkpoints stay as they were.
  auto failed = [&](core::error e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    return e;
  };

  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  for (std::size_t k = 0; k < req.shards.size(); ++k) {
    const shard_spec& s = req.shards[k];
    std::uint64_t full_after = UINT64_MAX;
    if (static_cast<int>(k) == req.full_at_shard) {
      full_after = 0;
      for (const auto& t : s.tensors) full_after += t.value.bytes() / 2;
    }
    auto info = safetensors::write((tmp_dir / s.file).string(), s.tensors,
                                   {{"format", "pt"}, {"troupe_kind", s.kind}}, full_after);
    if (!info) return failed(info.err());
    files.push_back({{"path", s.file},
                     {"kind", s.kind},
                     {"bytes", info->bytes},
                     {"xxh64", safetensors::hex64(info->file_xxh64)}});
    for (std::size_t i = 0; i < s.tensors.size(); ++i) {
      const auto& t = s.tensors[i];
      tensors[t.name] = {{"file", s.file},
                         {"dtype", safetensors::dtype_code(t.value.type())},
                         {"shape", t.value.shape()},
                         {"xxh64", safetensors::hex64(info->tensor_xxh64[i])}};
    }
  }
  nlohmann::ordered_json j;
  j["format"] = "troupe-checkpoint";
  j["version"] = format_version;
  j["step"] = req.step;
  j["data_position"] = {{"next_step", req.step}};
  j["seed"] = req.seed;
  j["config"] = req.config_toml;
  if (!req.base_xxh64.empty()) j["base"] = {{"source", req.base_source}, {"xxh64", req.base_xxh64}};
  j["files"] = std::move(files);
  j["tensors"] = std::move(tensors);
  if (auto st = write_file_synced((tmp_dir / manifest_name).string(), j.dump(1) + "\n"); !st)
    return failed(st.err());
  if (auto st = fsync_dir(tmp_dir.string()); !st) return failed(st.err());

  // A directory cannot be renamed over a non-empty one: move an older copy of this step aside
  // first, so that at every moment either the old or the new checkpoint is whole under its name.
  const fs::path old_dir = fs::path(root) / ("." + name + ".old");
  fs::remove_all(old_dir, ec);
  if (fs::exists(final_dir)) {
    fs::rename(final_dir, old_dir, ec);
    if (ec) return file_error(final_dir.string(), "cannot move the older checkpoint aside: " + ec.message());
  }
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) return file_error(final_dir.string(), "cannot rename the new checkpoint into place: " + ec.message());
  if (auto st = fsync_dir(root); !st) return st.err();
  fs::remove_all(old_dir, ec);

  if (auto st = core::write_file_atomic((fs::path(root) / latest_name).string(), name + "\n"); !st)
    return st.err();
  if (auto st = prune(root, keep, name); !st) return st.err();
  return final_dir.string();
}

core::result<std::string> resolve(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / manifest_name, ec)) return path;
  for (fs::path root : {fs::path(path), fs::path(path) / "checkpoints"}) {
    fs::path latest = root / latest_name;
    if (!fs::exists(latest, ec)) continue;
    core::input_spec spec;
    spec.what = "`latest` file";
    spec.max_bytes = 4096;  // one directory name
    spec.hint = "`latest` holds the name of the newest step_NNNNNN directory beside it";
    auto text = core::read_input(latest.string(), spec);
    if (!text) return text.err();
    const std::string name = text->substr(0, text->find('\n'));
    if (!step_of_dir_name(name))
      return file_error(latest.string(), "does not name a checkpoint directory (step_NNNNNN)");
    fs::path dir = root / name;
    if (!fs::exists(dir / manifest_name, ec))
      return file_error(dir.string(), "`latest` names a checkpoint that has no manifest.json",
                        "the checkpoint was deleted; pass an existing step_* directory");
    return dir.string();
  }
  return file_error(path, "no checkpoint here",
                    "pass a checkpoint directory (with manifest.json), a checkpoint root with a "
                    "`latest` file, or a run directory whose checkpoints/ has one");
}

core::result<reader> reader::open(const std::string& dir) {
  reader r;
  r.dir_ = dir;
  const std::string mpath = (fs::path(dir) / manifest_name).string();
  auto m = read_manifest(mpath);
  if (!m) return m.err();
  r.manifest_ = std::move(m.value());
  const char* tamper_hint = "the checkpoint is corrupt or was modified; resume from another one";

  for (const file_record& fr : r.manifest_.files) {
    const std::string fpath = (fs::path(dir) / fr.path).string();
    auto f = safetensors::file::open(fpath);
    if (!f) return f.err();
    auto [base, size] = f->file_bytes();
    if (size != fr.bytes)
      return file_error(fpath, "has " + std::to_string(size) + " bytes, manifest.json records " +
                                   std::to_string(fr.bytes),
                        tamper_hint);
    // Tensor hashes first, so that damaged data is reported by tensor name; the whole-file hash
    // then also covers the header.
    for (const safetensors::entry& e : f->entries()) {
      auto it = r.manifest_.tensors.find(e.name);
      if (it == r.manifest_.tensors.end() || it->second.file != fr.path) {
        error err = file_error(fpath, "holds a tensor manifest.json does not list for this file",
                               tamper_hint);
        err.where.key = "tensor '" + e.name + "'";
        return err;
      }
      auto [p, n] = f->bytes(e);
      std::uint64_t h = safetensors::xxh64(p, n);
      if (h != it->second.xxh64) {
        error err = file_error(fpath,
                               "contents do not match the hash in manifest.json (expected " +
                                   safetensors::hex64(it->second.xxh64) + ", got " +
                                   safetensors::hex64(h) + ")",
                               tamper_hint);
        err.where.key = "tensor '" + e.name + "'";
        return err;
      }
      if (e.dtype != it->second.dtype || e.shape != it->second.shape) {
        error err = file_error(fpath,
                               "is " + e.dtype + " " + core::shape_string(e.shape) +
                                   " but manifest.json records " + it->second.dtype + " " +
                                   core::shape_string(it->second.shape),
                               tamper_hint);
        err.where.key = "tensor '" + e.name + "'";
        return err;
      }
    }
    if (safetensors::xxh64(base, size) != fr.xxh64)
      return file_error(fpath, "file does not match its hash in manifest.json (header changed)",
                        tamper_hint);
    r.files_[fr.path] = std::make_shared<safetensors::file>(std::move(f.value()));
  }
  for (const auto& [name, t] : r.manifest_.tensors) {
    auto it = r.files_.find(t.file);
    if (it == r.files_.end() || !it->second->find(name)) {
      error err = file_error(mpath, "lists tensor in file '" + t.file + "', which does not hold it",
                             tamper_hint);
      err.where.key = "tensor '" + name + "'";
      return err;
    }
  }
  return r;
}

core::result<reader> open_for_resume(const std::string& path, std::vector<std::string>* skipped) {
  auto dir = resolve(path);
  if (!dir) return dir.err();
  auto ck = reader::open(dir.value());
  std::error_code ec;
  if (ck || fs::exists(fs::path(path) / manifest_name, ec)) return ck;
  // The newest one is unusable: try the older ones of the same root, newest first.
  const fs::path root = fs::path(dir.value()).parent_path();
  const int newest = step_of_dir_name(fs::path(dir.value()).filename().string()).value_or(0);
  std::vector<std::pair<int, fs::path>> older;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    auto step = step_of_dir_name(e.path().filename().string());
    if (step && *step < newest && e.is_directory(ec)) older.emplace_back(*step, e.path());
  }
  std::sort(older.begin(), older.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  auto why = [](core::error e) {
    e.hint.clear();
    return e.to_string();
  };
  if (skipped) skipped->push_back(why(ck.err()));
  for (const auto& [step, p] : older) {
    auto other = reader::open(p.string());
    if (other) return other;
    if (skipped) skipped->push_back(why(other.err()));
  }
  core::error e = ck.err();
  e.hint = older.empty() ? "no older checkpoint exists under " + root.string()
                         : "no older checkpoint under " + root.string() + " reads whole either";
  return e;
}

core::result<core::tensor> reader::load(const std::string& name) const {
  auto it = manifest_.tensors.find(name);
  if (it == manifest_.tensors.end()) {
    error err = file_error((fs::path(dir_) / manifest_name).string(), "no such tensor in the checkpoint",
                           "was it saved from a different model configuration?");
    err.where.key = "tensor '" + name + "'";
    return err;
  }
  return files_.at(it->second.file)->load(name);
}

namespace {

tensor host_view(kernels::backend& be, const tensor& t) {
  return be.dev().is_cpu() ? t : be.to_host(t);
}

}  // namespace

shard_spec model_shard(kernels::backend& be, chunk& c, std::string file) {
  shard_spec s{std::move(file), "model", {}};
  for (const param_info& p : c.params())
    if (!p.tied) s.tensors.push_back({p.name, host_view(be, c.param(p.name))});
  return s;
}

shard_spec optimizer_shard(kernels::backend& be, chunk& c, optimizer_state& state,
                           std::string file) {
  shard_spec s{std::move(file), "optimizer", {}};
  for (const param_info& p : c.params()) {
    if (p.tied) continue;
    s.tensors.push_back({p.name + ".exp_avg", host_view(be, state.exp_avg.slice(p.offset, p.shape))});
    s.tensors.push_back(
        {p.name + ".exp_avg_sq", host_view(be, state.exp_avg_sq.slice(p.offset, p.shape))});
  }
  return s;
}

namespace {

/// Tensor `name` of ck into dst; a tensor-parallel chunk's (tp) slice of it, parameter `param`.
core::status load_into(const reader& ck, kernels::backend& be, const std::string& name,
                       const core::shape_t& shape, tensor dst, const core::model_config& cfg,
                       const std::string& param, const chunk_tp& tp) {
  auto t = ck.load(name);
  if (!t) return t.err();
  if (tp.size > 1 && t->type() == core::dtype::f32 &&
      shard_shape(cfg, param, t->shape(), tp.size, tp.rank) == shape)
    t = shard_tensor(cfg, param, t.value(), tp.size, tp.rank);
  if (t->type() != core::dtype::f32 || t->shape() != shape) {
    error err = file_error(ck.dir(),
                           "checkpoint has " + std::string(core::dtype_name(t->type())) + " " +
                               core::shape_string(t->shape()) + ", the model needs fp32 " +
                               core::shape_string(shape),
                           "the checkpoint was saved from a different model configuration");
    err.where.key = "tensor '" + name + "'";
    return err;
  }
  be.copy(t.value(), dst);
  return {};
}

}  // namespace

core::status restore(const reader& ck, kernels::backend& be, const core::model_config& cfg,
                     chunk& c, optimizer_state* state) {
  for (const param_info& p : c.params()) {
    const std::string src = p.tied ? embedding_name(cfg) : p.name;
    const chunk_tp& tp = c.tp();
    if (auto st = load_into(ck, be, src, p.shape, c.param(p.name), cfg, p.name, tp); !st) return st;
    if (!state) continue;
    if (auto st = load_into(ck, be, src + ".exp_avg", p.shape,
                            state->exp_avg.slice(p.offset, p.shape), cfg, p.name, tp);
        !st)
      return st;
    if (auto st = load_into(ck, be, src + ".exp_avg_sq", p.shape,
                            state->exp_avg_sq.slice(p.offset, p.shape), cfg, p.name, tp);
        !st)
      return st;
  }
  c.params_updated();
  return {};
}

}  // namespace troupe::model::checkpoint
