#include "actors/recorder.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/files.hpp"
#include "kernels/message_hash.hpp"
#include "model/layer.hpp"
#include "model/safetensors.hpp"

namespace troupe::actors {

namespace fs = std::filesystem;

namespace {

constexpr std::uint32_t kind_count = 13;
const char* const kind_names[kind_count] = {
    "",            "tokens",       "targets",     "activation",   "gradient",     "tied_grad",
    "grad_slice",  "reduced_grad", "param_slice", "snap_params",  "snap_exp_avg", "snap_exp_avg_sq",
    "documents"};

// The ops of a layer whose collectives a tensor-parallel group tags (model::comm_op's values).
constexpr std::uint32_t tp_op_count = 11;
const char* const tp_op_names[tp_op_count] = {
    "",     "forward",      "backward_input", "backward_weight", "recompute", "embedding_forward",
    "embedding_backward", "loss", "head_backward", "recompute_embedding", "recompute_loss"};
static_assert(static_cast<std::uint32_t>(model::comm_op::recompute_loss) + 1 == tp_op_count);

constexpr std::uint32_t tp_gather_bit = 0x80000000u;  // transport::all_reduce's gather phase

/// The op of a tensor-parallel kind, its collective's index in the op, and the gather bit.
struct tp_kind_parts {
  std::uint32_t op = 0, n = 0;
  bool gather = false;
};
tp_kind_parts tp_parts(std::uint32_t kind) {
  const std::uint32_t k = kind & ~tp_gather_bit;
  return {(k - tp_kind_base) >> 8, k & 0xffu, (kind & tp_gather_bit) != 0};
}

std::optional<std::uint32_t> tp_kind_of_name(std::string s) {
  if (s.rfind("tp_", 0) != 0) return std::nullopt;
  s = s.substr(3);
  std::uint32_t gather = 0;
  const std::string g = "_gather";
  if (s.size() > g.size() && s.compare(s.size() - g.size(), g.size(), g) == 0) {
    gather = tp_gather_bit;
    s.resize(s.size() - g.size());
  }
  const auto us = s.rfind('_');
  if (us == std::string::npos || us + 1 >= s.size() || us + 4 < s.size() ||
      s.find_first_not_of("0123456789", us + 1) != std::string::npos)
    return std::nullopt;
  const std::uint32_t n = static_cast<std::uint32_t>(std::stoul(s.substr(us + 1)));
  if (n > 0xff) return std::nullopt;
  const std::string op = s.substr(0, us);
  for (std::uint32_t o = 1; o < tp_op_count; ++o)
    if (op == tp_op_names[o]) return (tp_kind_base | (o << 8) | n) | gather;
  return std::nullopt;
}

std::optional<std::uint32_t> kind_of_name(const std::string& s) {
  for (std::uint32_t k = 1; k < kind_count; ++k)
    if (s == kind_names[k]) return k;
  return tp_kind_of_name(s);
}

std::optional<core::dtype> dtype_of_name(const std::string& s) {
  for (auto t : {core::dtype::f32, core::dtype::bf16, core::dtype::f16, core::dtype::f64,
                 core::dtype::i32, core::dtype::u16, core::dtype::i64})
    if (s == core::dtype_name(t)) return t;
  return std::nullopt;
}

// Eight bytes that open every .tensors file (the format's name and version).
constexpr char tensors_magic[8] = {'T', 'R', 'P', 'T', 'N', 'S', '0', '1'};

std::string log_path(const std::string& dir, int rank) {
  return dir + "/rank_" + std::to_string(rank) + ".log";
}
std::string tensors_path(const std::string& dir, int rank) {
  return dir + "/rank_" + std::to_string(rank) + ".tensors";
}

std::string hex_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}

std::string tag_fields(const transport::tag& tg) {
  return "\"kind\":\"" + kind_name(tg.kind) + "\",\"chunk\":" + std::to_string(tg.chunk) +
         ",\"mb\":" + std::to_string(tg.mb) + ",\"part\":" + std::to_string(tg.part);
}

std::string shape_json(const core::shape_t& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(s[i]);
  }
  out += ']';
  return out;
}

