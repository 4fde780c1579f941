#!/usr/bin/env bash
# redis_load_smoke.sh REDIS_LOAD: redis-load against a real redis-server
# (its own, on a Unix socket in a temporary directory, no TCP port): fills
# 64 keys of 64 KiB, GETs and SETs them for 0.5 s each over 2 connections
# at -P 1 and -P 4 (every reply checked: exit 1 on a bad one), and checks
# that a GET expecting another value size fails. Asserts no timing.
# Exit 77 (skipped) without redis-server.
set -euo pipefail
LOAD=$1
command -v redis-server >/dev/null || { echo "redis-server not installed: skipped"; exit 77; }
TMP="$(mktemp -d "${TMPDIR:-/tmp}/redis_load_smoke.XXXXXX")"
PID=""
cleanup() {
  [[ -z $PID ]] || { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }
  rm -rf "$TMP"
}
trap cleanup EXIT
redis-server --port 0 --unixsocket "$TMP/redis.sock" --unixsocketperm 700 --save '' \
  --appendonly no --daemonize no --dir "$TMP" --logfile "$TMP/redis.log" &
PID=$!
for ((i = 0; i < 100; i++)); do [[ -S $TMP/redis.sock ]] && break; sleep 0.1; done
run() { "$LOAD" --unix "$TMP/redis.sock" --keys 64 --clients 2 "$@"; }
run --op fill --size 65536 --pipeline 4
for p in 1 4; do
  for op in get set; do
    out="$(run --op "$op" --size 65536 --pipeline "$p" --duration 0.5 --json)"
    echo "$out"
    grep -q '"errors":0,' <<<"$out"
    grep -Eq '"ops":[1-9]' <<<"$out"
  done
done
if run --op get --size 65537 --duration 0.2 --json >"$TMP/wrong.json" 2>"$TMP/wrong.err"; then
  echo "a GET of 65536-byte values as 65537-byte ones was not caught"; exit 1
fi
grep -q 'bad reply' "$TMP/wrong.err"
echo "redis_load_smoke: ok"
