// Instruction data end to end, as the built binary: `troupe data prepare` on JSONL records writes
// instruction shards and reports every dropped record with file and line; `troupe train` trains
// on them; `troupe eval` scores a checkpoint with the run's own masked validation loss. Every bad
// input exits non-zero with its message.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "core/config.hpp"
#include "model/instruction_shards.hpp"
#include "model/metrics.hpp"
#include "tests/cli/cli_harness.hpp"

using namespace troupe;
using namespace troupe::cli_test;
using model::testing::scratch_dir;

namespace {

const std::string kVocab = TROUPE_SOURCE_DIR "/data/gpt2";

// tiny_run's model over GPT-2's vocabulary, its data in tmp/rows (made by the test).
std::string write_config(const scratch_dir& tmp, const std::string& extra = "") {
  core::config c = model::testing::tiny_run(tmp);
  c.model.vocab_size = 50304;
  c.train.steps = 3;
  c.train.eval_interval = 0;
  c.train.eval_batches = 3;
  c.data.train = tmp / "rows/train.bin";
  c.data.val = tmp / "rows/val.bin";
  c.data.tokenizer_dir = kVocab;
  const std::string path = tmp / "ft.toml";
  std::ofstream(path) << core::to_toml(c) << extra;
  return path;
}

void write_records(const std::string& path, int good, bool with_bad) {
  std::ofstream out(path);
  for (int i = 0; i < good; ++i) {
    if (i % 2 == 0)
      out << "{\"prompt\": \"Reverse " << i << "ab:\", \"response\": \" ba" << i << "\"}\n";
    else
      out << "{\"messages\": [{\"role\": \"user\", \"content\": \"Twice " << i
          << "?\"}, {\"role\": \"assistant\", \"content\": \" " << 2 * i << "\"}]}\n";
    if (with_bad && i == 1) {
      out << "{\"prompt\": \"broken\"\n";                    // line 3: invalid JSON
      out << "{\"prompt\": \"no answer\"}\n";                 // line 4: missing field
      out << "{\"prompt\": \"" << std::string(300, 'z') << "\", \"response\": \"x\"}\n";  // line 5
    }
  }
}

}  // namespace

TEST_CASE("data prepare turns JSONL records into instruction shards, reporting dropped records") {
  scratch_dir tmp("icli_prepare");
  const std::string cfg = write_config(tmp);
  write_records(tmp / "set.jsonl", 40, true);
  auto r = run_troupe(tmp.path, "data prepare --input set.jsonl --out rows --config ft.toml "
                                "--val-fraction 0.25");
  INFO(r.out << r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.err, "set.jsonl:3: record dropped: invalid JSON"));
  CHECK(contains(r.err, "set.jsonl:4: record dropped: missing field \"response\""));
  CHECK(contains(r.err, "set.jsonl:5: record dropped: prompt too long: its "));
  CHECK(contains(r.out, "prepared 43 records (template plain, padded, seq_length 16)"));
  CHECK(contains(r.out, "40 kept, 3 dropped (1 invalid JSON, 1 missing or mistyped fields, 1 "
                        "prompt too long for seq_length)"));
  auto train = model::instruction_shard::open(tmp / "rows/train.bin");
  auto val = model::instruction_shard::open(tmp / "rows/val.bin");
  REQUIRE(train.ok());
  REQUIRE(val.ok());
  CHECK(train->rows() == 30);
  CHECK(val->rows() == 10);
  CHECK(train->layout().row_tokens == 17);
  CHECK_FALSE(train->layout().packing);

  // Packing from the config: fewer rows, the same records.
  auto p = run_troupe(tmp.path, "data prepare --input set.jsonl --out packed --config ft.toml "
                                "--set data.packing=true --val-fraction 0.25");
  REQUIRE(p.code == 0);
  auto packed = model::instruction_shard::open(tmp / "packed/train.bin");
  REQUIRE(packed.ok());
  CHECK(packed->layout().packing);
  CHECK(packed->rows() < train->rows());
  std::int64_t a = 0, b = 0;
  for (std::size_t i = 0; i < train->rows(); ++i) a += train->trained(i);
  for (std::size_t i = 0; i < packed->rows(); ++i) b += packed->trained(i);
  CHECK(a == b);

  // The LLaMA-3 chat template with LLaMA-3's tokenizer.json, for a model whose vocabulary is
  // smaller than the tokenizer's: refused at the first record, naming the id.
  auto l = run_troupe(tmp.path, "data prepare --input set.jsonl --out llama --config ft.toml "
                                "--set data.template=llama3 --tokenizer '" TROUPE_SOURCE_DIR
                                "/data/llama3'");
  CHECK(l.code == 1);
  CHECK(contains(l.err, "set.jsonl:1: token id 128000 is not below model.vocab_size 50304"));
  // With the model's vocabulary: ids past 65,535, so 4-byte rows, opening with the header tokens.
  auto ok = run_troupe(tmp.path, "data prepare --input set.jsonl --out llama --config ft.toml "
                                 "--set data.template=llama3 --set model.vocab_size=128256 "
                                 "--tokenizer '" TROUPE_SOURCE_DIR "/data/llama3'");
  INFO(ok.out << ok.err);
  REQUIRE(ok.code == 0);
  CHECK(contains(ok.out, "(template llama3, padded, seq_length 16)"));
  auto rows = model::instruction_shard::open(tmp / "llama/train.bin");
  REQUIRE(rows.ok());
  CHECK(rows->layout().template_id == 1);
  CHECK(rows->token(0, 0) == 128000);  // <|begin_of_text|>
  CHECK(rows->token(0, 1) == 128006);  // <|start_header_id|>
}

