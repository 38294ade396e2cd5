#!/usr/bin/env python3
"""Where a training step's GPU time goes, from Nsight Compute's CSV: the kernels of the last step
grouped by what they do (GEMMs, attention, LayerNorm, AdamW, ...), with their count, time, share
of the step, the bytes they moved to and from device memory and the rate at which they moved them.
A markdown table on stdout; with --json, also one JSON line per group.

    ncu --clock-control none --cache-control none --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        gpu_gpt2_bench --no-graph --warmup 1 --steps 1 > step.csv
    python3 bench/ncu_kernels.py step.csv [--json]

The last step starts at the last launch of the embedding's forward kernel (every step of
gpu_gpt2_bench and troupe begins with it); --from-kernel names another kernel that starts a step.
Without the dram metrics the bytes columns are left empty.
"""
import argparse
import collections
import csv
import json
import re
import sys

# (group, pattern on the kernel's name), first match wins; the order is the table's fallback order.
GROUPS = [
    ("GEMMs (cuBLASLt)", r"nvjet|xmma|gemm|cutlass"),
    ("cuBLASLt split-K reductions", r"splitKreduce"),
    ("attention backward", r"attn_backward|attention_backward"),
    ("attention forward", r"attn_forward|attention_forward"),
    ("attention Δ (rows of dO·O)", r"attn_delta"),
    ("LayerNorm backward", r"layernorm_backward"),
    ("LayerNorm weight-gradient finish", r"layernorm_param_finish"),
    ("LayerNorm forward", r"layernorm_forward"),
    ("RMSNorm", r"rmsnorm"),
    ("AdamW", r"adamw"),
    ("cross-entropy", r"cross_entropy"),
    ("column sums (bias gradients): partial", r"column_partial"),
    ("column sums (bias gradients): finish", r"column_finish"),
    ("GELU", r"gelu"),
    ("SwiGLU", r"swiglu"),
    ("RoPE", r"rope"),
    ("elementwise (adds, copies, scaling)", r"elementwise_kernel|copy|fill"),
    ("the clip: norm blocks, exact sum, factor", r"sumsq|exact_sum|clip_factor"),
    ("message hash", r"hash"),
    ("embedding and the token sort", r"embedding|RadixSort|iota"),
]


def group_of(name):
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def read_kernels(path):
    """{id: {'name':..., metric: value}} in launch order, from ncu's --csv output."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    if not lines:
        sys.exit(f"ncu_kernels: {path} has no CSV rows (was ncu run with --csv?)")
    kernels = collections.OrderedDict()
    for row in csv.DictReader(lines):
        try:
            k = kernels.setdefault(int(row["ID"]), {"name": row["Kernel Name"]})
            k[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError) as e:
            sys.exit(f"ncu_kernels: {path}: unexpected row {row} ({e})")
    return kernels


def last_step(kernels, starter):
    starts = [i for i, k in kernels.items() if re.search(starter, k["name"])]
    if not starts:
        sys.exit(f"ncu_kernels: no kernel matches --from-kernel {starter!r}; name one that starts "
                 "each step")
    return [kernels[i] for i in kernels if i >= starts[-1]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --csv output with gpu__time_duration.sum (and dram__bytes_*)")
    ap.add_argument("--from-kernel", default=r"embedding_forward_kernel",
                    help="regular expression of the kernel that starts a step")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per group")
    args = ap.parse_args()
    step = last_step(read_kernels(args.csv), args.from_kernel)
    groups = collections.defaultdict(lambda: {"count": 0, "ms": 0.0, "bytes": 0.0})
    has_bytes = all("dram__bytes_read.sum" in k for k in step)
    for k in step:
        if "gpu__time_duration.sum" not in k:
            sys.exit("ncu_kernels: the CSV has no gpu__time_duration.sum; add it to --metrics")
        g = groups[group_of(k["name"])]
        g["count"] += 1
        g["ms"] += k["gpu__time_duration.sum"] * 1e-6  # ns
        if has_bytes:
            g["bytes"] += k["dram__bytes_read.sum"] + k.get("dram__bytes_write.sum", 0.0)
    total = sum(g["ms"] for g in groups.values())
    print(f"{len(step)} kernels in the last step, {total:.2f} ms")
    print()
    print("| kernels | count | ms | share | GB moved | TB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, g in sorted(groups.items(), key=lambda item: -item[1]["ms"]):
        gb = f"{g['bytes'] * 1e-9:.2f}" if has_bytes else ""
        rate = f"{g['bytes'] / (g['ms'] * 1e-3) * 1e-12:.2f}" if has_bytes and g["ms"] else ""
        print(f"| {name} | {g['count']} | {g['ms']:.3f} | {100 * g['ms'] / total:.1f} % | {gb} | "
              f"{rate} |")
    if args.json:
        for name, g in groups.items():
            print(json.dumps({"group": name, "count": g["count"], "ms": round(g["ms"], 4),
                              "bytes": g["bytes"] if has_bytes else None}))


if __name__ == "__main__":
    main()
