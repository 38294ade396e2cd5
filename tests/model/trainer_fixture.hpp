// Test helpers for the trainer and checkpoints: a scratch directory, token shards made from a
// keyed random stream, and a tiny GPT-2 / LLaMA run config that trains in well under a second.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/rng.hpp"
#include "model/instruction_shards.hpp"
#include "model/shards.hpp"

namespace troupe::model::testing {

/// A fresh directory under the system temp dir, removed with its contents on destruction.
struct scratch_dir {
  std::filesystem::path path;
  explicit scratch_dir(const std::string& tag) {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("troupe_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~scratch_dir() { std::filesystem::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

/// A shard of `n` tokens in [0, vocab): a cycle of 8 tokens with a quarter of the positions
/// replaced by random ones, so that a few steps of training lower the loss clearly.
inline void write_pattern_shard(const std::string& file, std::size_t n, int vocab,
                                std::uint64_t key) {
  core::rng_stream rng(core::stream_key(key, 0x5eed));
  std::vector<std::uint16_t> tokens(n);
  for (std::size_t i = 0; i < n; ++i)
    tokens[i] = static_cast<std::uint16_t>(rng.below(4) == 0 ? rng.below(vocab) : (i % 8) * 5 % vocab);
  auto st = write_shard(file, tokens);
  if (!st) throw std::runtime_error(st.err().to_string());
}

/// A tiny run: 2 layers, C=32, T=16, V=64, 2 micro-batches of 2 sequences, shards in `dir`.
inline core::config tiny_run(const scratch_dir& dir, core::arch_kind arch = core::arch_kind::gpt2) {
  write_pattern_shard(dir / "train.bin", 20000, 64, 1);
  write_pattern_shard(dir / "val.bin", 4000, 64, 2);
  core::config c;
  c.model.arch = arch;
  c.model.num_layers = 2;
  c.model.hidden_size = 32;
  c.model.num_heads = 4;
  c.model.num_kv_heads = arch == core::arch_kind::llama ? 2 : 0;
  c.model.ffn_hidden_size = arch == core::arch_kind::llama ? 48 : 0;
  c.model.seq_length = 16;
  c.model.vocab_size = 64;
  c.model.tie_embeddings = arch == core::arch_kind::gpt2;
  c.parallel.micro_batch_num = 2;
  c.parallel.micro_batch_size = 2;
  c.optimizer.lr = 1e-2;
  c.optimizer.min_lr = 1e-3;
  c.train.steps = 6;
  c.train.warmup_steps = 2;
  c.train.grad_clip = 1.0;
  c.train.eval_interval = 3;
  c.train.eval_batches = 2;
  c.data.train = dir / "train.bin";
  c.data.val = dir / "val.bin";
  c.runtime.run_dir = dir / "run";
  c.runtime.threads = 1;
  // Through the parser, as the CLI does: validation fills the derived defaults.
  auto parsed = core::parse_config(core::to_toml(c), "tiny_run");
  if (!parsed) throw std::runtime_error(parsed.err().to_string());
  return parsed.value();
}

/// An instruction shard of `rows` rows of T+1 tokens in [1, vocab) shaped like prepared
/// instruction data: a masked prompt of 1-8 random tokens, a trained response that follows the
/// 8-cycle of write_pattern_shard, then (in about half the rows) masked padding of token 0 up to
/// the row's end. Every row trains at least one target.
inline void write_instruction_rows(const std::string& file, int rows, int T, int vocab,
                                   std::uint64_t key) {
  core::rng_stream rng(core::stream_key(key, 0x1257));
  const int L = T + 1;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows) * L);
  std::vector<std::uint8_t> mask(ids.size());
  for (int r = 0; r < rows; ++r) {
    const int prompt = 1 + static_cast<int>(rng.below(8));
    const int end = rng.below(2) == 0 ? L : prompt + 1 + static_cast<int>(rng.below(static_cast<std::uint64_t>(L - prompt)));
    for (int t = 0; t < L; ++t) {
      const std::size_t i = static_cast<std::size_t>(r) * L + t;
      if (t < prompt) ids[i] = 1 + static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(vocab - 1)));
      else if (t < end) ids[i] = 1 + (t % 8) * 5 % (vocab - 1), mask[i] = 1;
      else ids[i] = 0;
    }
  }
  auto st = write_instruction_shard(file, row_layout{L, false, 0, 0}, ids, mask);
  if (!st) throw std::runtime_error(st.err().to_string());
}

/// Instruction shards of packed rows (model/instruction_shards.hpp, version 2): each row of T+1
/// tokens holds examples of 3 to 8 tokens back to back (a masked first token and prompt, a trained
/// response following the 8-cycle), a new one starting wherever the last ended, and masked padding
/// of token 0 when what is left of the row is shorter than 3 tokens.
inline void write_packed_rows(const std::string& file, int rows, int T, int vocab,
                              std::uint64_t key) {
  core::rng_stream rng(core::stream_key(key, 0x9ac4));
  const int L = T + 1;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows) * L, 0);
  std::vector<std::uint8_t> mask(ids.size(), 0), starts(ids.size(), 0);
  for (int r = 0; r < rows; ++r) {
    const std::size_t row = static_cast<std::size_t>(r) * L;
    int t = 0;
    while (L - t >= 3) {
      const int len = std::min(L - t, 3 + static_cast<int>(rng.below(6)));
      const int prompt = 1 + static_cast<int>(rng.below(static_cast<std::uint64_t>(len - 1)));
      starts[row + t] = 1;
      for (int i = 0; i < len; ++i) {
        const std::size_t at = row + static_cast<std::size_t>(t + i);
        if (i < prompt) {
          ids[at] = 1 + static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(vocab - 1)));
        } else {
          ids[at] = 1 + (i % 8) * 5 % (vocab - 1);
          mask[at] = 1;
        }
      }
      t += len;
    }
  }
  auto st = write_instruction_shard(file, row_layout{L, true, 0, 0}, ids, mask, starts);
  if (!st) throw std::runtime_error(st.err().to_string());
}

/// Points `c` (a tiny_run) at instruction shards written into `dir` (train_rows.bin,
/// val_rows.bin) instead of its token shards.
inline void use_instruction_data(core::config& c, const scratch_dir& dir, bool packed = false) {
  auto write = packed ? write_packed_rows : write_instruction_rows;
  write(dir / "train_rows.bin", 300, c.model.seq_length, c.model.vocab_size, 3);
  write(dir / "val_rows.bin", 60, c.model.seq_length, c.model.vocab_size, 4);
  c.data.train = dir / "train_rows.bin";
  c.data.val = dir / "val_rows.bin";
}

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace troupe::model::testing
