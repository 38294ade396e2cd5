#!/usr/bin/env bash
# Repository hygiene: the tracked files describe the product, not how it was developed. Fails,
# naming file:line, on development-diary wording ("session 3", "this session", "device call"),
# on absolute paths of a developer's machine, and on references to documents that are not in the
# repository (the architecture and the rules are docs/design.md). Run by ctest as `repo_hygiene`.
# Usage: tests/repo/hygiene.sh [REPOSITORY_ROOT]   (default: the repository holding this script)
set -euo pipefail
root="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
cd "$root"
self="tests/repo/hygiene.sh"

# Case-insensitive wording of a development diary.
wording='session [0-9]|this session|device call|H200 call|device tool|we tried|borrowed machine|(^|[^a-z])lent([^a-z]|$)|house rule|style rule'
# Case-sensitive: machine paths and documents outside the repository.
paths='(^|[[:space:]"'"'"'`(=:])/(work|root|home)/|\.\./shared|shared/bench|DESIGN\.md|STYLE\.md|ENV\.md'

# The files to check: what git tracks, or, outside a git work tree (an exported source tree),
# every file except build outputs, data and version-control folders.
list_files() {
  if command -v git >/dev/null 2>&1 && git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z
  else
    find . -type d \( -name .git -o -name 'build*' -o -name data -o -name runs -o -name .cache \) \
      -prune -o -type f -print0 | sed -z 's|^\./||'
  fi
}

hits="$(mktemp)"
trap 'rm -f "$hits"' EXIT
list_files | grep -z -v -x -F "$self" | {
  # -I skips binary files; a file listed by git but deleted in the work tree is skipped.
  xargs -0 -r grep -I -n -H -i -E -- "$wording" 2>/dev/null || true
} >>"$hits"
list_files | grep -z -v -x -F "$self" | {
  xargs -0 -r grep -I -n -H -E -- "$paths" 2>/dev/null || true
} >>"$hits"

checked="$(list_files | grep -z -c -v -x -F "$self" || true)"
if [[ "$checked" -lt 10 ]]; then
  echo "hygiene: only $checked files found under $root; is this the repository?" >&2
  exit 2
fi
if [[ -s "$hits" ]]; then
  sort -u "$hits" | sed 's/^/hygiene: /' >&2
  echo "hygiene: $(sort -u "$hits" | wc -l) line(s) above read as a development diary, a machine path or a" \
       "reference outside the repository; describe the product as it is (docs/design.md, rule 12)" >&2
  exit 1
fi
echo "hygiene: $checked files checked, no diary wording, machine paths or outside references"