/// The frame header of a stored tensor (the bytes follow it).
std::string frame_header(int src, int dst, const transport::tag& tg, const core::tensor& t) {
  return "{\"src\":" + std::to_string(src) + ",\"dst\":" + std::to_string(dst) +
         ",\"step\":" + std::to_string(tg.step) + "," + tag_fields(tg) + ",\"dtype\":\"" +
         core::dtype_name(t.type()) + "\",\"shape\":" + shape_json(t.shape()) +
         ",\"bytes\":" + std::to_string(t.bytes()) + "}";
}

core::error log_error(const std::string& file, int line, const std::string& what) {
  return core::error::at_key(file, "", line, 0, what,
                             "the message log is damaged; record the run again");
}

// Reads a tag's fields from a JSON object (a log record or a frame header).
bool read_tag(const nlohmann::json& j, transport::tag& tg, std::string& why) {
  auto kind = kind_of_name(j.at("kind").get<std::string>());
  if (!kind) {
    why = "unknown kind '" + j.at("kind").get<std::string>() + "'";
    return false;
  }
  tg.step = j.at("step").get<std::int64_t>();
  tg.kind = *kind;
  tg.chunk = j.at("chunk").get<std::int32_t>();
  tg.mb = j.at("mb").get<std::int32_t>();
  tg.part = j.at("part").get<std::int32_t>();
  return true;
}

/// Keeps the lines of a log whose step is before `first_step` (and every header): a resumed
/// invocation runs the later steps again.
core::status truncate_log(const std::string& path, int first_step) {
  std::ifstream in(path);
  if (!in) return core::status::success();
  std::string kept, line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return log_error(path, n, "line " + std::to_string(n) + " is not a JSON object");
    if (j.contains("step") && j["step"].get<std::int64_t>() >= first_step) continue;
    kept += line;
    kept += '\n';
  }
  in.close();
  return core::write_file_atomic(path, kept);
}

/// One frame of a .tensors file: header JSON and where its bytes are.
struct frame {
  nlohmann::json header;
  std::uint64_t offset = 0;  // of the bytes
  std::uint64_t bytes = 0;
};

/// Walks the frames of a .tensors file held in `data`.
core::result<std::vector<frame>> scan_frames(const std::string& path, const std::string& data) {
  std::vector<frame> frames;
  if (data.size() < sizeof tensors_magic ||
      std::memcmp(data.data(), tensors_magic, sizeof tensors_magic) != 0)
    return core::error::at_file(path, "not a troupe .tensors file (bad magic)",
                                "record the run again with runtime.record_tensors = true");
  std::uint64_t at = sizeof tensors_magic;
  while (at < data.size()) {
    if (data.size() - at < 4)
      return core::error::at_file(path, "truncated frame at byte " + std::to_string(at));
    std::uint32_t n = 0;
    for (int i = 0; i < 4; ++i)
      n |= static_cast<std::uint32_t>(static_cast<unsigned char>(data[at + i])) << (8 * i);
    at += 4;
    if (data.size() - at < n)
      return core::error::at_file(path, "truncated frame header at byte " + std::to_string(at));
    frame f;
    f.header = nlohmann::json::parse(data.substr(at, n), nullptr, false);
    if (f.header.is_discarded() || !f.header.is_object() || !f.header.contains("bytes"))
      return core::error::at_file(path, "malformed frame header at byte " + std::to_string(at));
    at += n;
    f.offset = at;
    f.bytes = f.header["bytes"].get<std::uint64_t>();
    if (data.size() - at < f.bytes)
      return core::error::at_file(path, "truncated tensor bytes at byte " + std::to_string(at));
    at += f.bytes;
    frames.push_back(std::move(f));
  }
  return frames;
}

std::string read_whole(const std::string& path, bool& ok) {
  std::ifstream in(path, std::ios::binary);
  ok = static_cast<bool>(in);
  return ok ? std::string(std::istreambuf_iterator<char>(in), {}) : std::string();
}

