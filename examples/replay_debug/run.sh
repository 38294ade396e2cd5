#!/usr/bin/env bash
# Usage: examples/replay_debug/run.sh [--small] [--steps N (default 3)] [--build DIR] [--work DIR]
#                                     [--perturb RANK:STEP:INSTRUCTION]
#
# Deterministic replay finding a faulty worker. A 4-process `troupe launch` of configs/tiny.toml
# (pipeline_stage 2 x data_parallel 2) runs with one worker perturbed: TROUPE_PERTURB_SEND (a
# test-only switch of `troupe worker`, docs/replay.md) makes worker 3 flip one bit of the gradient
# it sends back for micro-batch 2 at step 1 (--perturb picks another message). Every worker logs
# the hash of every tensor it sends. Then:
#   - `troupe replay --until-step 0` re-runs the job in one process: step 0 matches bit for bit;
#   - `troupe replay` names the first message that differs: the perturbed one, by rank, step,
#     micro-batch and instruction;
#   - `troupe replay --rank 3` replays worker 3 alone on its recorded inputs and finds the same
#     message, so the fault lies in worker 3 itself; `--rank 2`, the receiver, matches.
# The script exits 1 unless each verdict is the expected one.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
perturb="3:1:1SEND_B2->0"
# The run stores every tensor a worker receives (for --rank): 300 MB over 3 steps at --small, more
# on configs/tiny.toml, so 3 steps unless --steps says otherwise.
default_steps=3
parse_options "$@"
set -- "${extra_args[@]+"${extra_args[@]}"}"
while [ $# -gt 0 ]; do
  case "$1" in
    --perturb) perturb="$2"; shift ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
  shift
done
IFS=: read -r p_rank p_step p_op <<< "$perturb"
[ "$p_step" -lt "$steps" ] || die "--perturb's step $p_step is not below --steps $steps"
prepare
run_dir="$work/perturbed"

echo "== a launched run with worker $p_rank perturbed"
port="$(free_port)"
show env TROUPE_PERTURB_SEND="$perturb" "$troupe" launch --master_port "$port" "$config" \
  "${sets[@]}" --set runtime.record_tensors=true --set "runtime.run_dir=$run_dir"
status=0
TROUPE_PERTURB_SEND="$perturb" bounded "$troupe" launch --master_port "$port" "$config" \
  "${sets[@]}" --set runtime.record_tensors=true --set "runtime.run_dir=$run_dir" \
  > "$work/launch.out" 2>&1 || status=$?
grep -E "^troupe launch: (node|all)|^step|^done" "$work/launch.out" | cut -c1-150
[ "$status" = 0 ] || { tail -n 30 "$work/launch.out" >&2; die "the launch failed (exit $status)"; }
grep -h "TROUPE_PERTURB_SEND" "$run_dir"/logs/worker_*.log ||
  die "no worker reports the perturbation $perturb"

expect_match() {  # replay output file, exit status
  if [ "$2" != 0 ] || ! grep -q "matched the recorded run bit for bit" "$1"; then
    cat "$1" >&2
    die "expected the replay to match bit for bit (it exited $2)"
  fi
}
# The perturbed message as replay describes it: "at rank R, step S, micro-batch M, instruction I".
want="at rank $p_rank, step $p_step, micro-batch "
if [[ "$p_op" =~ SEND_[FB]([0-9]+)- ]]; then want+="${BASH_REMATCH[1]}"; fi
expect_difference() {  # replay output file, exit status
  if [ "$2" != 1 ] || ! grep -qF "$want" "$1" || ! grep -qF ", instruction $p_op (" "$1"; then
    cat "$1" >&2
    die "expected the replay to exit 1 naming rank $p_rank, step $p_step, instruction $p_op" \
        "(it exited $2)"
  fi
}
replay() {  # name, replay options...
  local name="$1" code=0
  shift
  run "$troupe" replay "$run_dir" "$@" --quiet > "$work/$name.out" 2>&1 || code=$?
  sed 's/^/  /' "$work/$name.out"
  return "$code"
}

if [ "$p_step" -gt 0 ]; then
  echo
  echo "== replay up to step $((p_step - 1)), before the perturbation: bit for bit"
  code=0; replay before --until-step $((p_step - 1)) || code=$?
  expect_match "$work/before.out" "$code"
fi

echo
echo "== replay the whole run in one process: the first differing message"
code=0; replay whole || code=$?
expect_difference "$work/whole.out" "$code"

# The receiver of the perturbed message: "... on rank D, ..." in the verdict.
receiver="$(sed -n 's/.* on rank \([0-9]*\),.*/\1/p' "$work/whole.out" | head -n 1)"
echo
echo "== replay worker $p_rank alone, on the inputs it received: the difference is its own"
code=0; replay sender --rank "$p_rank" || code=$?
expect_difference "$work/sender.out" "$code"
if [ -n "$receiver" ] && [ "$receiver" != "$p_rank" ]; then
  echo
  echo "== replay worker $receiver alone, the receiver, on the (perturbed) bytes it received: bit for bit"
  code=0; replay receiver --rank "$receiver" || code=$?
  expect_match "$work/receiver.out" "$code"
fi
echo
echo "replay named the perturbed message: rank $p_rank, step $p_step, instruction $p_op"
