#!/usr/bin/env python3
"""Scores `troupe generate` output against held-out records: how many continuations are exactly
the expected answer (the text up to the end-of-text token, which ends the line).

Usage: score.py HELDOUT.jsonl GENERATED.txt
`troupe generate` writes each prompt, its continuation and a newline, in prompt order; the
prompts are known, so each continuation is the text between its prompt and the next one.
Prints "CORRECT TOTAL".
"""
import json
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    records = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8") if line.strip()]
    out = open(sys.argv[2], encoding="utf-8").read()
    pos = 0
    correct = 0
    for r in records:
        r["prompt"] += "\n"  # the plain template: the prompt's turn ends with a newline
    for i, r in enumerate(records):
        if not out.startswith(r["prompt"], pos):
            sys.exit(f"score: the output does not continue with prompt {i + 1} at character {pos}")
        start = pos + len(r["prompt"])
        if i + 1 < len(records):
            end = out.find("\n" + records[i + 1]["prompt"], start)
            if end < 0:
                sys.exit(f"score: prompt {i + 2} not found in the output")
        else:
            end = len(out) - 1 if out.endswith("\n") else len(out)
        if out[start:end] == r["response"]:
            correct += 1
        pos = end + 1
    print(correct, len(records))


if __name__ == "__main__":
    main()
