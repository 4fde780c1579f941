#!/usr/bin/env bash
# kvdepot_bench_verify_test.sh KVDEPOTD KVDEPOT_BENCH KVDEPOTCTL:
# kvdepot-bench's read-back check against a real kvdepotd (memory only, port
# 0, a temporary data dir; UCX over TCP loopback). Nothing is timed.
#  - get and put runs over ucx and over grpc must exit 0, report
#    "verify":"ok" with blocks read back, and (ucx) have moved them over UCX;
#  - a get run whose working set already holds a key with other bytes of
#    the right size (stored by kvdepotctl, so kvdepot-bench does not store
#    it again) must exit 1 with "verify":"failed", naming that key, and
#    with errors in the timed window (every block got there must carry its
#    key's stamp): the wrong content passes every other check (sizes, the
#    block's checksum).
set -euo pipefail
KVDEPOTD=$1 BENCH=$2 CTL=$3
export UCX_TLS=tcp UCX_NET_DEVICES=lo
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvdepot_bench_verify.XXXXXX")"
KVD_PID=""
cleanup() {
  if [[ -n $KVD_PID ]]; then
    kill "$KVD_PID" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$KVD_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$KVD_PID" 2>/dev/null || true
    wait "$KVD_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
fail() { echo "kvdepot_bench_verify_test: FAILED: $*" >&2; exit 1; }

: >"$WORK/kvdepotd.log"
"$KVDEPOTD" --listen 127.0.0.1:0 --metrics-listen "" --data-dir "$WORK/kvd" \
  --dram-capacity 256MiB --nvme-capacity 0 --hugepages off 2>"$WORK/kvdepotd.log" &
KVD_PID=$!
port=""
for ((i = 0; i < 600; i++)); do
  port="$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$WORK/kvdepotd.log" | head -n1)"
  [[ -n $port ]] && break
  kill -0 "$KVD_PID" 2>/dev/null || { cat "$WORK/kvdepotd.log" >&2; fail "kvdepotd exited"; }
  sleep 0.1
done
[[ -n $port ]] || { cat "$WORK/kvdepotd.log" >&2; fail "kvdepotd did not start"; }
KVD="127.0.0.1:$port"

# bench NAME ARGS...: one run, its JSON in $WORK/NAME.json, stderr in
# $WORK/NAME.err; returns its exit status.
bench() {
  local name=$1 rc=0
  shift
  "$BENCH" --server "$KVD" --json "$@" >"$WORK/$name.json" 2>"$WORK/$name.err" || rc=$?
  return $rc
}
show() { echo "--- $1:"; cat "$WORK/$1.err" "$WORK/$1.json"; }

for transport in ucx grpc; do
  for op in get put; do
    name="$op-$transport"
    bench "$name" --op "$op" --transport "$transport" --block-size 64KiB \
      --keys 16 --batch 4 --depth 2 --count 64 --ns "ok-$transport" ||
      { show "$name"; fail "$name exited $?"; }
    show "$name"
    grep -q '"verify":"ok"' "$WORK/$name.json" || fail "$name: no \"verify\":\"ok\""
    grep -Eq '"verified_blocks":[1-9]' "$WORK/$name.json" || fail "$name: no block read back"
    grep -Eq '"verify_failures":0[,}]' "$WORK/$name.json" || fail "$name: verify failures"
    grep -q "\"transport\":\"$transport\"" "$WORK/$name.json" ||
      fail "$name: did not run over $transport"
  done
done
# Every key of a 16-key working set is read back (1 client, 64 sampled).
grep -q '"verified_blocks":16,' "$WORK/get-ucx.json" || fail "get-ucx: not all 16 keys read back"

# Key 1 of the working set stored beforehand with other bytes of its size.
head -c 4096 /dev/urandom >"$WORK/other.bin"
hex="$(printf 'ws/4096/1' | od -An -tx1 | tr -d ' \n')"
"$CTL" --server "$KVD" put --ns bad --key "$hex" --file "$WORK/other.bin" ||
  fail "kvdepotctl put failed"
for transport in ucx grpc; do
  name="bad-$transport"
  rc=0
  bench "$name" --op get --transport "$transport" --block-size 4096 --keys 4 \
    --count 64 --ns bad || rc=$?
  show "$name"
  [[ $rc -eq 1 ]] || fail "$name: exit $rc, want 1 (a block with other bytes was not caught)"
  grep -q '"verify":"failed"' "$WORK/$name.json" || fail "$name: no \"verify\":\"failed\""
  grep -Eq '"verify_failures":1[,}]' "$WORK/$name.json" || fail "$name: want 1 verify failure"
  # The timed gets of key 1 fail too: every block got in the window must
  # carry its key's stamp (64 gets over 4 keys draw it).
  grep -Eq '"errors":[1-9][0-9]*,' "$WORK/$name.json" ||
    fail "$name: the timed gets of the bad block were not caught"
  grep -q "get ws/4096/1: the block does not carry its key's stamp" "$WORK/$name.err" ||
    fail "$name: the timed get's error does not name the key"
  grep -q 'verify: client 0: get ws/4096/1: ' "$WORK/$name.err" || fail "$name: the key is not named"
done
# UCX logs to stdout unless UCX_LOG_FILE says otherwise (here: its warning
# about a UCX_ variable it does not know); the JSON stays alone on stdout,
# the compare scripts read it from there.
name="ucx-warns"
UCX_KVDEPOT_NO_SUCH_SETTING=1 bench "$name" --op put --transport ucx \
  --block-size 64KiB --keys 4 --count 16 --ns warns ||
  { show "$name"; fail "$name exited $?"; }
# (grep reads the files itself: `cat ... | grep -q` under pipefail failed
# when grep matched in the first file and quit before cat wrote the second,
# cat dying of SIGPIPE.)
grep -q "UCX_KVDEPOT_NO_SUCH_SETTING" "$WORK/$name.err" "$WORK/$name.json" ||
  { show "$name"; fail "$name: UCX said nothing: nothing to keep apart"; }
[[ "$(wc -l <"$WORK/$name.json")" -eq 1 && "$(head -c1 "$WORK/$name.json")" == "{" ]] ||
  { show "$name"; fail "$name: stdout holds more than the JSON"; }
echo "kvdepot_bench_verify_test: ok"
