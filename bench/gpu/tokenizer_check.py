#!/usr/bin/env python3
"""troupe's tokenizers against Hugging Face's `tokenizers` library, id for id.

Both load the same tokenizer.json files (data/gpt2, data/llama2, data/llama3, written by
scripts/setup.sh) and encode the same texts: crafted text (CJK, emoji, combining marks, whitespace
runs, digits, contractions, special tokens written in the text) and slices of the corpus in
data/raw. Compared: `Tokenizer.encode(text, add_special_tokens=False).ids` with
`troupe tokenize` (special tokens matched), `add_special_tokens=True` with `troupe tokenize --bos`,
and troupe's decode round trip. Prints one line per text and a closing "N passed, M failed";
exits 1 on any difference. Needs no GPU: it runs where `tokenizers` is installed.

Usage, from the repository root:
  python3 bench/gpu/tokenizer_check.py [PKG] [--data DIR] [--corpus-files N]
PKG is the package folder of bench/gpu/pack.sh (default build-gpu: PKG/bin/troupe with PKG/lib on
the loader path; PKG/package.tar.xz is unpacked first when newer) or a build folder holding
troupe.
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile

CRAFTED = [
    "Hello world, this is a test.",
    "CJK: 我们今天去公园散步。東京は晴れです。서울의 날씨는 맑습니다.",
    "Emoji: 👋🌍 🧑‍🚀 family 👨‍👩‍👧‍👦 flags 🇫🇮🇯🇵 and ❤️‍🔥!!",
    "Combining marks: e\u0301 a\u0308 n\u0303 \u0915\u093f \u05e9\u05c1\u05b8 Z\u0351\u0352\u0353",
    "Whitespace runs:  two   three    four\t\ttabs\n\nnewlines\r\n\r\nCRLF \n  \n   end   ",
    "   leading spaces and trailing spaces      ",
    "Digits: 1 12 123 1234 12345 3.14159 1,000,000 2026-12-01 0x1F ١٢٣ ５６",
    "Contractions: I'm you're he's we've they'll she'd can't IT'S I'M YOU'RE O'Neil 'quoted'",
    "Punctuation: ...!!! ??? --- ___ *** ### $$$ %%% &&& ((( ))) [] {} <> /\\ ~~ ``",
    "Mixed: naïve café résumé Ærøskøbing straße ǅungla İstanbul ΑΒΓ αβγ Жжж",
    "Code: for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n\tif (x != y) return -1;",
    "Rare: \U0001F9EA\U00010348\U0001D11E \u00a0nbsp\u00a0 \u3000ideographic\u3000space",
]
SPECIALS = {
    "gpt2": ["a<|endoftext|>b", "<|endoftext|> starts and ends <|endoftext|>"],
    "llama2": ["<s>Hello</s> world", "a <s> b </s>c <unk> d"],
    "llama3": [
        "<|begin_of_text|>Hello<|eot_id|>",
        "a <|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|><|start_header_id|>assistant",
        "reserved <|reserved_special_token_5|> and <|reserved_special_token_247|>, not <|fake|>",
    ],
}


def troupe_binary(pkg):
    tarball = os.path.join(pkg, "package.tar.xz")
    binary = os.path.join(pkg, "bin", "troupe")
    if os.path.isfile(tarball) and (not os.path.isfile(binary) or
                                    os.path.getmtime(tarball) > os.path.getmtime(binary)):
        with tarfile.open(tarball) as t:
            t.extractall(pkg)
    for candidate in (binary, os.path.join(pkg, "troupe")):
        if os.path.isfile(candidate):
            return candidate
    sys.exit(f"tokenizer_check: no troupe in {pkg} (expected bin/troupe, package.tar.xz or troupe)")


def troupe_ids(binary, env, tokenizer, texts, bos, tmp):
    files = []
    for i, t in enumerate(texts):
        path = os.path.join(tmp, f"{os.path.basename(os.path.dirname(tokenizer))}_{i}.txt")
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(t)
        files.append(path)
    cmd = [binary, "tokenize", "--tokenizer", tokenizer] + (["--bos"] if bos else []) + files
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line) for line in out.splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pkg", nargs="?", default="build-gpu")
    ap.add_argument("--data", default="data")
    ap.add_argument("--corpus-files", type=int, default=6)
    args = ap.parse_args()
    try:
        from tokenizers import Tokenizer, __version__ as hf_version
    except ImportError:
        sys.exit("tokenizer_check: the Hugging Face `tokenizers` package is needed (pip install tokenizers)")

    binary = troupe_binary(args.pkg)
    env = dict(os.environ)
    lib = os.path.join(args.pkg, "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = os.path.abspath(lib) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")

    corpus = []
    moby = os.path.join(args.data, "raw", "moby-dick", "data", "data.txt")
    sotu = os.path.join(args.data, "raw", "sotu", "data")
    sources = [moby] if os.path.isfile(moby) else []
    if os.path.isdir(sotu):
        names = sorted(n for n in os.listdir(sotu) if n.endswith(".txt"))
        step = max(1, len(names) // max(1, args.corpus_files - 1))
        sources += [os.path.join(sotu, n) for n in names[::step]][: max(0, args.corpus_files - 1)]
    for s in sources:
        with open(s, encoding="utf-8") as f:
            corpus.append(f.read()[:60000])
    print(f"tokenizers {hf_version}; troupe {binary}; {len(CRAFTED)} crafted texts, "
          f"{len(corpus)} corpus slices")

    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("gpt2", "llama2", "llama3"):
            path = os.path.join(args.data, name, "tokenizer.json")
            if not os.path.isfile(path):
                print(f"FAIL {name}: {path} is missing (run scripts/setup.sh and carry data/{name})")
                failed += 1
                continue
            hf = Tokenizer.from_file(path)
            texts = CRAFTED + SPECIALS[name] + corpus
            for bos in (False, True):
                mine = troupe_ids(binary, env, path, texts, bos, tmp)
                for i, text in enumerate(texts):
                    want = hf.encode(text, add_special_tokens=bos).ids
                    got = mine[i]["ids"]
                    label = f"{name} {'+bos ' if bos else ''}#{i} ({len(text)} chars, {len(want)} tokens)"
                    if got != want:
                        at = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]),
                                  min(len(got), len(want)))
                        print(f"FAIL {label}: first difference at {at}: troupe {got[max(0, at - 3):at + 5]} "
                              f"vs tokenizers {want[max(0, at - 3):at + 5]}; text {text[:60]!r}")
                        failed += 1
                    elif not bos and i < len(CRAFTED) and not mine[i]["round_trip"]:
                        print(f"FAIL {label}: decoding troupe's ids does not give back the text")
                        failed += 1
                    else:
                        passed += 1
            print(f"{name}: {hf.get_vocab_size()} ids checked on {len(texts)} texts, with and without BOS")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed or not passed else 0)


if __name__ == "__main__":
    main()
