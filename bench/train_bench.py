#!/usr/bin/env python3
"""Benchmarks of the product: runs `troupe train` (actors), `troupe train --single-rank` or
`troupe launch` on a config and reports what the run itself measured, from its metrics.jsonl:
median step time, tokens/s, model TFLOP/s (6N + 12·L·C·T FLOPs per token, the PaLM-style count
bench/torch_gpt2.py uses) and peak device memory. One JSON line per run on stdout (and appended
to --out), then a table row on stderr.

    python3 bench/train_bench.py run --troupe build/troupe CONFIG [--set k=v]... \\
        [--mode train|single-rank|launch] [--workers N] [--steps 30] [--skip 3] [--label NAME]
    python3 bench/train_bench.py data DIR [--tokens N] [--vocab V]   # random-token shards
    python3 bench/train_bench.py table RESULTS.jsonl [--baseline LABEL]

Steps before --skip (the first fills the allocator and picks GEMMs; the second is recorded as a
CUDA graph by the single-rank loop) are left out of the median. The PyTorch baseline
(bench/torch_gpt2.py) prints the same fields; `table` prints every run with its ratio of tokens/s
to the baseline's.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile


def config_check(troupe, config, sets):
    cmd = [troupe, "config", "check", config, "--json", "--no-file-check"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("train_bench: troupe config check failed:\n" + out.stdout + out.stderr)
    return json.loads(out.stdout)


def read_metrics(path):
    lines = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                lines.append(json.loads(line))
    return lines


def peak_bytes(line):
    """Peak device memory of a step: the single-rank loop's own field, or the actor runtime's
    stages plus their optimizer shards (each has its own allocator on the device)."""
    if "peak_device_bytes" in line:
        return line["peak_device_bytes"]
    total = 0
    for st in line.get("stages", []):
        total += st.get("peak_device_bytes", 0) + st.get("optimizer_peak_device_bytes", 0)
    return total


def cmd_run(a):
    sets = list(a.set)
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="troupe_bench_")
    sets += ["runtime.run_dir=" + run_dir, "train.steps=%d" % a.steps,
             "checkpoint.interval=0", "train.eval_interval=0"]
    info = config_check(a.troupe, a.config, sets)
    cfg, derived = info["config"], info["derived"]
    model = cfg["model"]
    if a.mode == "launch":
        cmd = [a.troupe, "launch", "--worker_num", str(a.workers or derived["workers"]),
               "--log_dir", os.path.join(run_dir, "logs"), a.config]
    else:
        cmd = [a.troupe, "train", a.config]
        if a.mode == "single-rank":
            cmd.append("--single-rank")
    for s in sets:
        cmd += ["--set", s]
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        os.remove(os.path.join(run_dir, "metrics.jsonl"))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit("train_bench: %s failed (exit %d):\n%s%s" %
                 (" ".join(cmd), proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:]))
    lines = [m for m in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if m["step"] >= a.skip]
    if not lines:
        sys.exit("train_bench: no steps after --skip %d in %s" % (a.skip, run_dir))
    tokens = derived["tokens_per_step"]
    steps_s = sorted(tokens / m["tokens_per_s"] for m in lines)
    med = statistics.median(steps_s)
    n_params = derived["parameters"]
    flops_tok = 6 * n_params + 12 * model["num_layers"] * model["hidden_size"] * model["seq_length"]
    res = {
        "label": a.label or a.mode,
        "mode": a.mode,
        "config": a.config,
        "sets": a.set,
        "params": n_params,
        "tokens_per_step": tokens,
        "steps_measured": len(lines),
        "step_ms": round(med * 1e3, 2),
        "step_ms_min": round(steps_s[0] * 1e3, 2),
        "step_ms_max": round(steps_s[-1] * 1e3, 2),
        "tok_s": round(tokens / med),
        "tflops": round(flops_tok * tokens / med / 1e12, 1),
        "peak_gib": round(max(peak_bytes(m) for m in lines) / 2**30, 2),
        "loss": lines[-1]["loss"],
    }
    emit(res, a.out)
    if not a.run_dir and not a.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


def emit(res, out):
    line = json.dumps(res)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    print("%-28s %9.2f ms %10d tok/s %7.1f TFLOP/s %7.2f GiB" %
          (res["label"], res["step_ms"], res["tok_s"], res["tflops"], res["peak_gib"]),
          file=sys.stderr, flush=True)


def cmd_data(a):
    """Two shards of random tokens (llm.c format: 256 int32 header, then uint16 tokens, or uint32
    tokens past 65,536 ids: docs/data.md)."""
    os.makedirs(a.dir, exist_ok=True)
    rng = random.Random(a.seed)
    wide = a.vocab > 65536
    for name, n in (("train.bin", a.tokens), ("val.bin", max(a.tokens // 10, 4096))):
        header = [0] * 256
        header[0], header[1], header[2] = (20240801, 7, n) if wide else (20240520, 1, n)
        toks = [rng.randrange(a.vocab) for _ in range(n)]
        with open(os.path.join(a.dir, name), "wb") as f:
            f.write(struct.pack("<256i", *header))
            f.write(struct.pack("<%d%s" % (n, "I" if wide else "H"), *toks))
    print(os.path.join(a.dir, "train.bin"))


def cmd_table(a):
    rows = []
    for path in a.results:
        rows += read_metrics(path)
    base = None
    if a.baseline:
        for r in rows:
            if r.get("label", r.get("tag")) == a.baseline:
                base = r
    print("| run | step (ms) | tokens/s | TFLOP/s | peak GiB | vs %s |" % (a.baseline or "-"))
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        label = r.get("label") or r.get("tag")
        ratio = "%.3f" % (r["tok_s"] / base["tok_s"]) if base else "-"
        print("| %s | %.2f | %d | %.1f | %.2f | %s |" %
              (label, r["step_ms"], r["tok_s"], r["tflops"], r["peak_gib"], ratio))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run troupe on a config and report its metrics")
    r.add_argument("config")
    r.add_argument("--troupe", default="build/troupe")
    r.add_argument("--set", action="append", default=[], help="config override k=v (repeatable)")
    r.add_argument("--mode", choices=["train", "single-rank", "launch"], default="train")
    r.add_argument("--workers", type=int, default=0, help="launch: worker processes (default: the layout's)")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--skip", type=int, default=3, help="leading steps left out of the median")
    r.add_argument("--label", default="")
    r.add_argument("--run-dir", default="", help="keep the run here (default: a temporary folder)")
    r.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    r.add_argument("--out", default="", help="append the JSON line to this file")
    r.set_defaults(fn=cmd_run)
    d = sub.add_parser("data", help="write random-token shards train.bin and val.bin")
    d.add_argument("dir")
    d.add_argument("--tokens", type=int, default=1 << 20)
    d.add_argument("--vocab", type=int, default=50257)
    d.add_argument("--seed", type=int, default=1)
    d.set_defaults(fn=cmd_data)
    t = sub.add_parser("table", help="a markdown table of JSON result lines")
    t.add_argument("results", nargs="+")
    t.add_argument("--baseline", default="")
    t.set_defaults(fn=cmd_table)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