TEST_CASE("train and eval on instruction shards: eval reproduces the run's masked validation loss") {
  scratch_dir tmp("icli_train");
  const std::string cfg = write_config(tmp);
  write_records(tmp / "set.jsonl", 40, false);
  REQUIRE(run_troupe(tmp.path, "data prepare --input set.jsonl --out rows --config ft.toml "
                               "--val-fraction 0.25").code == 0);
  auto t = run_troupe(tmp.path, "train ft.toml --single-rank");
  INFO(t.out << t.err);
  REQUIRE(t.code == 0);
  const std::string metrics = slurp(tmp / "run/metrics.jsonl");
  const std::string last = metrics.substr(metrics.rfind('\n', metrics.size() - 2) + 1);
  auto m = model::parse_json_line(last);
  REQUIRE(m.ok());
  REQUIRE(m->val_loss.has_value());

  auto e = run_troupe(tmp.path, "eval run --data rows/val.bin --json");
  INFO(e.out << e.err);
  REQUIRE(e.code == 0);
  CHECK(contains(e.out, "\"masked\":true"));
  const auto at = e.out.find("\"loss\":");
  REQUIRE(at != std::string::npos);
  const double loss = std::stod(e.out.substr(at + 7));
  CHECK(loss == doctest::Approx(*m->val_loss).epsilon(1e-6));

  auto h = run_troupe(tmp.path, "eval run --data rows/val.bin --batches 2 --device cpu");
  REQUIRE(h.code == 0);
  CHECK(contains(h.out, "2 batches × 2 × 16 = 64 targets"));
  CHECK(contains(h.out, "trained (instruction data: the loss is their mean)"));

  // The run exported as a Hugging Face directory evaluates to the same masked loss, bit for bit:
  // its sequence length is the rows' (prepared for seq_length 16), the other settings given.
  REQUIRE(run_troupe(tmp.path, "export run --out hf").code == 0);
  auto x = run_troupe(tmp.path, "eval hf --data rows/val.bin --json --batches 3 --batch-size 2");
  INFO(x.out << x.err);
  REQUIRE(x.code == 0);
  CHECK(contains(x.out, "\"seq_length\":16"));
  CHECK(contains(x.out, "\"masked\":true"));
  const auto xat = x.out.find("\"loss\":");
  REQUIRE(xat != std::string::npos);
  CHECK(std::stod(x.out.substr(xat + 7)) == loss);
  auto xh = run_troupe(tmp.path, "eval hf --data rows/val.bin --batches 2 --batch-size 2");
  REQUIRE(xh.code == 0);
  CHECK(contains(xh.out, "(Hugging Face model directory)"));
  CHECK(contains(xh.out, "2 batches × 2 × 16 = 64 targets"));
  CHECK(contains(h.out, "perplexity"));
}

