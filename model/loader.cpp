#include "model/loader.hpp"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "core/rng.hpp"

namespace troupe::model {

namespace {

constexpr std::uint64_t kTrainPurpose = 0xda7a;
constexpr std::uint64_t kEvalPurpose = 0xe7a1;

}  // namespace

loader_options loader_options::from(const core::config& c) {
  loader_options o;
  o.seq_length = c.model.seq_length;
  o.micro_batch_size = c.parallel.micro_batch_size;
  o.micro_batches = c.parallel.micro_batch_num * c.train.gradient_accumulation_steps;
  o.seed = c.train.seed;
  o.vocab_size = c.model.vocab_size;
  return o;
}

core::result<std::vector<std::string>> resolve_shards(const std::string& spec) {
  namespace fs = std::filesystem;
  const std::string hint = "data.train / data.val name a shard, a folder of *.bin shards, or a "
                           "glob such as 'data/tok/train_*.bin'; make shards with `troupe data "
                           "prepare`";
  if (spec.empty()) return core::error::make("no token shard given", hint);
  std::vector<std::string> out;
  std::error_code ec;
  if (fs::is_directory(spec, ec)) {
    for (const auto& e : fs::directory_iterator(spec, ec))
      if (e.is_regular_file() && e.path().extension() == ".bin") out.push_back(e.path().string());
    if (ec) return core::error::at_file(spec, "cannot list folder: " + ec.message(), hint);
    std::sort(out.begin(), out.end());
    if (out.empty()) return core::error::at_file(spec, "folder holds no *.bin shards", hint);
    return out;
  }
  if (spec.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    int rc = ::glob(spec.c_str(), 0, nullptr, &g);
    if (rc == 0)
      for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (out.empty()) return core::error::at_file(spec, "the pattern matches no file", hint);
    std::sort(out.begin(), out.end());
    return out;
  }
  if (!fs::exists(spec, ec)) return core::error::at_file(spec, "token shard not found", hint);
  out.push_back(spec);
  return out;
}

core::result<loader> loader::open(const std::string& spec, const loader_options& opt) {
  auto paths = resolve_shards(spec);
  if (!paths) return paths.err();
  return open(paths.value(), opt);
}

core::result<loader> loader::open(const std::vector<std::string>& paths,
                                  const loader_options& opt) {
  if (opt.seq_length < 1 || opt.micro_batch_size < 1 || opt.micro_batches < 1)
    return core::error::make("loader needs seq_length, micro_batch_size and micro-batches per step "
                             "of at least 1, got " + std::to_string(opt.seq_length) + ", " +
                                 std::to_string(opt.micro_batch_size) + ", " +
                                 std::to_string(opt.micro_batches),
                             "check model.seq_length, parallel.micro_batch_size, "
                             "parallel.micro_batch_num and train.gradient_accumulation_steps");
  if (paths.empty()) return core::error::make("no token shard given", "set data.train / data.val");
  loader l(opt);
  const auto need = static_cast<std::uint64_t>(opt.seq_length) + 1;
  const bool rows = is_instruction_shard(paths.front());
  for (const auto& p : paths) {
    if (is_instruction_shard(p) != rows)
      return core::error::at_file(p,
                                  std::string("is ") + (rows ? "a token shard" : "an instruction shard") +
                                      ", but " + paths.front() + " is " +
                                      (rows ? "an instruction shard" : "a token shard"),
                                  "a data split is either plain text (token shards) or "
                                  "instruction records (instruction shards), not both");
    if (rows) {
      auto s = instruction_shard::open(p);
      if (!s) return s.err();
      if (static_cast<std::uint64_t>(s->layout().row_tokens) != need)
        return core::error::at_file(p,
                                    "holds rows of " + std::to_string(s->layout().row_tokens) +
                                        " tokens (prepared for seq_length " +
                                        std::to_string(s->layout().row_tokens - 1) +
                                        "), but model.seq_length " +
                                        std::to_string(opt.seq_length) + " needs rows of " +
                                        std::to_string(need),
                                    "prepare the records again with this config "
                                    "(`troupe data prepare --config`), or set model.seq_length = " +
                                        std::to_string(s->layout().row_tokens - 1));
      if (s->rows() == 0)
        return core::error::at_file(p, "holds no rows",
                                    "give `troupe data prepare` records that fit model.seq_length");
      l.first_window_.push_back(l.total_windows_);
      l.total_windows_ += s->rows();
      l.total_tokens_ += s->rows() * need;
      l.rows_.push_back(std::move(s.value()));
      continue;
    }
    auto s = shard::open(p);
    if (!s) return s.err();
    if (s->size() < need)
      return core::error::at_file(p,
                                  "holds " + std::to_string(s->size()) + " tokens, fewer than the " +
                                      std::to_string(need) +
                                      " one sequence needs (seq_length + 1 for the shifted targets)",
                                  "use more text, a larger --val-fraction, or a smaller "
                                  "model.seq_length");
    l.first_window_.push_back(l.total_windows_);
    l.total_windows_ += s->size() - static_cast<std::uint64_t>(opt.seq_length);
    l.total_tokens_ += s->size();
    l.shards_.push_back(std::move(s.value()));
  }
  return l;
}

std::uint64_t loader::window_of(std::uint64_t step, std::uint64_t k) const {
  return core::rng_stream(core::stream_key(opt_.seed, kTrainPurpose, step, k)).below(total_windows_);
}

std::pair<std::size_t, std::uint64_t> loader::locate(std::uint64_t w) const {
  // The shard whose windows contain w: the last one that begins at or before it.
  auto it = std::upper_bound(first_window_.begin(), first_window_.end(), w);
  auto s = static_cast<std::size_t>(it - first_window_.begin()) - 1;
  return {s, w - first_window_[s]};
}

loader::position loader::position_of(std::uint64_t step, std::uint64_t k) const {
  auto [s, off] = locate(window_of(step, k));
  if (masked()) return {rows_[s].path(), off, true};
  return {shards_[s].path(), off, false};
}

std::int64_t loader::trained_targets(std::uint64_t step, std::uint64_t sequences) const {
  if (!masked()) return static_cast<std::int64_t>(sequences) * opt_.seq_length;
  std::int64_t n = 0;
  for (std::uint64_t k = 0; k < sequences; ++k) {
    auto [s, r] = locate(window_of(step, k));
    n += rows_[s].trained(r);
  }
  return std::max<std::int64_t>(n, 1);
}

batch loader::cut(std::uint64_t step, int dp_rank, int mb) const {
  TROUPE_CHECK(dp_rank >= 0, "negative data-parallel rank " + std::to_string(dp_rank));
  TROUPE_CHECK(mb >= 0 && mb < opt_.micro_batches,
               "micro-batch " + std::to_string(mb) + " outside [0, " +
                   std::to_string(opt_.micro_batches) + ")");
  const auto B = static_cast<std::uint64_t>(opt_.micro_batch_size);
  const auto M = static_cast<std::uint64_t>(opt_.micro_batches);
  std::vector<std::uint64_t> windows(B);
  for (std::uint64_t i = 0; i < B; ++i)
    windows[i] = window_of(step, (static_cast<std::uint64_t>(dp_rank) * M +
                                  static_cast<std::uint64_t>(mb)) * B + i);
  return gather(windows);
}

batch loader::eval_cut(int index) const {
  TROUPE_CHECK(index >= 0, "negative evaluation batch index " + std::to_string(index));
  const auto B = static_cast<std::uint64_t>(opt_.micro_batch_size);
  std::vector<std::uint64_t> windows(B);
  for (std::uint64_t i = 0; i < B; ++i) {
    std::uint64_t j = static_cast<std::uint64_t>(index) * B + i;
    windows[i] = core::rng_stream(core::stream_key(0, kEvalPurpose, j)).below(total_windows_);
  }
  return gather(windows);
}

batch loader::gather(const std::vector<std::uint64_t>& windows) const {
  const int B = static_cast<int>(windows.size());
  const int T = opt_.seq_length;
  batch b;
  b.batch_size = B;
  b.seq_length = T;
  b.tokens = core::tensor::zeros({static_cast<std::int64_t>(B) * T}, core::dtype::i32);
  b.targets = core::tensor::zeros({static_cast<std::int64_t>(B) * T}, core::dtype::i32);
  auto* x = b.tokens.data<std::int32_t>();
  auto* y = b.targets.data<std::int32_t>();
  auto check_id = [&](std::uint64_t id, const std::string& path, std::uint64_t pos) {
    if (opt_.vocab_size > 0 && id >= static_cast<std::uint64_t>(opt_.vocab_size))
      throw core::failure("token id " + std::to_string(id) + " at token " + std::to_string(pos) +
                          " of " + path + " is not below model.vocab_size " +
                          std::to_string(opt_.vocab_size) +
                          " (hint: tokenize the data with the model's vocabulary, or raise "
                          "model.vocab_size)");
  };
  std::int64_t trained = 0;
  std::int32_t* starts = nullptr;
  if (masked() && rows_layout().packing) {
    b.doc_starts = core::tensor::zeros({static_cast<std::int64_t>(B) * T}, core::dtype::i32);
    starts = b.doc_starts.data<std::int32_t>();
  }
  for (int i = 0; i < B; ++i) {
    auto [s, off] = locate(windows[i]);
    std::int32_t* xi = x + static_cast<std::size_t>(i) * T;
    std::int32_t* yi = y + static_cast<std::size_t>(i) * T;
    if (masked()) {
      const instruction_shard& sh = rows_[s];
      const auto mask = sh.mask(off);
      const std::uint64_t L = static_cast<std::uint64_t>(T) + 1;
      for (int t = 0; t <= T; ++t)
        check_id(sh.token(off, t), sh.path(), off * L + static_cast<std::uint64_t>(t));
      for (int t = 0; t < T; ++t) {
        xi[t] = static_cast<std::int32_t>(sh.token(off, t));
        const bool train = mask[static_cast<std::size_t>(t) + 1] != 0;
        yi[t] = train ? static_cast<std::int32_t>(sh.token(off, t + 1)) : -1;
        trained += train;
      }
      if (starts) {
        std::int32_t* si = starts + static_cast<std::size_t>(i) * T;
        std::int32_t begin = 0;
        for (int t = 0; t < T; ++t) {
          if (sh.starts_example(off, t)) begin = t;
          si[t] = begin;
        }
      }
      continue;
    }
    const shard& sh = shards_[s];
    for (int t = 0; t <= T; ++t)
      check_id(sh.id(off + static_cast<std::uint64_t>(t)), sh.path(), off + static_cast<std::uint64_t>(t));
    // An id of 2^31 or more (only a uint32 shard can hold one) turns negative here, and the
    // embedding refuses it by name, as it does any id outside the vocabulary.
    for (int t = 0; t < T; ++t) {
      xi[t] = static_cast<std::int32_t>(sh.id(off + static_cast<std::uint64_t>(t)));
      yi[t] = static_cast<std::int32_t>(sh.id(off + static_cast<std::uint64_t>(t) + 1));
    }
    trained += T;
  }
  b.trained = trained;
  return b;
}

}  // namespace troupe::model
