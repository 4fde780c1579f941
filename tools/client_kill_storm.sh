#!/usr/bin/env bash
# client_kill_storm.sh: does kvdepotd live through clients that die at any
# point of a short life? Starts kvdepotd (loopback, DRAM only, its own data
# dir, its metrics on a loopback port), then runs `kvdepotctl put` of a
# 256 KiB block (or, with --op get, `kvdepotctl get` of one stored before)
# --kills times, one after another, each one SIGKILLed at a random moment of
# a client's measured life (OpenSession, the UCX connections,
# RegisterBuffer, the transfer, CloseSession).
#
# The kill window is measured, not guessed: first --probes clients run to
# the end unkilled (each must succeed), and each kill then lands a uniform
# random 0..1 x their median lifetime after the client's exec. After each
# kill the daemon's request counters (kvdepot_requests_total on its metrics
# port) say how far that client got: "before the daemon" (no OpenSession
# reached it), "session open" (OpenSession, no transfer yet), "mid-transfer"
# (its Push/PullBlocks or other transfer call reached the daemon, and no
# CloseSession), "after its close" (the client had finished). The counts are
# printed; a kill is attributed from counters read right after it, so a
# request the daemon completes later may count toward the next kill.
#
# Exit 0 when kvdepotd was alive after every kill and some killed clients
# reached the daemon; 1 when it died (the kill it died at and the end of its
# log are printed), when an unkilled probe client failed, or when no killed
# client reached the daemon at all (a storm that kills every client before
# it connects tests nothing); 2 for usage errors.
#
# A robustness check, not a benchmark (transport/README, caveat 4: UCX 1.13
# aborted kvdepotd when a client died while its first request was wired
# up). The e2e test ClientsThatDieAsTheirFirstRequestGoesOutLeaveTheDaemonServing
# is the regression test; this covers the rest of a client's life.
#
#   tools/client_kill_storm.sh [--build DIR] [--kills N] [--op put|get]
#                              [--ucx-tls TLS] [--probes N]
#
# --build defaults to <repo>/build (the repository holding this script).
# --ucx-tls sets UCX_TLS for kvdepotd and the clients (default: unset, UCX's
# own choice: shared memory for these co-located clients).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$REPO/build"
kills=400
tls=""
op=put
probes=5
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=${2:?}; shift 2 ;;
    --kills) kills=${2:?}; shift 2 ;;
    --ucx-tls) tls=${2:?}; shift 2 ;;
    --op) op=${2:?}; shift 2 ;;
    --probes) probes=${2:?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "client_kill_storm.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
daemon=$build/server/kvdepotd
ctl=$build/client/kvdepotctl
case "$op" in put|get) ;; *) echo "client_kill_storm.sh: --op put|get" >&2; exit 2 ;; esac
[[ $kills =~ ^[1-9][0-9]*$ ]] || { echo "client_kill_storm.sh: --kills N (N >= 1)" >&2; exit 2; }
[[ $probes =~ ^[1-9][0-9]*$ ]] || { echo "client_kill_storm.sh: --probes N (N >= 1)" >&2; exit 2; }
for b in "$daemon" "$ctl"; do
  [ -x "$b" ] || { echo "client_kill_storm.sh: $b not built" >&2; exit 2; }
done
command -v curl >/dev/null || { echo "client_kill_storm.sh: curl not found" >&2; exit 2; }
if [ -n "$tls" ]; then export UCX_TLS=$tls; else unset UCX_TLS; fi

dir=$(mktemp -d /tmp/kvdepot-storm.XXXXXX)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
head -c 262144 /dev/urandom > "$dir/block"
"$daemon" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir "$dir/data" \
  --dram-capacity 256MiB --nvme-capacity 0 > "$dir/kvdepotd.log" 2>&1 &
