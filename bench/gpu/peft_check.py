#!/usr/bin/env python3
"""troupe's LoRA adapters loaded by Hugging Face PEFT, in fp32.

For GPT-2 (GPT2LMHeadModel: Conv1D modules, fused c_attn, tied head) and LLaMA (LlamaForCausalLM
with grouped-query attention), each with PEFT's default targets and with more modules, built with
their constructors (no hub) and written with save_pretrained as the base:

  train    `troupe import` the base, then `troupe train` with a [lora] table (rank 4, alpha 8) for
           a few steps at a large learning rate, so that every B is far from its zero start;
           `troupe export RUN --peft DIR` and `troupe export RUN --merge-lora --out DIR`.
  keys     PeftModel.from_pretrained(base, DIR) loads with no missing-adapter-keys warning; the
           adapter tensors PEFT holds (get_peft_model_state_dict) are exactly the file's, by name,
           shape and value; a second load through load_adapter reports no missing adapter keys and
           no unexpected keys; the adapter config PEFT read has troupe's r, lora_alpha and targets.
  moved    the PEFT model's logits differ from the base model's by more than 100 × the bound, so
           an adapter ignored or mis-scaled cannot pass the checks below.
  logits   the PEFT model's logits within 1e-4 of `troupe logits RUN` (troupe's own forward of the
           LoRA checkpoint) and of transformers on the --merge-lora directory.
  merge    merge_and_unload() of the PEFT model against the --merge-lora directory's weights:
           the same parameter names, every element within 1e-5.

Usage: python3 bench/gpu/peft_check.py --bin BIN_DIR --work DIR [--device cuda|cpu]
       [--train-device cpu|cuda]
(bench/gpu/peft_check.sh runs it from the package bench/gpu/pack.sh stages). --device is where
transformers, PEFT and `troupe logits` run; --train-device where `troupe train` runs (default cpu,
so the check does not depend on the CUDA backend). Prints one line per check and a JSON summary;
exit status 0 when every check passed.
"""
import argparse
import inspect
import json
import os
import sys
import warnings

import numpy as np
import peft
import torch
import transformers
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import (check, gpt2_model, jitter, results, run, troupe_logits,  # noqa: E402
                       write_shard)

BOUND = 1e-4        # logits, fp32
MERGE_BOUND = 1e-5  # merged weights, fp32
MOVED = 100 * BOUND  # the adapters must move the logits by at least this much
RANK, ALPHA = 4, 8.0


def llama_model():
    torch.manual_seed(2)
    kw = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, vocab_size=1000,
              rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        kw["rope_theta"] = 10000.0
    m = LlamaForCausalLM(LlamaConfig(**kw))
    jitter(m, 12)
    return m


def load_base(hf_dir, device):
    return AutoModelForCausalLM.from_pretrained(hf_dir).float().to(device).eval()


def logits_of(model, tokens, device):
    with torch.no_grad():
        return model(torch.tensor(tokens, device=device)).logits.float().cpu().numpy()


