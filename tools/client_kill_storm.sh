#!/usr/bin/env bash
# client_kill_storm.sh: does kvdepotd live through clients that die at any
# point of a short life? Starts kvdepotd (loopback, DRAM only, its own data
# dir), then runs `kvdepotctl put` of a 256 KiB block (or, with --op get,
# `kvdepotctl get` of one stored before) --kills times, each
# one SIGKILLed a random 0-80 ms after it starts (kvdepotctl's whole life:
# OpenSession, the UCX connections, RegisterBuffer, the put, CloseSession),
# one after another. Exit 0 when kvdepotd was alive after every kill; 1 when
# it died (the kill it died at and the end of its log are printed).
#
# A robustness check, not a benchmark (transport/README, caveat 4: UCX 1.13
# aborted kvdepotd when a client died while its first request was wired
# up). The e2e test ClientsThatDieAsTheirFirstRequestGoesOutLeaveTheDaemonServing
# is the regression test; this covers the rest of a client's life.
#
#   tools/client_kill_storm.sh [--build DIR] [--kills N] [--op put|get]
#                              [--ucx-tls TLS]
#
# --ucx-tls sets UCX_TLS for kvdepotd and the clients (default: unset, UCX's
# own choice: shared memory for these co-located clients).
set -euo pipefail

build=build
kills=400
tls=""
op=put
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --kills) kills=$2; shift 2 ;;
    --ucx-tls) tls=$2; shift 2 ;;
    --op) op=$2; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "client_kill_storm.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
daemon=$build/server/kvdepotd
ctl=$build/client/kvdepotctl
case "$op" in put|get) ;; *) echo "client_kill_storm.sh: --op put|get" >&2; exit 2 ;; esac
for b in "$daemon" "$ctl"; do
  [ -x "$b" ] || { echo "client_kill_storm.sh: $b not built" >&2; exit 2; }
done
if [ -n "$tls" ]; then export UCX_TLS=$tls; else unset UCX_TLS; fi

dir=$(mktemp -d /tmp/kvdepot-storm.XXXXXX)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
head -c 262144 /dev/urandom > "$dir/block"
"$daemon" --listen 127.0.0.1:0 --metrics-listen '' --data-dir "$dir/data" \
  --dram-capacity 256MiB --nvme-capacity 0 > "$dir/kvdepotd.log" 2>&1 &
pid=$!
server=""
for _ in $(seq 100); do
  server=$(sed -n 's/.* listening on \(127\.0\.0\.1:[0-9]*\);.*/\1/p' "$dir/kvdepotd.log")
  [ -n "$server" ] && break
  sleep 0.1
done
[ -n "$server" ] || { echo "kvdepotd did not start:"; cat "$dir/kvdepotd.log"; exit 1; }

if [ "$op" = get ]; then
  "$ctl" --server "$server" put --ns storm --key 00 --file "$dir/block" > /dev/null
fi
for i in $(seq "$kills"); do
  if [ "$op" = put ]; then
    "$ctl" --server "$server" put --ns storm --key "$(printf '%08x' "$i")" \
      --file "$dir/block" > /dev/null 2>&1 &
  else
    "$ctl" --server "$server" get --ns storm --key 00 --out /dev/null > /dev/null 2>&1 &
  fi
  client=$!
  sleep "0.0$(printf '%02d' $((RANDOM % 80)))"
  kill -9 "$client" 2>/dev/null || true
  wait "$client" 2>/dev/null || true
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "kvdepotd died at kill $i of $kills ($op, UCX_TLS=${tls:-unset}); its log ends:"
    tail -n 30 "$dir/kvdepotd.log"
    exit 1
  fi
done
echo "kvdepotd lived through $kills kills ($op, UCX_TLS=${tls:-unset})"