pid=$!
server="" metrics=""
for _ in $(seq 300); do  # up to 30 s (a loaded host)
  server=$(sed -n 's/.* listening on \(127\.0\.0\.1:[0-9]*\);.*/\1/p' "$dir/kvdepotd.log")
  metrics=$(sed -n 's/.*; metrics on \(127\.0\.0\.1:[0-9]*\);.*/\1/p' "$dir/kvdepotd.log")
  [ -n "$server" ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
[ -n "$server" ] || { echo "kvdepotd did not start:"; cat "$dir/kvdepotd.log"; exit 1; }
[ -n "$metrics" ] || { echo "kvdepotd names no metrics port:"; cat "$dir/kvdepotd.log"; exit 1; }

# counters: "sessions transfers closes" so far, summed over result codes:
# OpenSession, the calls that move or look up blocks, CloseSession.
counters() {
  curl -sf --max-time 10 "http://$metrics/metrics" | awk '
    /^kvdepot_requests_total\{/ {
      op = $0; sub(/.*op="/, "", op); sub(/".*/, "", op)
      if (op == "OpenSession") s += $NF
      else if (op == "CloseSession") c += $NF
      else if (op != "RegisterBuffer" && op != "Health" && op != "Stats" && op != "Inspect") t += $NF
    }
    END { printf "%d %d %d\n", s, t, c }'
}

client() {  # client I: one kvdepotctl of --op, in the background; sets cpid
  if [ "$op" = put ]; then
    "$ctl" --server "$server" put --ns storm --key "$(printf '%s%08x' "$1" "$2")" \
      --file "$dir/block" > /dev/null 2>"$dir/client.err" &
  else
    "$ctl" --server "$server" get --ns storm --key 00 --out /dev/null > /dev/null 2>"$dir/client.err" &
  fi
  cpid=$!
}

if [ "$op" = get ]; then
  "$ctl" --server "$server" put --ns storm --key 00 --file "$dir/block" > /dev/null
fi

# A client's lifetime, measured: --probes clients run to the end.
lifetimes=()
for i in $(seq "$probes"); do
  t0=$(date +%s%N)
  client a0 "$i"
  if ! wait "$cpid"; then
    echo "client_kill_storm.sh: unkilled probe client $i failed:"; cat "$dir/client.err"; exit 1
  fi
  lifetimes+=($((($(date +%s%N) - t0) / 1000)))
done
life_us=$(printf '%s\n' "${lifetimes[@]}" | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')
window_us=$life_us
echo "client lifetime (median of $probes unkilled $op clients): $((life_us / 1000)) ms; kills land 0-$((window_us / 1000)) ms after exec"

read -r s0 t0c c0 <<<"$(counters)"
prev="$s0 $t0c $c0"
before=0 session=0 transfer=0 after=0
for i in $(seq "$kills"); do
  delay_us=$(awk -v w="$window_us" -v r="$RANDOM$RANDOM" 'BEGIN {srand(r); printf "%d", rand() * w}')
  client b0 "$i"
  sleep "$(awk -v u="$delay_us" 'BEGIN {printf "%.6f", u / 1e6}')"
  kill -9 "$cpid" 2>/dev/null || true
  wait "$cpid" 2>/dev/null || true
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "kvdepotd died at kill $i of $kills ($op, UCX_TLS=${tls:-unset}); its log ends:"
    tail -n 30 "$dir/kvdepotd.log"
    exit 1
  fi
  now="$(counters)" || { echo "kvdepotd's metrics did not answer after kill $i"; exit 1; }
  read -r ps pt pc <<<"$prev"
  read -r ns nt nc <<<"$now"
  if ((nc > pc)); then after=$((after + 1))
  elif ((nt > pt)); then transfer=$((transfer + 1))
  elif ((ns > ps)); then session=$((session + 1))
  else before=$((before + 1))
  fi
  prev="$now"
done
read -r s1 t1 c1 <<<"$prev"
echo "kills: $kills; landed before the daemon saw the client: $before, with its session open: $session, mid-transfer: $transfer, after its close: $after"
echo "daemon counters over the kills: OpenSession +$((s1 - s0)), transfer calls +$((t1 - t0c)), CloseSession +$((c1 - c0))"
if ((s1 == s0)); then
  echo "client_kill_storm.sh: no killed client reached the daemon: nothing was tested"
  exit 1
fi
echo "kvdepotd lived through $kills kills ($op, UCX_TLS=${tls:-unset})"