void put_u32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

core::status truncate_tensors(const std::string& path, int first_step) {
  bool ok = false;
  std::string data = read_whole(path, ok);
  if (!ok || data.empty()) return core::status::success();
  auto frames = scan_frames(path, data);
  if (!frames) return frames.err();
  std::string kept(tensors_magic, sizeof tensors_magic);
  for (const auto& f : frames.value()) {
    if (f.header.at("step").get<std::int64_t>() >= first_step) continue;
    std::string h = f.header.dump();
    put_u32(kept, static_cast<std::uint32_t>(h.size()));
    kept += h;
    kept.append(data, f.offset, f.bytes);
  }
  return core::write_file_atomic(path, kept);
}

}  // namespace

std::string messages_dir(const std::string& run_dir) { return run_dir + "/messages"; }

std::string kind_name(std::uint32_t kind) {
  if (kind >= 1 && kind < kind_count) return kind_names[kind];
  if (is_tp_kind(kind)) {
    const tp_kind_parts t = tp_parts(kind);
    if (t.op >= 1 && t.op < tp_op_count)
      return std::string("tp_") + tp_op_names[t.op] + "_" + std::to_string(t.n) +
             (t.gather ? "_gather" : "");
  }
  return "kind " + std::to_string(kind);
}

std::string address_name(const address& a) { return actor_name(a); }

std::string producer_of(const address& from, const address& to, const transport::tag& tg) {
  switch (static_cast<tensor_kind>(tg.kind)) {
    case tensor_kind::tokens:
    case tensor_kind::targets:
    case tensor_kind::documents: return "loader cut";
    case tensor_kind::activation:  // the input of chunk tg.chunk: chunk - 1's SEND_F
      return std::to_string(tg.chunk - 1) + "SEND_F" + std::to_string(tg.mb) + "->" +
             std::to_string(to.b);
    case tensor_kind::gradient:  // the gradient of chunk tg.chunk's output: chunk + 1's SEND_B
      return std::to_string(tg.chunk + 1) + "SEND_B" + std::to_string(tg.mb) + "->" +
             std::to_string(to.b);
    case tensor_kind::tied_grad:
    case tensor_kind::grad_slice: return std::to_string(tg.chunk) + "REDUCE_GRAD";
    case tensor_kind::reduced_grad:
    case tensor_kind::param_slice: return "shard update";
    case tensor_kind::snap_params: return "snapshot";
    case tensor_kind::snap_exp_avg:
    case tensor_kind::snap_exp_avg_sq: return "shard snapshot";
  }
  return from.who == role::stage ? "stage send" : "send";
}

std::string describe(const message_record& r) {
  if (is_tp_kind(r.tag.kind) && tp_parts(r.tag.kind).op >= 1 &&
      tp_parts(r.tag.kind).op < tp_op_count) {
    // The group's tags carry the layer in `chunk`: -1 the embedding, -2 the head and loss.
    const tp_kind_parts t = tp_parts(r.tag.kind);
    const std::string layer = r.tag.chunk == -1   ? std::string("the embedding")
                              : r.tag.chunk == -2 ? std::string("the head")
                                                  : "layer " + std::to_string(r.tag.chunk);
    return "rank " + std::to_string(r.src) + ", step " + std::to_string(r.tag.step) +
           ", micro-batch " + (r.tag.mb >= 0 ? std::to_string(r.tag.mb) : std::string("-")) +
           ", " + layer + ", collective " + r.op + " (" + tp_op_names[t.op] + " collective " +
           std::to_string(t.n) + (t.gather ? ", all-gather phase" : "") + ", part " +
           std::to_string(r.tag.part) + ": " + r.from + " -> " + r.to + " on rank " +
           std::to_string(r.dst) + ")";
  }
  std::string s = "rank " + std::to_string(r.src) + ", step " + std::to_string(r.tag.step) +
                  ", micro-batch " + (r.tag.mb >= 0 ? std::to_string(r.tag.mb) : std::string("-")) +
                  ", instruction " + r.op + " (" + r.from + " -> " + r.to + " on rank " +
                  std::to_string(r.dst) + ", " + kind_name(r.tag.kind) + " of chunk " +
                  std::to_string(r.tag.chunk);
  if (r.tag.part != 0) s += ", part " + std::to_string(r.tag.part);
  return s + ")";
}