def load_peft(base, peft_dir):
    """PeftModel.from_pretrained, with the warnings it raised (PEFT warns, rather than fails, when
    adapter keys are missing)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, peft_dir)
    return model.eval(), [str(w.message) for w in caught]


def field(result, key):
    return list(result[key] if isinstance(result, dict) else getattr(result, key))


def case(name, make_model, targets, args):
    work = os.path.join(args.work, name)
    os.makedirs(work, exist_ok=True)
    hf_dir = os.path.join(work, "base")
    base = make_model()
    base.save_pretrained(hf_dir)
    vocab = base.config.vocab_size
    tokens = np.random.default_rng(7).integers(0, vocab, size=(3, 48)).tolist()
    base_logits = logits_of(base.to(args.device).float().eval(), tokens, args.device)
    del base

    # troupe: a LoRA fine-tune of the base, exported both ways.
    troupe = os.path.join(args.bin, "troupe")
    write_shard(os.path.join(work, "train.bin"), 20000, vocab, 3)
    cfg = os.path.join(work, "finetune.toml")
    run([troupe, "import", hf_dir, "--out", cfg, "--force"])  # all 128 positions, so the merged
    # export holds the base's whole position table (a shorter --seq-length exports fewer rows of it)
    run_dir = os.path.join(work, "run")
    sets = {"data.train": f"{work}/train.bin", "data.val": "", "data.tokenizer_dir": "",
            "runtime.run_dir": run_dir, "runtime.device": args.train_device, "train.steps": "12",
            "train.warmup_steps": "0", "optimizer.lr": "1e-2", "optimizer.min_lr": "1e-2",
            "lora.rank": str(RANK), "lora.alpha": str(ALPHA)}
    if targets:
        sets["lora.targets"] = ",".join(targets)
    cmd = [troupe, "train", cfg, "--no-plan-check"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    run(cmd)
    peft_dir = os.path.join(work, "peft")
    merged_dir = os.path.join(work, "merged")
    run([troupe, "export", run_dir, "--peft", peft_dir])
    run([troupe, "export", run_dir, "--merge-lora", "--out", merged_dir])

    # keys: PEFT loads the adapter and holds exactly the file's tensors.
    file_sd = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    model, warned = load_peft(load_base(hf_dir, args.device), peft_dir)
    key_warnings = [w for w in warned if "adapter keys" in w or "unexpected key" in w.lower()]
    held = {k: v.detach().float().cpu() for k, v in get_peft_model_state_dict(model).items()}
    missing = sorted(set(held) - set(file_sd))
    unexpected = sorted(set(file_sd) - set(held))
    value_diff = max((float((held[k] - file_sd[k].float()).abs().max()) if held[k].shape == file_sd[k].shape
                      else float("inf")) for k in set(held) & set(file_sd)) if held else float("inf")
    check(f"{name} keys: PeftModel.from_pretrained holds the file's adapters",
          not missing and not unexpected and not key_warnings and value_diff == 0.0,
          {"tensors": len(file_sd), "missing": missing, "unexpected": unexpected,
           "max_value_diff": value_diff, "key_warnings": key_warnings})

    again = PeftModel.from_pretrained(load_base(hf_dir, args.device), peft_dir)
    res = again.load_adapter(peft_dir, adapter_name="reload")
    # The model's other weights (the base, the first adapter) are "missing" from any adapter file.
    res_missing = [k for k in field(res, "missing_keys") if ".reload." in k]
    res_unexpected = field(res, "unexpected_keys")
    check(f"{name} keys: load_adapter result", not res_missing and not res_unexpected,
          {"missing_adapter_keys": res_missing, "unexpected": res_unexpected})
    del again

    pc = model.peft_config["default"]
    want_targets = set(targets or (["c_attn"] if name.startswith("gpt2") else ["q_proj", "v_proj"]))
    cfg_ok = (pc.r == RANK and float(pc.lora_alpha) == ALPHA and set(pc.target_modules) == want_targets
              and not getattr(pc, "use_rslora", False) and not getattr(pc, "use_dora", False))
    lora_layers = sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))
    check(f"{name} config: PEFT read troupe's adapter_config.json",
          cfg_ok and lora_layers > 0 and 2 * lora_layers == len(file_sd),
          {"r": pc.r, "lora_alpha": pc.lora_alpha, "target_modules": sorted(pc.target_modules),
           "fan_in_fan_out": pc.fan_in_fan_out, "lora_layers": lora_layers})

    # moved: the adapters change the model (B is far from its zero start).
    peft_logits = logits_of(model, tokens, args.device)
    b_max = max(float(v.abs().max()) for k, v in file_sd.items() if ".lora_B." in k)
    moved = float(np.abs(peft_logits - base_logits).max())
    check(f"{name} moved: PEFT logits vs the base model's", moved > MOVED and b_max > 0,
          {"max_abs_diff": f"{moved:.3g}", "must_exceed": MOVED, "max_abs_B": f"{b_max:.3g}"})

    # logits: PEFT against troupe's own forward and against the merged export.
    ours = troupe_logits(args.bin, run_dir, tokens, work, args.device, vocab)
    diff = float(np.abs(peft_logits - ours).max())
    check(f"{name} logits: PEFT vs troupe logits of the LoRA checkpoint", diff <= BOUND,
          {"max_abs_diff": f"{diff:.3g}", "bound": BOUND,
           "logit_scale": f"{float(np.abs(ours).max()):.3g}"})
    merged_ref = load_base(merged_dir, args.device)
    diff = float(np.abs(peft_logits - logits_of(merged_ref, tokens, args.device)).max())
    check(f"{name} logits: PEFT vs transformers on the --merge-lora export", diff <= BOUND,
          {"max_abs_diff": f"{diff:.3g}", "bound": BOUND})

    # merge: PEFT's own merge against troupe's.
    merged_peft = model.merge_and_unload()
    a = {k: v.detach().float().cpu() for k, v in merged_peft.named_parameters()}
    b = {k: v.detach().float().cpu() for k, v in merged_ref.named_parameters()}
    only_peft, only_troupe = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    worst, worst_name = 0.0, ""
    for k in sorted(set(a) & set(b)):
        d = float((a[k] - b[k]).abs().max()) if a[k].shape == b[k].shape else float("inf")
        if d > worst:
            worst, worst_name = d, k
    check(f"{name} merge: merge_and_unload() vs the --merge-lora weights",
          not only_peft and not only_troupe and worst <= MERGE_BOUND,
          {"max_abs_diff": f"{worst:.3g}", "at": worst_name, "bound": MERGE_BOUND,
           "only_peft": only_peft, "only_troupe": only_troupe})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="folder with the troupe executable")
    ap.add_argument("--work", required=True, help="scratch folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where transformers, PEFT and troupe logits run")
    ap.add_argument("--train-device", default="cpu", choices=["cpu", "cuda"],
                    help="where troupe train runs")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.work, exist_ok=True)
    print(f"peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
          f"device {args.device}, troupe train on {args.train_device}")
    case("gpt2", gpt2_model, None, args)                                  # PEFT's default: c_attn
    case("gpt2_all", gpt2_model, ["c_attn", "attn.c_proj", "c_fc"], args)  # mlp.c_proj stays plain
    case("llama", llama_model, None, args)                                # q_proj, v_proj
    case("llama_all", llama_model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                    "down_proj"], args)
    print(json.dumps({"peft_check": results}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