TEST_CASE("bad instruction inputs exit non-zero with their message") {
  scratch_dir tmp("icli_bad");
  write_config(tmp);
  write_records(tmp / "set.jsonl", 4, false);
  std::ofstream(tmp / "text.txt") << "some text\n";
  {
    std::ofstream bad(tmp / "bad.jsonl");
    bad << "{\"prompt\": 1, \"response\": \"x\"}\n\nnot json\n";
  }

  auto no_cfg = run_troupe(tmp.path, "data prepare --input set.jsonl --out o");
  CHECK(no_cfg.code == 2);
  CHECK(contains(no_cfg.err, "JSONL instruction data needs --config CONFIG"));

  auto mixed = run_troupe(tmp.path, "data prepare --input set.jsonl text.txt --out o --config ft.toml");
  CHECK(mixed.code == 2);
  CHECK(contains(mixed.err, "text.txt: JSONL instruction data and text cannot be prepared together"));

  auto chunk = run_troupe(tmp.path, "data prepare --input set.jsonl --out o --config ft.toml --chunk-tokens 8");
  CHECK(chunk.code == 2);
  CHECK(contains(chunk.err, "--chunk-tokens applies to text input"));

  auto set_alone = run_troupe(tmp.path, "data prepare --input text.txt --out o --set data.packing=true "
                                        "--tokenizer '" + kVocab + "'");
  CHECK(set_alone.code == 2);
  CHECK(contains(set_alone.err, "--set needs --config"));

  auto all_bad = run_troupe(tmp.path, "data prepare --input bad.jsonl --out o --config ft.toml");
  CHECK(all_bad.code == 1);
  CHECK(contains(all_bad.err, "bad.jsonl:1: record dropped: field \"prompt\" is a number"));
  CHECK(contains(all_bad.err, "bad.jsonl:3: record dropped: invalid JSON"));
  CHECK(contains(all_bad.err, "no record of 2 could be used: 1 invalid JSON, 1 missing or mistyped fields"));

  auto llama = run_troupe(tmp.path, "data prepare --input set.jsonl --out o --config ft.toml "
                                    "--set data.template=llama3");
  CHECK(llama.code == 1);
  CHECK(contains(llama.err, "set.jsonl:1: the template needs the special token <|begin_of_text|>"));

  auto bad_key = run_troupe(tmp.path, "data prepare --input set.jsonl --out o --config ft.toml "
                                      "--set data.template=chatml");
  CHECK(bad_key.code == 1);
  CHECK(contains(bad_key.err, "data.template"));

  auto missing = run_troupe(tmp.path, "data prepare --input nowhere.jsonl --out o --config ft.toml");
  CHECK(missing.code == 1);
  CHECK(contains(missing.err, "nowhere.jsonl"));

  // Rows made for seq_length 16 refused by a model of seq_length 8.
  REQUIRE(run_troupe(tmp.path, "data prepare --input set.jsonl --out rows --config ft.toml "
                               "--val-fraction 0.5").code == 0);
  auto short_t = run_troupe(tmp.path, "train ft.toml --single-rank --set model.seq_length=8");
  CHECK(short_t.code != 0);
  CHECK(contains(short_t.err, "holds rows of 17 tokens (prepared for seq_length 16), but "
                              "model.seq_length 8 needs rows of 9"));

  auto no_ckpt = run_troupe(tmp.path, "eval nowhere --data rows/val.bin");
  CHECK(no_ckpt.code == 1);
  CHECK(contains(no_ckpt.err, "nowhere"));
  std::filesystem::create_directories(tmp / "hf");
  std::ofstream(tmp / "hf/config.json") << "{}";
  auto hf = run_troupe(tmp.path, "eval hf --data rows/val.bin");
  CHECK(hf.code == 1);
  CHECK(contains(hf.err, "hf/config.json: model_type: missing"));
}
