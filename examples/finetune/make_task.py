#!/usr/bin/env python3
"""Writes the fine-tuning example's task: count the words of a short list.

Each record is {"prompt": "Count: whale ship sea. Answer:", "response": " 3"}: one to six words,
the answer their number (one token). The words are the most frequent short lowercase words of the
corpus, so the pretrained model knows them as tokens; what it does not know is the task. Held-out
prompts use word lists that never occur in the training records, so a model that answers them
has learned to count, not to recall.

Usage: make_task.py CORPUS_DIR OUT_DIR [--train N] [--heldout N] [--seed S]
Writes OUT_DIR/train.jsonl and OUT_DIR/heldout.jsonl (one JSON object a line), and
OUT_DIR/heldout_prompts.jsonl: the held-out prompts as the plain template shows them to the model
(the prompt and a newline; docs/data.md), for `troupe generate --prompts`.
"""
import argparse
import collections
import json
import os
import random
import re
import sys


def corpus_words(root, limit_bytes=3_000_000):
    counts = collections.Counter()
    read = 0
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if not name.endswith(".txt"):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                text = f.read(limit_bytes - read)
            read += len(text)
            counts.update(re.findall(r"\b[a-z]{3,8}\b", text))
            if read >= limit_bytes:
                return counts
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus")
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--heldout", type=int, default=100)
    ap.add_argument("--words", type=int, default=300, help="vocabulary of the task")
    ap.add_argument("--max-count", type=int, default=6, help="the longest list")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    counts = corpus_words(a.corpus)
    if len(counts) < a.words:
        sys.exit(f"make_task: error: {a.corpus} holds only {len(counts)} distinct words; "
                 f"hint: run bash scripts/setup.sh (it fetches the corpus)")
    vocab = [w for w, _ in counts.most_common(a.words)]
    rng = random.Random(a.seed)

    def record(words):
        return {"prompt": f"Count: {' '.join(words)}. Answer:", "response": f" {len(words)}"}

    def draw():
        return tuple(rng.sample(vocab, rng.randint(1, a.max_count)))

    seen = set()
    heldout = []
    while len(heldout) < a.heldout:
        words = draw()
        if words not in seen:
            seen.add(words)
            heldout.append(record(words))
    train = []
    while len(train) < a.train:
        words = draw()
        if words not in seen:
            train.append(record(words))
    os.makedirs(a.out, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    with open(os.path.join(a.out, "heldout_prompts.jsonl"), "w", encoding="utf-8") as f:
        for r in heldout:
            f.write(json.dumps({"prompt": r["prompt"] + "\n"}) + "\n")
    print(f"make_task: {len(train)} training and {len(heldout)} held-out records over "
          f"{len(vocab)} words in {a.out}")


if __name__ == "__main__":
    main()
