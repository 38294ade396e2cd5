#!/usr/bin/env bash
# A one-machine Slurm cluster for tests and trying job scripts: a generated slurm.conf (this
# machine's hostname as the one node, its CPU count, one partition), a generated munge key, and
# munged, slurmctld and slurmd running as root with every file in a private folder. Debian's
# slurm-wlm and munge packages (scripts/setup.sh installs them).
#
# Usage: scripts/slurm_local.sh start|stop|status [--dir DIR] [--timeout SECONDS]
#   start    write the configuration, start the daemons, wait (at most --timeout, default 60 s)
#            until sinfo shows the node idle; prints the line to point Slurm's commands at it:
#            export SLURM_CONF=DIR/slurm.conf
#   stop     cancel any jobs, shut the daemons down (SIGKILL to those still there after 15 s);
#            the folder is kept (logs: DIR/log/)
#   status   sinfo and squeue of the cluster
#   --dir    the cluster's folder (default build/slurm); start empties it first
# The daemons listen on free ports of this machine and talk over 127.0.0.1 only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() {
  echo "slurm_local: error: $1" >&2
  [ $# -lt 2 ] || echo "  hint: $2" >&2
  exit 1
}

action="${1:-}"
[ $# -gt 0 ] && shift
dir="$root/build/slurm"
timeout_s=60
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift ;;
    --timeout) timeout_s="$2"; shift ;;
    *) die "unknown option '$1'" "usage: scripts/slurm_local.sh start|stop|status [--dir DIR] [--timeout S]" ;;
  esac
  shift
done
case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"
node="$(hostname -s)"
partition=local

# A TCP port on this machine that no socket uses now (scripts/free_port.sh).
free_port() {
  bash "$root/scripts/free_port.sh" || die "no free TCP port found"
}

pid_of() {  # pid file -> pid, when that process is alive
  local pid
  [ -f "$1" ] || return 1
  pid="$(cat "$1" 2>/dev/null)"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# Waits up to $2 seconds for the process in pid file $1 to end.
wait_gone() {
  local until=$((SECONDS + $2))
  while pid_of "$1" >/dev/null && [ $SECONDS -lt $until ]; do sleep 0.2; done
  ! pid_of "$1" >/dev/null
}

start() {
  [ "$(id -u)" = 0 ] ||
    die "the cluster's daemons run as root (slurmd starts jobs as their users), and this is uid $(id -u)" \
        "run it as root (CI does), or with sudo"
  local missing=()
  for c in munged mungekey slurmctld slurmd sinfo sbatch srun scontrol scancel; do
    command -v "$c" >/dev/null || missing+=("$c")
  done
  [ ${#missing[@]} = 0 ] ||
    die "missing ${missing[*]}" "install Debian's slurm-wlm and munge: bash scripts/setup.sh does"
  for f in "$dir/run/munged.pid" "$dir/run/slurmctld.pid" "$dir/run/slurmd.pid"; do
    if pid_of "$f" >/dev/null; then die "a cluster is already running in $dir" "scripts/slurm_local.sh stop --dir $dir"; fi
  done

  # Unix socket paths have at most 107 characters: munged's, and slurmd's per job step.
  local socket="$dir/munge/munge.socket" step_socket="$dir/spool/${node}_4294967294.4294967294"
  [ ${#step_socket} -lt 104 ] && [ ${#socket} -lt 104 ] ||
    die "the folder $dir is too deep for the Unix sockets the daemons make in it" \
        "pass a shorter --dir"
  rm -rf "$dir"
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
  chmod 755 "$dir" "$dir/munge"
  mungekey --create --keyfile="$dir/munge/munge.key" --bits=1024
  chmod 600 "$dir/munge/munge.key"

  local ctld_port slurmd_port
  ctld_port="$(free_port)"
  slurmd_port="$(free_port)"
  while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port="$(free_port)"; done
  cat > "$conf" <<CONF
# Written by scripts/slurm_local.sh: a one-machine cluster, every file under $dir.
ClusterName=troupe-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# A job's processes get a second to end after scancel before SIGKILL.
KillWait=5
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=$partition Nodes=$node Default=YES MaxTime=60 State=UP
CONF

  munged --force --key-file="$dir/munge/munge.key" --socket="$socket" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" ||
    die "munged did not start" "see $dir/log/munged.log"
  slurmctld -c || die "slurmctld did not start" "see $dir/log/slurmctld.log"
  slurmd -N "$node" || die "slurmd did not start" "see $dir/log/slurmd.log"

  local until=$((SECONDS + timeout_s)) state=""
  while [ $SECONDS -lt $until ]; do
    state="$(timeout 5 sinfo -h -n "$node" -o %T 2>/dev/null || true)"
    [ "$state" = idle ] && break
    sleep 0.5
  done
  if [ "$state" != idle ]; then
    echo "slurm_local: the node is '${state:-not reported}' after $timeout_s s; the end of the logs:" >&2
    tail -n 5 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
    stop >&2 || true
    die "the cluster did not come up" "see $dir/log/"
  fi
  echo "slurm_local: node $node idle in partition $partition ($(nproc) CPUs); controller on port $ctld_port"
  echo "export SLURM_CONF=$conf"
}

stop() {
  [ -f "$conf" ] || { echo "slurm_local: no cluster in $dir"; return 0; }
  if pid_of "$dir/run/slurmctld.pid" >/dev/null; then
    timeout 10 scancel --partition="$partition" 2>/dev/null || true
    timeout 10 scontrol shutdown 2>/dev/null || true
  fi
  local d pid
  for d in slurmd slurmctld; do
    wait_gone "$dir/run/$d.pid" 15 && continue
    pid="$(pid_of "$dir/run/$d.pid")" || continue
    echo "slurm_local: $d (pid $pid) still running after 15 s: SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$dir/run/$d.pid" 5 || echo "slurm_local: warning: $d (pid $pid) did not end" >&2
  done
  # munged ends on the shutdown request above only when asked.
  if pid="$(pid_of "$dir/run/munged.pid")"; then
    kill -TERM "$pid" 2>/dev/null || true
    wait_gone "$dir/run/munged.pid" 10 || kill -KILL "$pid" 2>/dev/null || true
  fi
  echo "slurm_local: stopped (logs in $dir/log)"
}

case "$action" in
  start) start ;;
  stop) stop ;;
  status) timeout 10 sinfo; timeout 10 squeue ;;
  -h|--help|"") sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) die "unknown action '$action'" "start, stop or status" ;;
esac
