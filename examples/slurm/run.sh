#!/usr/bin/env bash
# Usage: examples/slurm/run.sh [--small] [--steps N] [--build DIR] [--work DIR]
#
# troupe under a real Slurm: starts a one-machine cluster (scripts/slurm_local.sh: munged,
# slurmctld and slurmd as root, everything under WORK/cluster), submits job.sbatch with
# `sbatch --wait` as two srun tasks on the one node — two launchers, i.e. two "nodes" of the job,
# two workers each — and checks that the job's losses and final checkpoint bytes equal
# `troupe train`'s of the same config. The cluster is stopped on every way out. Needs root and
# Debian's slurm-wlm and munge (scripts/setup.sh installs them); fails, naming what is missing,
# without them.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
parse_options "$@"
[ ${#extra_args[@]} = 0 ] || die "unknown option ${extra_args[0]} (try --help)"
prepare
cluster="$work/cluster"

echo "== one process: troupe train"
run "$troupe" train "$config" "${sets[@]}" --set runtime.run_dir="$work/one_process" | grep "final loss"

echo
echo "== a one-machine Slurm cluster"
stop_cluster() { bash scripts/slurm_local.sh stop --dir "$cluster" | sed 's/^/  /'; }
trap stop_cluster EXIT
run bash scripts/slurm_local.sh start --dir "$cluster" | sed 's/^/  /'
export SLURM_CONF="$cluster/slurm.conf"
run sinfo

echo
echo "== the batch job: 2 srun tasks, each a troupe launch of 2 workers"
job_limit=$((limit - 10))
status=0
# MASTER_PORT: a port free now (job.sbatch's default derives one from the job id, and every fresh
# cluster numbers its first job 1).
run sbatch --wait --nodes=1 --ntasks=2 --ntasks-per-node=2 --time=$(((job_limit + 59) / 60)) \
  --output="$work/job.out" --export=ALL,TROUPE="$troupe",MASTER_PORT="$(free_port)" \
  examples/slurm/job.sbatch "$config" "${sets[@]}" --set runtime.run_dir="$work/slurm_job" || status=$?
grep -E "^job |^troupe launch: (from|node|all)|^step|^done" "$work/job.out" | cut -c1-150 | sed 's/^/  /'
if [ "$status" != 0 ]; then
  tail -n 30 "$work/job.out" >&2
  die "the batch job failed (sbatch exit $status); its output: ${work#$root/}/job.out"
fi

echo
echo "== compare"
same_result "$work/one_process" "$work/slurm_job"
