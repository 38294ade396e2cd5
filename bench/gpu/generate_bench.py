#!/usr/bin/env python3
"""Generation speed of `troupe generate` (KV cache) beside Hugging Face transformers' `generate`
on the same GPT-2 124M weights, in one run on one GPU.

The model is troupe's own: `troupe train` initialises GPT-2 124M (bench/configs/gpt2_124m_1gpu.toml
with the 50,257-token vocabulary, fp32) and trains one step on random tokens, which writes a
checkpoint;
the same tensors are loaded into transformers' GPT2LMHeadModel (troupe stores linear weights
[out, in], GPT-2's Conv1D wants [in, out]). Both then continue a batch of identical prompts of
--prompt-tokens tokens greedily for exactly --new-tokens tokens (EOS ignored), at batch 1 and 16,
in fp32 and bf16. Rates are new tokens (batch × new tokens) per second of generation, model
loading excluded: troupe's from the prefill and decode times it prints, transformers' from a
timed `generate` call after a warm-up call. At fp32, batch 1, the greedy texts are compared too.

    python3 bench/gpu/generate_bench.py [--troupe build-gpu/bin/troupe] [--tokenizer data/gpt2]
        [--work build-gpu/work/generate] [--prompt-tokens 64] [--new-tokens 128]
        [--batches 1,16] [--dtypes fp32,bf16] [--out results.jsonl]

Needs the GPT-2 vocabulary (encoder.json, vocab.bpe: scripts/setup.sh fetches it into data/gpt2),
PyTorch and transformers. Prints one JSON line per measurement and a table at the end.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def sh(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        sys.exit("generate_bench: failed (exit %d): %s\n%s%s" %
                 (out.returncode, " ".join(cmd), out.stdout[-4000:], out.stderr[-4000:]))
    return out


def make_checkpoint(troupe, work):
    data = os.path.join(work, "data")
    sh([sys.executable, os.path.join(ROOT, "bench", "train_bench.py"), "data", data,
        "--tokens", "400000", "--vocab", "50257"])
    run = os.path.join(work, "run")
    sh([troupe, "train", os.path.join(ROOT, "bench", "configs", "gpt2_124m_1gpu.toml"),
        "--set", "model.vocab_size=50257", "--set", "precision.compute=fp32",
        "--set", "train.steps=1",
        "--set", "train.warmup_steps=0", "--set", "train.eval_interval=0",
        "--set", "parallel.micro_batch_size=4",
        "--set", "data.train=" + os.path.join(data, "train.bin"),
        "--set", "data.val=" + os.path.join(data, "val.bin"),
        "--set", "runtime.run_dir=" + run])
    found = sorted(glob.glob(os.path.join(run, "checkpoints", "step_*")))
    if not found:
        sys.exit("generate_bench: troupe train wrote no checkpoint under " + run)
    return found[-1]


def hf_model(checkpoint, dtype):
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     tie_word_embeddings=True)
    model = GPT2LMHeadModel(cfg)
    tensors = {}
    for f in glob.glob(os.path.join(checkpoint, "model*.safetensors")):
        tensors.update(load_file(f))
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for name, t in tensors.items():
        if name == "lm_head.weight":
            continue  # the tied copy of wte
        state["transformer." + name] = t.t().contiguous() if name.endswith(conv1d) else t
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {n for n, _ in model.named_parameters()}  # buffers (causal masks) are not weights
    missing = [m for m in missing if m in params and m != "lm_head.weight"]
    if missing or unexpected:
        sys.exit("generate_bench: weights did not map: missing %s, unexpected %s" %
                 (missing, unexpected))
    model.tie_weights()
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return model.to("cuda", dtype=torch_dtype).eval()


def hf_generate(model, ids, batch, new_tokens):
    import torch
    x = torch.tensor([ids] * batch, device="cuda")
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=50256)
    with torch.no_grad():
        model.generate(x, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = model(x, attention_mask=mask)  # the prefill alone, for the split
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        del y
        t0 = time.perf_counter()
        out = model.generate(x, **kw)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    assert out.shape[1] == len(ids) + new_tokens, out.shape
    return total, prefill, out[0, len(ids):].tolist()


STATS = re.compile(r"prefill (\d+) tokens in ([0-9.]+) s .*decode (\d+) tokens in (\d+) steps, "
                   r"([0-9.]+) s")


def troupe_generate(troupe, checkpoint, tokenizer, prompt, batch, new_tokens, dtype):
    cmd = [troupe, "generate", checkpoint, "--tokenizer", tokenizer, "--device", "cuda",
           "--dtype", dtype, "--temperature", "0", "--max-new-tokens", str(new_tokens),
           "--ignore-eos"]
    for _ in range(batch):
        cmd += ["--prompt", prompt]
    t0 = time.perf_counter()
    out = sh(cmd)
    wall = time.perf_counter() - t0
    m = STATS.search(out.stderr)
    if not m:
        sys.exit("generate_bench: no rates in troupe's stderr:\n" + out.stderr)
    prefill, decode = float(m.group(2)), float(m.group(5))
    return prefill + decode, prefill, decode, int(m.group(3)), wall, out.stdout



class Gpt2Vocab:
    """GPT-2's encoder.json read directly: token strings spell bytes through GPT-2's printable
    alphabet (bytes that print as themselves keep their character; the others map to 256 + n in
    order), so decoding needs no tokenizer library."""

    def __init__(self, folder):
        with open(os.path.join(folder, "encoder.json"), encoding="utf-8") as f:
            self.ids = json.load(f)
        self.strings = {i: s for s, i in self.ids.items()}
        printable = [b for b in range(256)
                     if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
        char_of = {b: chr(b) for b in printable}
        extra = 0
        for b in range(256):
            if b not in char_of:
                char_of[b] = chr(256 + extra)
                extra += 1
        self.byte_of = {c: b for b, c in char_of.items()}

    def id(self, token):
        return self.ids[token]

    def decode(self, ids):
        data = bytes(self.byte_of[c] for i in ids for c in self.strings[int(i)])
        return data.decode("utf-8", errors="replace")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--troupe", default="build-gpu/bin/troupe")
    ap.add_argument("--tokenizer", default="data/gpt2")
    ap.add_argument("--work", default="build-gpu/work/generate")
    ap.add_argument("--checkpoint", help="use this troupe GPT-2 124M checkpoint instead of "
                    "making one")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--out", help="append the JSON lines here too")
    a = ap.parse_args()
    troupe = os.path.abspath(a.troupe)
    tokenizer = os.path.abspath(a.tokenizer)
    for f in ("encoder.json", "vocab.bpe"):
        if not os.path.exists(os.path.join(tokenizer, f)):
            sys.exit("generate_bench: %s/%s missing (the GPT-2 vocabulary; scripts/setup.sh "
                     "fetches it into data/gpt2)" % (tokenizer, f))
    os.makedirs(a.work, exist_ok=True)
    checkpoint = a.checkpoint or make_checkpoint(troupe, os.path.abspath(a.work))

    tok = Gpt2Vocab(tokenizer)
    prompt = " the" * a.prompt_tokens  # " the" is one GPT-2 token: the prompt has exactly that many
    ids = [tok.id("\u0120the")] * a.prompt_tokens

    rows = []
    sink = open(a.out, "a") if a.out else None

    def emit(row):
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")

    for dtype in a.dtypes.split(","):
        model = hf_model(checkpoint, dtype)
        for batch in (int(b) for b in a.batches.split(",")):
            new = batch * a.new_tokens
            total, prefill, decode, decode_tokens, wall, text = troupe_generate(
                troupe, checkpoint, tokenizer, prompt, batch, a.new_tokens, dtype)
            emit({"engine": "troupe generate", "dtype": dtype, "batch": batch,
                  "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
                  "tokens_per_s": new / total, "decode_tokens_per_s": decode_tokens / decode,
                  "prefill_s": prefill, "generate_s": total, "process_s": wall})
            hf_total, hf_prefill, hf_ids = hf_generate(model, ids, batch, a.new_tokens)
            emit({"engine": "transformers generate", "dtype": dtype, "batch": batch,
                  "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
                  "tokens_per_s": new / hf_total,
                  "decode_tokens_per_s": batch * (a.new_tokens - 1) / (hf_total - hf_prefill),
                  "prefill_s": hf_prefill, "generate_s": hf_total})
            if dtype == "fp32" and batch == 1:
                hf_text = prompt + tok.decode(hf_ids)
                ours = text[:-1] if text.endswith("\n") else text
                same = ours == hf_text
                n = next((i for i, (x, y) in enumerate(zip(ours, hf_text)) if x != y),
                         min(len(ours), len(hf_text)))
                print("greedy text, fp32, batch 1: %s" % ("identical to transformers'" if same else
                      "differs from transformers' at character %d of %d" % (n, len(hf_text))),
                      flush=True)
        del model

    print("\n| engine | dtype | batch | tokens/s (prefill + decode) | decode tokens/s | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        base = next(x for x in rows if x["engine"] == "transformers generate" and
                    x["dtype"] == r["dtype"] and x["batch"] == r["batch"])
        print("| %s | %s | %d | %.0f | %.0f | %.2fx |" % (
            r["engine"], r["dtype"], r["batch"], r["tokens_per_s"], r["decode_tokens_per_s"],
            r["tokens_per_s"] / base["tokens_per_s"]))


if __name__ == "__main__":
    main()
