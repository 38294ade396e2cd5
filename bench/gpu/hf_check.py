#!/usr/bin/env python3
"""troupe against Hugging Face transformers on the same weights and tokens, in fp32.

For GPT-2 (GPT2LMHeadModel) and LLaMA (LlamaForCausalLM with grouped-query attention, llama3
rope scaling and an untied head), built with their constructors (no hub) and written with
save_pretrained:

  import   `troupe logits DIR` (troupe reading the Hugging Face directory) against transformers'
           forward on the same tokens: max |logit difference| <= 1e-4.
  export   a troupe run started from DIR (`troupe import`, then `troupe train --init` on the GPU
           for a few steps so the weights are troupe's own), exported with `troupe export`
           (LLaMA sharded through an index); AutoModelForCausalLM.from_pretrained loads it with no
           missing or unexpected keys, and its logits are within 1e-4 of `troupe logits` on the
           checkpoint. The bf16 export must load with no missing or unexpected keys too.

Usage: python3 bench/gpu/hf_check.py --bin BIN_DIR --work DIR [--device cuda|cpu]
(bench/gpu/hf_check.sh runs it from the package bench/gpu/pack.sh stages). Prints one line per
check and a JSON summary; exit status 0 when every check passed.
"""
import argparse
import inspect
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import (check, gpt2_model, jitter, results, run, troupe_logits,  # noqa: E402
                       write_shard)

BOUND = 1e-4


def llama_model():
    torch.manual_seed(2)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # head_dim 16: pairs in all three bands
    kw = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, vocab_size=1000,
              rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kw["rope_parameters"] = dict(rope, rope_theta=500000.0)
    else:
        kw.update(rope_theta=500000.0, rope_scaling=rope)
    m = LlamaForCausalLM(LlamaConfig(**kw))
    jitter(m, 12)
    return m


def hf_logits(model, tokens, device):
    model = model.to(device).float().eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, device=device)).logits.float().cpu().numpy()


def case(name, model, args, shard_size):
    work = os.path.join(args.work, name)
    os.makedirs(work, exist_ok=True)
    hf_dir = os.path.join(work, "hf")
    model.save_pretrained(hf_dir)
    vocab = model.config.vocab_size
    rnd = np.random.default_rng(7)
    tokens = rnd.integers(0, vocab, size=(3, 48)).tolist()

    # In: troupe reads the directory transformers wrote.
    ref = hf_logits(model, tokens, args.device)
    ours = troupe_logits(args.bin, hf_dir, tokens, work, args.device, vocab)
    diff = float(np.abs(ours - ref).max())
    check(f"{name} import: troupe logits vs transformers", diff <= BOUND,
          {"max_abs_diff": f"{diff:.3g}", "bound": BOUND, "logit_scale": f"{float(np.abs(ref).max()):.3g}"})

    # Out: a troupe run from those weights, exported, loaded by transformers.
    troupe = os.path.join(args.bin, "troupe")
    write_shard(os.path.join(work, "train.bin"), 20000, vocab, 3)
    cfg = os.path.join(work, "finetune.toml")
    run([troupe, "import", hf_dir, "--out", cfg, "--seq-length", "48", "--force"])
    run_dir = os.path.join(work, "run")
    run([troupe, "train", cfg, "--set", f"data.train={work}/train.bin", "--set", "data.val=",
         "--set", "data.tokenizer_dir=", "--set", f"runtime.run_dir={run_dir}",
         "--set", f"runtime.device={args.device}", "--set", "train.steps=3",
         "--set", "train.warmup_steps=0", "--set", "optimizer.lr=1e-3", "--no-plan-check"])
    exp = os.path.join(work, "export")
    run([troupe, "export", run_dir, "--out", exp, "--max-shard-size", shard_size])
    sharded = os.path.exists(os.path.join(exp, "model.safetensors.index.json"))
    loaded, info = AutoModelForCausalLM.from_pretrained(exp, output_loading_info=True)
    keys_ok = not info["missing_keys"] and not info["unexpected_keys"]
    check(f"{name} export: from_pretrained keys", keys_ok,
          {"missing": info["missing_keys"], "unexpected": info["unexpected_keys"], "sharded": sharded})
    ref = hf_logits(loaded, tokens, args.device)
    ours = troupe_logits(args.bin, run_dir, tokens, work, args.device, vocab)
    diff = float(np.abs(ours - ref).max())
    check(f"{name} export: transformers on troupe's export vs troupe logits", diff <= BOUND,
          {"max_abs_diff": f"{diff:.3g}", "bound": BOUND})
    exp16 = os.path.join(work, "export_bf16")
    run([troupe, "export", run_dir, "--out", exp16, "--dtype", "bf16"])
    _, info16 = AutoModelForCausalLM.from_pretrained(exp16, output_loading_info=True)
    check(f"{name} bf16 export: from_pretrained keys",
          not info16["missing_keys"] and not info16["unexpected_keys"],
          {"missing": info16["missing_keys"], "unexpected": info16["unexpected_keys"]})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="folder with the troupe executable")
    ap.add_argument("--work", required=True, help="scratch folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.work, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {args.device}")
    case("gpt2", gpt2_model(), args, "5GB")
    case("llama", llama_model(), args, "100KB")
    print(json.dumps({"hf_check": results}, default=sorted))  # key sets as sorted lists
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
