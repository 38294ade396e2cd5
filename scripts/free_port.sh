#!/usr/bin/env bash
# Prints a TCP port on this machine that no socket uses now, for a job to listen on; exits 1 if
# 200 tries found none. Ports come from below the kernel's ephemeral range
# (/proc/sys/net/ipv4/ip_local_port_range): inside it, any outgoing connection may take the port
# as its local end between this check and the job's bind.
# Usage: port="$(bash scripts/free_port.sh)"
set -uo pipefail
lo=32768
read -r lo _ < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || lo=32768
for _ in $(seq 200); do
  if ((lo > 12000)); then
    p=$((10000 + RANDOM % (lo - 10000)))
  else
    p=$((20000 + RANDOM % 40000))
  fi
  (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && continue
  if command -v ss >/dev/null && [ -n "$(ss -Htan "sport = :$p" 2>/dev/null)" ]; then continue; fi
  echo "$p"
  exit 0
done
echo "free_port: no free TCP port found in 200 tries" >&2
exit 1
