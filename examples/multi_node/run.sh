#!/usr/bin/env bash
# Usage: examples/multi_node/run.sh [--small] [--steps N] [--build DIR] [--work DIR]
#
# One job over two "nodes" on this machine: two `troupe launch` processes (--node_rank 0 and 1, two
# workers each, meeting at a rendezvous on 127.0.0.1) run configs/tiny.toml's pipeline_stage 2 x
# data_parallel 2 layout as 4 worker processes. The same config trained by `troupe train` in one
# process gives the same losses and the same checkpoint bytes; the script exits 1 if not.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
parse_options "$@"
[ ${#extra_args[@]} = 0 ] || die "unknown option ${extra_args[0]} (try --help)"
prepare

echo "== one process: troupe train"
run "$troupe" train "$config" "${sets[@]}" --set runtime.run_dir="$work/one_process" | grep "final loss"

echo
echo "== two nodes on loopback: two troupe launch processes, 4 worker processes in all"
port="$(free_port)"
export TROUPE_JOB_TOKEN="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"  # the same on every node
node_args=(--worker_num 4 --local_worker_num 2 --master_addr 127.0.0.1 --master_port "$port"
           --log_dir "$work/logs" "$config" "${sets[@]}" --set runtime.run_dir="$work/two_nodes")
# Node 1 first, in the background: its workers wait for node 0's rendezvous.
show "$troupe" launch --node_rank 1 "${node_args[@]}" "&"
bounded "$troupe" launch --node_rank 1 "${node_args[@]}" > "$work/node1.out" 2>&1 &
node1=$!
status0=0
show "$troupe" launch --node_rank 0 "${node_args[@]}"
bounded "$troupe" launch --node_rank 0 "${node_args[@]}" > "$work/node0.out" 2>&1 || status0=$?
status1=0
wait "$node1" || status1=$?
echo "node 0 (exit $status0):"; grep -E "^troupe launch|^step|^done" "$work/node0.out" | sed 's/^/  /' | tail -n 4
echo "node 1 (exit $status1):"; grep -E "^troupe launch" "$work/node1.out" | sed 's/^/  /'
if [ "$status0" != 0 ] || [ "$status1" != 0 ]; then
  tail -n 20 "$work/node0.out" "$work/node1.out" >&2
  die "a launch failed (node 0: $status0, node 1: $status1); worker logs in ${work#$root/}/logs"
fi

echo
echo "== compare"
same_result "$work/one_process" "$work/two_nodes"
