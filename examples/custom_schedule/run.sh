#!/usr/bin/env bash
# Usage: examples/custom_schedule/run.sh [--small] [--steps N] [--build DIR] [--work DIR]
#
# Two custom pipeline schedules, each trained end to end and compared with the built-in 1F1B:
#   - eager_1f1b_p2_m8.txt, a schedule file written by hand;
#   - 2f2b, a generator in a C++ plugin (kfkb_plugin.cpp, built by CMake as
#     build/examples/custom_schedule/libkfkb_schedule.so).
# The job is configs/tiny.toml's model on pipeline_stage 2 (data_parallel 1) with 8 micro-batches
# per step. Pipelining changes where arithmetic runs, never what it is: all three runs give the same
# losses and checkpoint bytes; the script exits 1 if not. It also draws each schedule as SVG and
# checks that the plugin's 1f1b_as_kfkb (kFkB with k = 1) is the built-in 1f1b instruction for
# instruction.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
parse_options "$@"
[ ${#extra_args[@]} = 0 ] || die "unknown option ${extra_args[0]} (try --help)"
here=examples/custom_schedule
file="$here/eager_1f1b_p2_m8.txt"
plugin="$build/examples/custom_schedule/libkfkb_schedule.so"
[ -f "$plugin" ] || die "$plugin does not exist" "build it: cmake --build build --target kfkb_schedule"
prepare
sets+=(--set parallel.pipeline_stage=2 --set parallel.data_parallel=1 --set parallel.micro_batch_num=8)

echo "== the schedules"
run "$troupe" schedule check -s "$file"
run "$troupe" schedule show -s "$plugin:2f2b" -p 2 -m 8
run "$troupe" schedule show -s "$file" -p 2 -m 8 --costs 1,2,1,0.5 --svg "$work/eager_1f1b_p2_m8.svg" >/dev/null
run "$troupe" schedule show -s "$plugin:2f2b" -p 2 -m 8 --costs 1,2,1,0.5 --svg "$work/2f2b_p2_m8.svg" >/dev/null
run "$troupe" schedule show -s 1f1b -p 2 -m 8 --costs 1,2,1,0.5 --svg "$work/1f1b_p2_m8.svg" >/dev/null
echo "(SVGs in ${work#$root/})"
for s in 1f1b "$file" "$plugin:2f2b"; do
  bounded "$troupe" schedule simulate -s "$s" -p 2 -m 8 --costs 1,2,1,0.5 |
    sed -n "s|^|  ${s##*/}: |; /makespan/p"
done
# kFkB with k = 1 is 1F1B: the plugin's generator must produce the built-in's lists exactly.
bounded "$troupe" schedule show -s 1f1b -p 4 -m 8 --write "$work/builtin_1f1b.txt" >/dev/null
bounded "$troupe" schedule show -s "$plugin:1f1b_as_kfkb" -p 4 -m 8 --write "$work/kfkb1.txt" >/dev/null
if ! diff <(grep -v '^#' "$work/builtin_1f1b.txt") <(grep -v '^#' "$work/kfkb1.txt") >&2; then
  die "the plugin's 1f1b_as_kfkb differs from the built-in 1f1b (p 4, m 8)"
fi
echo "1f1b_as_kfkb (the plugin's kFkB, k = 1) equals the built-in 1f1b for p 4, m 8"

for s in 1f1b file plugin; do
  echo
  case "$s" in
    1f1b) echo "== built-in 1F1B"; pick=(--set schedule.name=1f1b) ;;
    file) echo "== the schedule file"; pick=(--set "schedule.file=$file") ;;
    plugin) echo "== the plugin's 2f2b"; pick=(--set "schedule.name=$plugin:2f2b") ;;
  esac
  run "$troupe" train "$config" "${sets[@]}" "${pick[@]}" --set "runtime.run_dir=$work/$s" |
    grep -E "^troupe:|^done.*final loss" | cut -c1-150
done

echo
echo "== compare"
same_result "$work/1f1b" "$work/file"
same_result "$work/1f1b" "$work/plugin"