std::string to_line(const message_record& r) {
  std::string s = "{\"step\":" + std::to_string(r.tag.step) + ",\"src\":" + std::to_string(r.src) +
                  ",\"dst\":" + std::to_string(r.dst) + ",\"from\":\"" + r.from + "\",\"to\":\"" +
                  r.to + "\"," + tag_fields(r.tag) + ",\"op\":\"" + r.op + "\",\"dtype\":\"" +
                  core::dtype_name(r.dtype) + "\",\"shape\":" + shape_json(r.shape) +
                  ",\"hash\":\"" + model::safetensors::hex64(r.hash) + "\"";
  if (r.sample)
    s += ",\"sample\":{\"seed\":" + std::to_string(r.sample->seed) +
         ",\"step\":" + std::to_string(r.sample->step) +
         ",\"first_seq\":" + std::to_string(r.sample->first_seq) +
         ",\"count\":" + std::to_string(r.sample->count) + "}";
  return s + "}";
}

std::string to_line(const segment_header& h) {
  nlohmann::json j = {{"troupe_messages", message_log_version},       {"rank", h.rank},
                      {"workers", h.workers},       {"first_step", h.first_step},
                      {"end_step", h.end_step},     {"resume", h.resume},
                      {"config_xxh64", model::safetensors::hex64(h.config_xxh64)}};
  return j.dump();
}

std::string to_line(const clip_record& c) {
  return "{\"step\":" + std::to_string(c.step) + ",\"src\":" + std::to_string(c.src) +
         ",\"control\":\"clip\",\"pp\":" + std::to_string(c.pp) + ",\"part\":" +
         std::to_string(c.part) + ",\"scale\":\"" + hex_double(c.scale) + "\",\"lr\":\"" +
         hex_double(c.lr) + "\",\"adam_step\":" + std::to_string(c.adam_step) +
         ",\"skip\":" + (c.skip ? "true" : "false") + ",\"loss_scale\":\"" + hex_double(c.loss_scale) + "\"}";
}

