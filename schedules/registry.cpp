#include "schedules/registry.hpp"

#include <dlfcn.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include "schedules/generators.hpp"
#include "schedules/plugin.hpp"
#include "schedules/schedule_file.hpp"
#include "schedules/validate.hpp"

namespace troupe::schedules {

namespace {

struct entry {
  generator gen;
  std::string origin;
};

struct registry_state {
  std::mutex mutex;
  std::map<std::string, entry> entries;
  std::set<std::string> plugins;  // canonical paths already loaded

  registry_state() {
    // Built-ins are registered here rather than by static registrars, which a static library
    // would let the linker drop.
    const std::string origin = "built-in (schedules/registry.cpp)";
    entries["gpipe"] = {make_gpipe, origin};
    entries["1f1b"] = {make_1f1b, origin};
    entries["interleaved_1f1b"] = {make_interleaved_1f1b, origin};
    entries["zb_h1"] = {make_zb_h1, origin};
    entries["zb_v"] = {make_zb_v, origin};
  }
};

registry_state& state() {
  static registry_state s;
  return s;
}

std::string names_list() {
  std::string out;
  for (auto& n : schedule_names()) out += (out.empty() ? "" : ", ") + n;
  return out;
}

core::error unknown(const std::string& why) {
  return core::error::make(why + "; valid schedule names: " + names_list(),
                           "give one of those names, a schedule file (text or .csv), or a plugin as "
                           "LIB.so:NAME");
}

core::result<schedule> checked(core::result<schedule> made, const std::string& what, int p, int m, int v,
                               const schedule_options& options) {
  if (!made) return made;
  schedule& s = *made;
  auto mismatch = [&](const char* key, int want, int got) {
    return core::error::make(what + " has " + key + " = " + std::to_string(got) + ", but " +
                                 std::to_string(want) + " was asked for",
                             "make the schedule and the configuration agree");
  };
  if (p > 0 && s.stages != p) return mismatch("pipeline_stage p", p, s.stages);
  if (m > 0 && s.microbatches != m) return mismatch("micro_batch_num m", m, s.microbatches);
  if (v > 0 && s.virtual_stages != v) return mismatch("virtual stages v", v, s.virtual_stages);
  validate_options vo;
  vo.require_microbatch_order = !options.allow_any_backward_order;
  if (auto st = validate(s, vo); !st) return st.err();
  return made;
}

}  // namespace

core::status register_schedule(const std::string& name, generator gen, const std::string& origin) {
  if (name.empty() || name.find(':') != std::string::npos || name.find('/') != std::string::npos)
    return core::error::make("cannot register schedule '" + name + "' from " + origin +
                                 ": a name must be non-empty, without ':' or '/'",
                             "pick a plain name such as my_schedule");
  auto& st = state();
  std::lock_guard lock(st.mutex);
  auto [it, fresh] = st.entries.try_emplace(name, entry{std::move(gen), origin});
  if (!fresh)
    return core::error::make("schedule '" + name + "' is already defined by " + it->second.origin +
                                 "; cannot define it again from " + origin,
                             "register the new generator under another name");
  return core::status::success();
}

std::vector<std::string> schedule_names() {
  auto& st = state();
  std::lock_guard lock(st.mutex);
  std::vector<std::string> out;
  for (auto& [name, e] : st.entries) out.push_back(name);
  return out;
}

core::status load_schedule_plugin(const std::string& path) {
  std::error_code ec;
  const auto canonical = std::filesystem::canonical(path, ec);
  if (ec)
    return core::error::at_file(path, "cannot load schedule plugin: " + ec.message(),
                                "give the path of a shared library built with TROUPE_SCHEDULE_PLUGIN");
  {
    auto& st = state();
    std::lock_guard lock(st.mutex);
    if (!st.plugins.insert(canonical.string()).second) return core::status::success();
  }
  // Never dlclose: registered generators point into the library.
  void* handle = dlopen(canonical.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    std::lock_guard lock(state().mutex);
    state().plugins.erase(canonical.string());
    return core::error::at_file(path, std::string("cannot load schedule plugin: ") + dlerror(),
                                "build it with -shared -fPIC for this platform");
  }
  using entry_fn = void (*)(plugin_host&);
  auto fn = reinterpret_cast<entry_fn>(dlsym(handle, plugin_entry_symbol));
  if (!fn)
    return core::error::at_file(path, std::string("not a troupe schedule plugin: no symbol ") + plugin_entry_symbol,
                                "define the entry point with TROUPE_SCHEDULE_PLUGIN (schedules/plugin.hpp)");
  plugin_host host;
  host.path = path;
  const std::string origin = "plugin " + path;
  host.add = [origin](const std::string& name, generator gen) {
    return register_schedule(name, std::move(gen), origin);
  };
  fn(host);
  return host.result;
}

core::result<schedule> make_schedule(const std::string& name_or_file, int p, int m,
                                     const schedule_options& options) {
  generator gen;
  std::string name = name_or_file;
  if (auto colon = name_or_file.rfind(':'); colon != std::string::npos &&
                                             name_or_file.find(".so") != std::string::npos &&
                                             name_or_file.find(".so") < colon) {
    if (auto st = load_schedule_plugin(name_or_file.substr(0, colon)); !st) return st.err();
    name = name_or_file.substr(colon + 1);
  }
  {
    auto& st = state();
    std::lock_guard lock(st.mutex);
    if (auto it = st.entries.find(name); it != st.entries.end()) gen = it->second.gen;
  }
  if (gen) {
    schedule_options opts = options;
    if (opts.virtual_stages == 0) opts.virtual_stages = 1;
    if (auto st = check_size("schedule '" + name + "'", p, opts.virtual_stages, m); !st) return st.err();
    auto made = gen(p, m, opts);
    if (made && made->name.empty()) made->name = name;
    return checked(std::move(made), "schedule '" + name + "'", p, m, opts.virtual_stages, options);
  }
  if (name != name_or_file) return unknown("plugin " + name_or_file.substr(0, name_or_file.rfind(':')) +
                                                     " defines no schedule '" + name + "'");
  std::error_code ec;
  // Anything that exists is read as a file: load_schedule_file says what is wrong with a FIFO,
  // a device or a folder.
  if (!std::filesystem::exists(name_or_file, ec)) {
    const bool looks_like_path = name_or_file.find('/') != std::string::npos ||
                                 name_or_file.find('.') != std::string::npos;
    return unknown(looks_like_path ? "schedule file '" + name_or_file + "' does not exist"
                                                 : "unknown schedule '" + name_or_file + "'");
  }
  return checked(load_schedule_file(name_or_file), "schedule file " + name_or_file, p, m, options.virtual_stages,
                 options);
}

}  // namespace troupe::schedules
