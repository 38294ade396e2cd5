#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into fuzz/seeds/<target>/ (committed; scripts/fuzz.sh
reads it and never writes it).

Seeds are small valid inputs of each reader: the repository's own configs and schedule files, and
files of each other kind written here from their formats (docs/fuzzing.md). The output depends on
nothing but the repository, so running this again rewrites the same bytes.

Usage: python3 fuzz/make_seeds.py [OUT_DIR]   (default: fuzz/seeds next to this script)
"""
import json
import os
import shutil
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M64 = (1 << 64) - 1


def xxh64(data, seed=0):
    """XXH64 of `data` (the hash troupe records in checkpoint manifests)."""
    p1, p2, p3, p4, p5 = (11400714785074694791, 14029467366897019727, 1609587929392839161,
                          9650029242287828579, 2870177450012600261)

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & M64

    def rnd(acc, lane):
        return (rotl((acc + lane * p2) & M64, 31) * p1) & M64

    def merge(acc, v):
        return (((acc ^ rnd(0, v)) * p1) + p4) & M64

    def u64(i):
        return struct.unpack_from("<Q", data, i)[0]

    n, i = len(data), 0
    if n >= 32:
        v = [(seed + p1 + p2) & M64, (seed + p2) & M64, seed, (seed - p1) & M64]
        while i + 32 <= n:
            v = [rnd(v[k], u64(i + 8 * k)) for k in range(4)]
            i += 32
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M64
        for x in v:
            h = merge(h, x)
    else:
        h = (seed + p5) & M64
    h = (h + n) & M64
    while i + 8 <= n:
        h = ((rotl(h ^ rnd(0, u64(i)), 27) * p1) + p4) & M64
        i += 8
    if i + 4 <= n:
        h = ((rotl(h ^ ((struct.unpack_from("<I", data, i)[0] * p1) & M64), 23) * p2) + p3) & M64
        i += 4
    while i < n:
        h = (rotl(h ^ ((data[i] * p5) & M64), 11) * p1) & M64
        i += 1
    h ^= h >> 33
    h = (h * p2) & M64
    h ^= h >> 29
    h = (h * p3) & M64
    return h ^ (h >> 32)


def safetensors(tensors, metadata):
    """A safetensors file as model::safetensors::write lays it out: compact JSON header (metadata
    first, keys sorted; tensors in order), padded with spaces to 8 bytes, then the data."""
    header = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    data = b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def checkpoint_manifest(step, base=None):
    """manifest.json of the checkpoints fuzz/fuzz_checkpoint.cpp saves (its request(): same
    tensors, seed and config text), so that the seeds open there and the fuzzer starts from
    manifests that reach every check of model::checkpoint::reader::open."""
    ramp = lambda n, step_: struct.pack(f"<{n}f", *(step_ * i for i in range(n)))
    shards = [("model.safetensors", "model",
               [("wte.weight", "F32", [4, 2], ramp(8, 0.25)),
                ("ln_f.bias", "BF16", [2], struct.pack("<2H", 0x3F80, 0x4000))]),
              ("optimizer.safetensors", "optimizer",
               [("wte.weight.exp_avg", "F32", [4, 2], ramp(8, 0.5))])]
    files, tensors = [], {}
    for path, kind, ts in shards:
        raw = safetensors(ts, {"format": "pt", "troupe_kind": kind})
        files.append({"path": path, "kind": kind, "bytes": len(raw), "xxh64": f"{xxh64(raw):016x}"})
        for name, dtype, shape, data in ts:
            tensors[name] = {"file": path, "dtype": dtype, "shape": shape,
                             "xxh64": f"{xxh64(data):016x}"}
    m = {"format": "troupe-checkpoint", "version": 1, "step": step,
         "data_position": {"next_step": step}, "seed": 1234, "config": '[model]\narch = "gpt2"\n'}
    if base:
        m["base"] = base
    m["files"] = files
    m["tensors"] = tensors
    return json.dumps(m, indent=1, ensure_ascii=False) + "\n"


def token_hash(token):
    """transport::token_hash: FNV-1a 64 of a prefix and the job token."""
    h = 0xCBF29CE484222325
    for c in b"troupe job token:" + token.encode():
        h = ((h ^ c) * 0x100000001B3) & M64
    return h


def tcp_frame(ftype, src, dst, tag=(0, 0, 0, 0, 0), dtype=0, shape=(), payload=b""):
    """A tcp transport frame (transport/tcp_wire.hpp): the 128-byte header, then the payload."""
    dims = list(shape) + [0] * (8 - len(shape))
    step, kind, chunk, mb, part = tag
    head = struct.pack("<IHHQiiqIiiiBBHI8qQ", 0x54505254, 1, ftype, token_hash("fuzz"), src, dst,
                       step, kind, chunk, mb, part, dtype, len(shape), 0, 0, *dims, len(payload))
    assert len(head) == 128
    return head + payload


def bytes_field(s):
    s = s.encode() if isinstance(s, str) else s
    return struct.pack("<I", len(s)) + s


def rendezvous_frame(ftype, body):
    """A rendezvous frame (transport/rendezvous.hpp): the 12-byte header, then the body."""
    return struct.pack("<IHHI", 0x56525254, 1, ftype, len(body)) + body


def worker_row(node, local, host, port, blob):
    return struct.pack("<ii", node, local) + bytes_field(host) + struct.pack("<H", port) + bytes_field(blob)


def write(out, target, name, content):
    os.makedirs(os.path.join(out, target), exist_ok=True)
    mode = "wb" if isinstance(content, bytes) else "w"
    with open(os.path.join(out, target, name), mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
        f.write(content)


def read(rel):
    with open(os.path.join(ROOT, rel), "rb") as f:
        return f.read()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "fuzz", "seeds")
    shutil.rmtree(out, ignore_errors=True)

    # Configs: the repository's own.
    for rel in ("configs/tiny.toml", "configs/gpt2_124m.toml", "configs/llama_tiny.toml",
                "examples/small.toml"):
        write(out, "config", os.path.basename(rel), read(rel))

    # Schedule files: the first byte picks the reader (odd: CSV), the rest is the file.
    for rel in ("configs/schedules/1f1b_p2_m2_with_transfers.txt",
                "configs/schedules/1f1b_p2_m4_pytorch.csv",
                "configs/schedules/eager_1f1b_p4_m8.txt",
                "examples/custom_schedule/eager_1f1b_p2_m8.txt"):
        flag = b"\x01" if rel.endswith(".csv") else b"\x00"
        write(out, "schedule", os.path.basename(rel), flag + read(rel))

    # Instruction records: both forms, one as examples/finetune/make_task.py writes them.
    write(out, "instruct", "prompt.jsonl", '{"prompt": "Count: whale ship sea. Answer:", "response": " 3"}')
    write(out, "instruct", "chat.jsonl",
          '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},'
          ' {"role": "assistant", "content": "4"}]}')

    write(out, "safetensors", "two.safetensors", safetensors(
        [("w", "F32", [2, 3], struct.pack("<6f", *range(6))), ("b", "BF16", [2], b"\x80\x3f\x00\x40")],
        {"format": "pt"}))

    # A byte-level BPE tokenizer.json: GPT-2's byte alphabet, two merges and one added token.
    vocab, extra = {}, 0
    for b in range(256):
        printable = 33 <= b <= 126 or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
        vocab[chr(b) if printable else chr(256 + extra)] = b
        extra += not printable
    vocab.update({"ab": 256, "abc": 257})
    tok = {"added_tokens": [{"id": 258, "content": "<|endoftext|>", "special": True, "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False}],
           "normalizer": None, "post_processor": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
           "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]}}
    write(out, "tokenizer_json", "small.json", json.dumps(tok))

    # Token shards in llm.c's format: version 1 (uint16 tokens) and troupe's uint32 version 7.
    for magic, version, fmt in ((20240520, 1, "H"), (20240801, 7, "I")):
        header = struct.pack("<256i", magic, version, 8, *([0] * 253))
        write(out, "shard", f"{magic}.bin", header + struct.pack("<8" + fmt, *range(8)))

    write(out, "checkpoint", "step_2.json", checkpoint_manifest(2))
    write(out, "checkpoint", "step_1.json", checkpoint_manifest(1))
    write(out, "checkpoint", "lora.json",
          checkpoint_manifest(2, {"source": "base/model.safetensors", "xxh64": "0123456789abcdef"}))

    # A connection's frames: hello, an f32 and a bf16 tensor, bye; and one tensor alone.
    f32 = tcp_frame(2, 1, 0, (3, 1, 0, 2, 0), 0, (2, 3), struct.pack("<6f", *range(6)))
    write(out, "tcp_frame", "connection.bin",
          tcp_frame(1, 1, 0) + f32 + tcp_frame(2, 1, 0, (3, 2, 1, 0, 1), 1, (4,), b"\x80\x3f" * 4) +
          tcp_frame(3, 1, 0))
    write(out, "tcp_frame", "tensor.bin", f32)

    # What a server hears (registration, ready) and what a worker hears (table, start, reject,
    # abort) from a rendezvous of two workers on two nodes.
    reg = struct.pack("<Q", token_hash("fuzz")) + worker_row(1, 0, "10.0.0.2", 29501, b"nccl-id")
    write(out, "rendezvous", "server.bin", rendezvous_frame(1, reg) + rendezvous_frame(3, b""))
    table = struct.pack("<ii", 1, 2) + worker_row(0, 0, "10.0.0.1", 29500, b"") + \
        worker_row(1, 0, "10.0.0.2", 29501, b"nccl-id")
    write(out, "rendezvous", "worker.bin", rendezvous_frame(2, table) + rendezvous_frame(4, b""))
    write(out, "rendezvous", "reject.bin", rendezvous_frame(5, bytes_field("wrong job token")))
    write(out, "rendezvous", "abort.bin", rendezvous_frame(6, bytes_field("rank 1 left the rendezvous")))

    # Text for GPT-2's tokenizer: the README's opening, the pre-tokenizer's cases (contractions,
    # digits, spaces, the special token as plain text), non-ASCII and ill-formed UTF-8.
    write(out, "tokenizer", "readme.txt", read("README.md")[:600])
    write(out, "tokenizer", "cases.txt",
          "I'll say it's 12345 dollars,  don't   you?\n\n\t<|endoftext|>The END...!!")
    write(out, "tokenizer", "unicode.txt", "naïve café — Ünïcödé ✓ 日本語 😀 \u00a0x\u2581y")
    write(out, "tokenizer", "bytes.bin", b"ok \xff\xfe \xc3( \xe2\x82 \xf0\x9f\x98 \xed\xa0\x80 end\x00")


if __name__ == "__main__":
    main()