core::result<message_log> read_log(const std::string& dir, int rank) {
  const std::string path = log_path(dir, rank);
  std::ifstream in(path);
  if (!in)
    return core::error::at_file(path, "no message log for rank " + std::to_string(rank),
                                "was the run recorded? set runtime.record = true (the default) "
                                "and train again");
  message_log out;
  std::string line;
  int n = 0;
  // the definition the records follow: their invocation's header says (a run resumed by a newer
  // troupe holds segments of both formats)
  kernels::message_hash_def hash_def = kernels::message_hash_current;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return log_error(path, n, "line " + std::to_string(n) + " is not a JSON object");
    try {
      if (j.contains("troupe_messages")) {
        const auto format = j.at("troupe_messages");
        const auto def = format.is_number_integer() ? hash_def_of_log_format(format.get<int>())
                                                    : std::nullopt;
        if (!def)
          return core::error::at_key(
              path, "", n, 0,
              "message log format " + format.dump() + ", this troupe reads formats 2 and 3",
              "the run was recorded by another version of troupe (format 1 held plain xxh64 "
              "hashes of whole tensors); replay it with that version, or record it again");
        hash_def = *def;
        segment_header h;
        h.rank = j.at("rank").get<int>();
        h.workers = j.at("workers").get<int>();
        h.first_step = j.at("first_step").get<int>();
        h.end_step = j.at("end_step").get<int>();
        h.resume = j.at("resume").get<std::string>();
        h.config_xxh64 = std::stoull(j.at("config_xxh64").get<std::string>(), nullptr, 16);
        out.segments.push_back(h);
        continue;
      }
      if (j.contains("control") && j.at("control") == "rerun") {
        const std::int64_t step = j.at("step").get<std::int64_t>();
        std::erase_if(out.records, [&](const message_record& r) { return r.tag.step == step; });
        continue;
      }
      if (j.contains("control")) {
        clip_record c;
        c.step = j.at("step").get<std::int64_t>();
        c.src = j.at("src").get<int>();
        c.pp = j.at("pp").get<int>();
        c.part = j.at("part").get<int>();
        c.scale = static_cast<float>(std::strtod(j.at("scale").get<std::string>().c_str(), nullptr));
        c.lr = std::strtod(j.at("lr").get<std::string>().c_str(), nullptr);
        // Logs written before dynamic loss scaling lack these: no skips, t = step + 1, scale 1.
        c.adam_step = j.value("adam_step", c.step + 1);
        c.skip = j.value("skip", false);
        if (j.contains("loss_scale"))
          c.loss_scale = static_cast<float>(std::strtod(j.at("loss_scale").get<std::string>().c_str(), nullptr));
        out.clips.push_back(c);
        continue;
      }
      message_record r;
      std::string why;
      if (!read_tag(j, r.tag, why)) return log_error(path, n, why);
      r.src = j.at("src").get<int>();
      r.dst = j.at("dst").get<int>();
      r.from = j.at("from").get<std::string>();
      r.to = j.at("to").get<std::string>();
      r.op = j.at("op").get<std::string>();
      auto dt = dtype_of_name(j.at("dtype").get<std::string>());
      if (!dt) return log_error(path, n, "unknown dtype '" + j.at("dtype").get<std::string>() + "'");
      r.dtype = *dt;
      r.shape = j.at("shape").get<core::shape_t>();
      const std::string h = j.at("hash").get<std::string>();
      if (h.size() != 16 || h.find_first_not_of("0123456789abcdef") != std::string::npos)
        return log_error(path, n, "hash '" + h + "' is not 16 hex digits");
      r.hash = std::stoull(h, nullptr, 16);
      r.hash_def = hash_def;
      if (j.contains("sample")) {
        const auto& s = j["sample"];
        r.sample = sample_key{s.at("seed").get<std::uint64_t>(), s.at("step").get<std::int64_t>(),
                              s.at("first_seq").get<std::int64_t>(), s.at("count").get<int>()};
      }
      r.file = path;
      r.line = n;
      out.records.push_back(std::move(r));
    } catch (const std::exception& e) {
      return log_error(path, n, "line " + std::to_string(n) + ": " + e.what());
    }
  }
  if (out.segments.empty())
    return log_error(path, 1, "no header line: this is not a troupe message log");
  return out;
}

core::result<std::vector<stored_tensor>> read_tensors(const std::string& dir, int rank) {
  const std::string path = tensors_path(dir, rank);
  bool ok = false;
  std::string data = read_whole(path, ok);
  if (!ok)
    return core::error::at_file(path, "no stored tensors for rank " + std::to_string(rank),
                                "replaying one rank needs its neighbours' tensors: train with "
                                "runtime.record_tensors = true");
  auto frames = scan_frames(path, data);
  if (!frames) return frames.err();
  std::vector<stored_tensor> out;
  for (const auto& f : frames.value()) {
    stored_tensor s;
    std::string why;
    try {
      if (!read_tag(f.header, s.tag, why))
        return core::error::at_file(path, why + " in the frame at byte " + std::to_string(f.offset));
      s.src = f.header.at("src").get<int>();
      s.dst = f.header.at("dst").get<int>();
      auto dt = dtype_of_name(f.header.at("dtype").get<std::string>());
      auto shape = f.header.at("shape").get<core::shape_t>();
      if (!dt || static_cast<std::uint64_t>(core::numel_of(shape)) * core::dtype_size(*dt) != f.bytes)
        return core::error::at_file(path, "the frame at byte " + std::to_string(f.offset) +
                                              " has a dtype or shape that does not match its size");
      s.value = core::tensor::zeros(shape, *dt);
      if (f.bytes) std::memcpy(s.value.raw(), data.data() + f.offset, f.bytes);
    } catch (const std::exception& e) {
      return core::error::at_file(path, "the frame at byte " + std::to_string(f.offset) + ": " + e.what());
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::optional<kernels::message_hash_def> hash_def_of_log_format(int format) {
  if (format == 2) return kernels::message_hash_def::xxh64;
  if (format == 3) return kernels::message_hash_def::xxh3;
  return std::nullopt;
}

std::uint64_t tensor_hash(const core::tensor& t, kernels::message_hash_def def) {
  if (!t.defined() || t.bytes() == 0) return kernels::message_hash(nullptr, 0, def);
  return kernels::message_hash(t.raw(), t.bytes(), def);
}

core::tensor host_view(const core::tensor& t, kernels::backend* be) {
  if (!t.defined() || t.dev().is_cpu()) return t;
  TROUPE_CHECK(be != nullptr, "a device tensor reached the message log without its backend");
  return be->to_host(t);
}

message_record header_of(const address& from, int src, const address& to, int dst,
                         const transport::tag& tg) {
  message_record r;
  r.src = src;
  r.dst = dst;
  r.from = address_name(from);
  r.to = address_name(to);
  r.tag = tg;
  r.op = producer_of(from, to, tg);
  return r;
}

message_record record_of(const address& from, int src, const address& to, int dst,
                         const transport::tag& tg, const core::tensor& t, const sample_key* sample) {
  message_record r = header_of(from, src, to, dst, tg);
  r.dtype = t.type();
  r.shape = t.shape();
  r.hash = tensor_hash(t);
  if (sample) r.sample = *sample;
  return r;
}

namespace {

class known_hash final : public kernels::pending_value {
 public:
  explicit known_hash(std::uint64_t v) : v_(v) {}
  std::uint64_t get() override { return v_; }

 private:
  std::uint64_t v_;
};

/// The pending hash of a tensor sent (observe_send): on the device for a device tensor, else from
/// `memo` when it holds these very bytes, else computed here (and put into `memo`).
std::shared_ptr<kernels::pending_value> hash_of_send(const core::tensor& t, kernels::backend* be,
                                                     hash_memo* memo) {
  if (t.defined() && !t.dev().is_cpu()) {
    TROUPE_CHECK(be != nullptr, "a device tensor reached the message log without its backend");
    return be->message_hash_async(t);
  }
  if (memo && t.defined() && t.bytes() > 0 && memo->store == t.store() &&
      memo->data == t.raw() && memo->bytes == t.bytes())
    return std::make_shared<known_hash>(memo->hash);
  const std::uint64_t v = tensor_hash(t);
  if (memo && t.defined()) *memo = {t.store(), t.raw(), t.bytes(), v};
  return std::make_shared<known_hash>(v);
}

}  // namespace

void observe_send(message_sink& sink, const address& from, int src, const address& to, int dst,
                  const transport::tag& tg, const core::tensor& t, kernels::backend* be,
                  const sample_key* sample, hash_memo* memo, const std::string* op,
                  std::shared_ptr<kernels::pending_value> hash) {
  if (sink.wants_bytes()) {
    core::tensor host = host_view(t, be);
    message_record r = record_of(from, src, to, dst, tg, host, sample);
    if (op) r.op = *op;
    sink.sent(r, host);
    return;
  }
  message_record r = header_of(from, src, to, dst, tg);
  if (op) r.op = *op;
  r.dtype = t.type();
  r.shape = t.shape();
  if (sample) r.sample = *sample;
  sink.sent_pending(std::move(r), hash ? std::move(hash) : hash_of_send(t, be, memo));
}

void observe_receive(message_sink& sink, int src, int dst, const transport::tag& tg,
                     const core::tensor& t, kernels::backend* be) {
  if (src == dst || !sink.wants_received()) return;
  sink.received(src, dst, tg, host_view(t, be));
}

// --- recorder -----------------------------------------------------------------------------------

struct recorder::file {
  std::mutex mu;
  std::string log_path, tensors_path;
  std::FILE* log = nullptr;
  std::FILE* tensors = nullptr;
  bool failed = false;
};

core::result<std::shared_ptr<recorder>> recorder::open(const std::string& run_dir,
                                                       const std::vector<int>& workers,
                                                       segment_header header, bool tensors) {
  const std::string dir = messages_dir(run_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return core::error::at_key("", "runtime.record", 0, 0,
                               "cannot create '" + dir + "': " + ec.message(),
                               "choose a writable runtime.run_dir or set runtime.record = false");
  std::shared_ptr<recorder> rec(new recorder(tensors));
  for (int w : workers) {
    auto f = std::make_unique<file>();
    f->log_path = log_path(dir, w);
    f->tensors_path = tensors_path(dir, w);
    if (header.first_step > 0) {
      if (auto st = truncate_log(f->log_path, header.first_step); !st) return st.err();
      if (auto st = truncate_tensors(f->tensors_path, header.first_step); !st) return st.err();
    } else if (!tensors) {
      fs::remove(f->tensors_path, ec);  // a stale file of an earlier run in this directory
    }
    const char* mode = header.first_step > 0 ? "ab" : "wb";
    f->log = std::fopen(f->log_path.c_str(), mode);
    if (!f->log)
      return core::error::at_file(f->log_path, std::string("cannot open: ") + std::strerror(errno),
                                  "choose a writable runtime.run_dir or set runtime.record = false");
    // Lines go to disk at step ends (flush), not per message.
    std::setvbuf(f->log, nullptr, _IOFBF, 1 << 20);
    header.rank = w;
    std::string h = to_line(header) + "\n";
    std::fwrite(h.data(), 1, h.size(), f->log);
    if (tensors) {
      bool fresh = header.first_step == 0 || !fs::exists(f->tensors_path) ||
                   fs::file_size(f->tensors_path, ec) == 0;
      f->tensors = std::fopen(f->tensors_path.c_str(), mode);
      if (!f->tensors)
        return core::error::at_file(f->tensors_path,
                                    std::string("cannot open: ") + std::strerror(errno),
                                    "choose a writable runtime.run_dir");
      std::setvbuf(f->tensors, nullptr, _IOFBF, 1 << 22);
      if (fresh) std::fwrite(tensors_magic, 1, sizeof tensors_magic, f->tensors);
    }
    rec->files_[w] = std::move(f);
  }
  rec->writer_ = std::thread([r = rec.get()] { r->write_loop(); });
  return rec;
}

recorder::recorder(bool tensors) : tensors_(tensors) {}

void recorder::push(item it) {
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    queue_.push_back(std::move(it));
  }
  q_cv_.notify_one();
}

void recorder::write_loop() {
  for (;;) {
    item it;
    {
      std::unique_lock<std::mutex> lk(q_mu_);
      q_cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything is written
      it = std::move(queue_.front());
      queue_.pop_front();
    }
    file& f = of(it.worker);
    if (it.hash) {
      try {
        it.rec.hash = it.hash->get();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(error_mu_);
        if (!error_)
          error_ = core::error::at_file(f.log_path,
                                        std::string("computing a message hash failed: ") + e.what(),
                                        "set runtime.record = false to train without the log");
        continue;
      }
      it.hash.reset();  // its slot goes back before the write
      it.line = to_line(it.rec);
      it.line += '\n';
    }
    std::lock_guard<std::mutex> lk(f.mu);
    if (f.log) {
      if (it.flush) {
        if (std::fflush(f.log) != 0) fail(f, "log");
      } else if (std::fwrite(it.line.data(), 1, it.line.size(), f.log) != it.line.size()) {
        fail(f, "log");
      }
    }
    if (it.done) it.done->set_value();
  }
}

void recorder::flush_and_wait(int worker) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> written = done->get_future();
  item it;
  it.worker = worker;
  it.flush = true;
  it.done = std::move(done);
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    if (stopping_) return;  // close() drains the queue itself; its writer may be gone
    queue_.push_back(std::move(it));
  }
  q_cv_.notify_one();
  written.wait();
}

namespace {
bool is_snapshot(const transport::tag& tg) {
  const auto k = static_cast<tensor_kind>(tg.kind);
  return k == tensor_kind::snap_params || k == tensor_kind::snap_exp_avg ||
         k == tensor_kind::snap_exp_avg_sq;
}
}  // namespace

recorder::~recorder() { close(); }

recorder::file& recorder::of(int worker) {
  auto it = files_.find(worker);
  TROUPE_CHECK(it != files_.end(), "worker " + std::to_string(worker) +
                                       " has no message log in this process");
  return *it->second;
}

void recorder::fail(file& f, const std::string& what) {
  if (f.failed) return;
  f.failed = true;
  std::lock_guard<std::mutex> lk(error_mu_);
  if (!error_)
    error_ = core::error::at_file(what == "tensors" ? f.tensors_path : f.log_path,
                                  std::string("writing the message log failed: ") +
                                      std::strerror(errno),
                                  "check free space, or set runtime.record = false");
}

void recorder::sent(const message_record& r, const core::tensor&) {
  item it;
  it.worker = r.src;
  it.line = to_line(r);
  it.line += '\n';
  of(r.src);  // checks the worker is this process's
  push(std::move(it));
  if (is_snapshot(r.tag)) flush_and_wait(r.src);
}

void recorder::sent_pending(message_record r, std::shared_ptr<kernels::pending_value> hash) {
  of(r.src);
  item it;
  it.worker = r.src;
  const bool snapshot = is_snapshot(r.tag);
  const int worker = r.src;
  it.rec = std::move(r);
  it.hash = std::move(hash);
  push(std::move(it));
  if (snapshot) flush_and_wait(worker);
}

void recorder::received(int src, int dst, const transport::tag& tg, const core::tensor& bytes) {
  // Snapshots go to the checkpoint writer and the coordinator; --rank never replays those.
  if (is_snapshot(tg)) return;
  std::string frame;
  std::string h = frame_header(src, dst, tg, bytes);
  put_u32(frame, static_cast<std::uint32_t>(h.size()));
  frame += h;
  file& f = of(dst);
  std::lock_guard<std::mutex> lk(f.mu);
  if (!f.tensors) return;
  bool ok = std::fwrite(frame.data(), 1, frame.size(), f.tensors) == frame.size();
  if (ok && bytes.bytes() > 0)
    ok = std::fwrite(bytes.raw(), 1, bytes.bytes(), f.tensors) == bytes.bytes();
  if (!ok) fail(f, "tensors");
}

void recorder::clipped(const clip_record& c) {
  of(c.src);
  item it;
  it.worker = c.src;
  it.line = to_line(c) + "\n";
  push(std::move(it));
}

void recorder::reexecuted(int worker, std::int64_t step) {
  of(worker);
  item it;
  it.worker = worker;
  it.line = "{\"step\":" + std::to_string(step) + ",\"src\":" + std::to_string(worker) +
            ",\"control\":\"rerun\"}\n";
  push(std::move(it));
}

void recorder::flush(int worker) {
  file& f = of(worker);
  {
    std::lock_guard<std::mutex> lk(f.mu);
    if (f.tensors && std::fflush(f.tensors) != 0) fail(f, "tensors");
  }
  item it;
  it.worker = worker;
  it.flush = true;
  push(std::move(it));
}

core::status recorder::close() {
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    stopping_ = true;
  }
  q_cv_.notify_one();
  if (writer_.joinable()) writer_.join();
  for (auto& [w, f] : files_) {
    std::lock_guard<std::mutex> lk(f->mu);
    if (f->log && std::fclose(f->log) != 0) fail(*f, "log");
    if (f->tensors && std::fclose(f->tensors) != 0) fail(*f, "tensors");
    f->log = f->tensors = nullptr;
  }
  std::lock_guard<std::mutex> lk(error_mu_);
  if (error_) return *error_;
  return core::status::success();
}

}  // namespace troupe::actors
