#!/usr/bin/env bash
# compare_requests.sh: kvdepot's two request paths side by side on loopback
# (see ../shared/BENCHMARKS.md): each GetIntoAsync / PutFromAsync call's
# request as a UCX active message (kvdepot-bench --requests ucx, the
# default) against the same call as a gRPC call (--requests grpc, what
# every call paid before). Block bytes move over UCX either way; only the
# request and its reply change path, so the ratio is what the request path
# is worth per call.
#
# Starts one memory-only kvdepotd (port 0, temporary data dir); for every op
# (put, get), batch and client count runs a warm-up of each side, then
# A B A B (ucx, grpc) for --rounds rounds. Each side's figure is its BEST
# round (highest GB/s); every round is kept in the JSON. ratio = ucx GB/s /
# grpc GB/s (the same as the calls/s ratio: every call moves --batch blocks).
#
#   tools/compare_requests.sh [--build DIR] [--block-size BYTES]
#       [--clients "1 4"] [--batches "1 16"] [--duration S] [--rounds N]
#       [--ucx-tls TLS] [--compare requests|put-protocol] [--out FILE]
#       [--smoke]
#
# --compare put-protocol compares the two ways a put's bytes travel instead
# (puts only, both with requests over UCX): the blocks' bytes sent with the
# request as rendezvous data that the daemon receives into its slots
# (kvdepot-bench --put-protocol send) against the daemon reading them from
# the client's buffers (pull, the default). ratio = send GB/s / pull GB/s.
#
# --ucx-tls sets UCX_TLS for kvdepotd and the clients ("tcp"; "shm,tcp" for
# shared memory between co-located processes, the default of --compare
# requests; --compare put-protocol defaults to "tcp": over shared memory the
# daemon copies a put's blocks in place, so no block is ever sent).
#
# Each measured run is checked against the daemon's own counters
# (kvdepot_ucx_requests_total, scraped before and after it): a run whose
# requests did not take its side's path (a "ucx" run whose requests went as
# gRPC calls, a "send" run whose puts were pulled, or the reverse) counts
# as failed, and its ops per path are kept in the JSON ("paths").
#
# Prints a table and writes JSON (default tools/results/compare_requests.json).
# Stops everything it started on exit, Ctrl-C and TERM included (kvdepotd:
# SIGTERM, SIGKILL after 10 s). Exit 0 when every run succeeded, 1 when
# one failed, 2 for usage errors. Needs the kvdepotd and kvdepot-bench builds.
set -euo pipefail
# The command line as the body of a JSON string: each argument quoted as
# the shell would take it back, then backslashes, quotes and control
# characters escaped.
COMMAND_LINE="$(printf '%q ' "$0" "$@")"
COMMAND_LINE=${COMMAND_LINE% }
COMMAND_LINE=${COMMAND_LINE//\\/\\\\}
COMMAND_LINE=${COMMAND_LINE//\"/\\\"}
COMMAND_LINE=${COMMAND_LINE//$'\t'/\\t}
COMMAND_LINE=${COMMAND_LINE//$'\r'/\\r}
COMMAND_LINE=${COMMAND_LINE//$'\n'/\\n}

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$REPO/build"
BLOCK=262144
CLIENTS="1 4"
BATCHES="1 16"
DURATION=3
ROUNDS=2
WARMUP=1
TLS=""
OUT="$REPO/tools/results/compare_requests.json"
COMPARE=requests

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die_usage() { echo "compare_requests.sh: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 ]] || die_usage "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) need_value "$@"; BUILD="$2"; shift 2 ;;
    --block-size) need_value "$@"; BLOCK="$2"; shift 2 ;;
    --clients) need_value "$@"; CLIENTS="$2"; shift 2 ;;
    --batches) need_value "$@"; BATCHES="$2"; shift 2 ;;
    --duration) need_value "$@"; DURATION="$2"; shift 2 ;;
    --rounds) need_value "$@"; ROUNDS="$2"; shift 2 ;;
    --ucx-tls) need_value "$@"; TLS="$2"; shift 2 ;;
    --compare) need_value "$@"; COMPARE="$2"; shift 2 ;;
    --out) need_value "$@"; OUT="$2"; shift 2 ;;
    --smoke) BLOCK=65536; CLIENTS=1; BATCHES=1; DURATION=0.5; ROUNDS=1; WARMUP=0.2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown argument: $1" ;;
  esac
done
is_uint() { [[ $1 =~ ^[0-9]+$ ]] && [[ $1 -gt 0 ]]; }
is_uint "$BLOCK" || die_usage "--block-size: \"$BLOCK\" is not a byte count"
is_uint "$ROUNDS" || die_usage "--rounds: \"$ROUNDS\" is not a positive integer"
for c in $CLIENTS; do is_uint "$c" || die_usage "--clients: \"$c\" is not a positive integer"; done
for b in $BATCHES; do is_uint "$b" || die_usage "--batches: \"$b\" is not a positive integer"; done
[[ $DURATION =~ ^[0-9]+([.][0-9]+)?$ ]] || die_usage "--duration: \"$DURATION\" is not a number of seconds"
# The two sides (A, B), the kvdepot-bench arguments of each, and the ops.
case "$COMPARE" in
  requests)
    SIDE_A=ucx SIDE_B=grpc OPS="put get"
    ARGS_A=(--requests ucx) ARGS_B=(--requests grpc)
    WORKLOAD="kvdepot-bench get/put over UCX, request as UCX active message (ucx) vs gRPC call (grpc)" ;;
  put-protocol)
    SIDE_A=send SIDE_B=pull OPS="put"
    ARGS_A=(--requests ucx --put-protocol send) ARGS_B=(--requests ucx --put-protocol pull)
    WORKLOAD="kvdepot-bench put over UCX requests, each block sent with its request as rendezvous data (send) vs one request per batch whose blocks the daemon reads (pull)" ;;
  *) die_usage "--compare must be requests or put-protocol" ;;
esac
if [[ -z $TLS ]]; then
  if [[ $COMPARE == put-protocol ]]; then TLS=tcp; else TLS="shm,tcp"; fi
fi

KVDEPOTD="$BUILD/server/kvdepotd"
BENCH="$BUILD/tools/kvdepot-bench"
for tool in "$KVDEPOTD" "$BENCH"; do
  [[ -x $tool ]] || die_usage "$tool not built (ninja -C $BUILD kvdepotd kvdepot-bench)"
done
export UCX_TLS="$TLS" UCX_NET_DEVICES=lo UCX_TCP_TX_SEG_SIZE=512k UCX_TCP_RX_SEG_SIZE=512k

WORK="$(mktemp -d)"
KVD_PID=""
# Stops kvdepotd: SIGTERM, up to 10 s for it to exit, then SIGKILL (a
# daemon stuck in shutdown must not hang the script or outlive it).
cleanup() {
  if [[ -n $KVD_PID ]]; then
    kill "$KVD_PID" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$KVD_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$KVD_PID" 2>/dev/null; then
      echo "compare_requests.sh: kvdepotd did not exit 10 s after SIGTERM: SIGKILL" >&2
      kill -9 "$KVD_PID" 2>/dev/null || true
    fi
    wait "$KVD_PID" 2>/dev/null || true
    KVD_PID=""
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
# Ctrl-C or a TERM: exit (through the EXIT trap: the daemon is stopped).
# bash runs these once the command in progress returns; a kvdepot-bench run
# is bounded by its --duration, and an interactive Ctrl-C reaches it too.
trap 'exit 130' INT
trap 'exit 143' TERM
: >"$WORK/kvdepotd.log"  # read by the port loop before the daemon opens it
"$KVDEPOTD" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir "$WORK/kvd" \
  --dram-capacity 2GiB --nvme-capacity 0 2>"$WORK/kvdepotd.log" &
KVD_PID=$!
port=""
for ((i = 0; i < 600; i++)); do  # up to 60 s (a loaded host)
  port="$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$WORK/kvdepotd.log" | head -n1)"
  [[ -n $port ]] && break
  if ! kill -0 "$KVD_PID" 2>/dev/null; then  # it died: no port is coming
    wait "$KVD_PID" && rc=0 || rc=$?
    KVD_PID=""
    cat "$WORK/kvdepotd.log" >&2
    echo "kvdepotd exited (status $rc) before listening" >&2
    exit 1
  fi
  sleep 0.1
done
[[ -n $port ]] || { cat "$WORK/kvdepotd.log" >&2; echo "kvdepotd did not start" >&2; exit 1; }
KVD="127.0.0.1:$port"
MPORT="$(sed -n 's/.*metrics on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$WORK/kvdepotd.log" | head -n1)"
[[ -n $MPORT ]] || { cat "$WORK/kvdepotd.log" >&2; echo "kvdepotd serves no metrics" >&2; exit 1; }

# ucx_requests: "PushBlocks PullBlocks PullBlocksWithData", the daemon's
# kvdepot_ucx_requests_total by op (PushBlocks, PullBlocks,
# PullBlocksWithData), then kvdepot_requests_total of PushBlocks and of
# PullBlocks over every code (which counts requests of both transports)
# (plain bash: no curl needed).
ucx_requests() {
  local body push=0 pull=0 data=0
  exec 3<>"/dev/tcp/127.0.0.1/$MPORT"
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  body="$(cat <&3)"
  exec 3<&-
  push="$(sed -n 's/^kvdepot_ucx_requests_total{op="PushBlocks"} \([0-9]*\).*/\1/p' <<<"$body")"
  pull="$(sed -n 's/^kvdepot_ucx_requests_total{op="PullBlocks"} \([0-9]*\).*/\1/p' <<<"$body")"
  data="$(sed -n 's/^kvdepot_ucx_requests_total{op="PullBlocksWithData"} \([0-9]*\).*/\1/p' <<<"$body")"
  all() {
    awk -v op="op=\"$1\"" '/^kvdepot_requests_total\{/ && index($0, op) {n += $NF} END {printf "%d", n}' <<<"$body"
  }
  echo "${push:-0} ${pull:-0} ${data:-0} $(all PushBlocks) $(all PullBlocks)"
}

# path_error SIDE OP PUSH PULL DATA ALL: why a run whose UCX requests were
# PUSH PushBlocks, PULL PullBlocks and DATA PullBlocksWithData, of ALL
# requests of its op (either transport), did not take its side's path
# (empty when it did).
path_error() {
  local side=$1 op=$2 push=$3 pull=$4 data=$5 all=$6 ucx
  ucx=$push
  [[ $op == put ]] && ucx=$((pull + data))
  case "$COMPARE/$side" in
    requests/ucx)
      if [[ $ucx -eq 0 ]]; then
        echo "no request came over UCX (they went as gRPC calls)"
      elif [[ $ucx -ne $all ]]; then
        echo "$((all - ucx)) of its $all requests went as gRPC calls"
      fi ;;
    requests/grpc)
      [[ $((push + pull + data)) -eq 0 ]] || echo "$((push + pull + data)) requests came over UCX" ;;
    put-protocol/send)
      if [[ $data -eq 0 || $pull -ne 0 ]]; then
        echo "$data puts came with their bytes, $pull were pulled (UCX_TLS=$UCX_TLS: shared memory copies in place)"
      fi ;;
    put-protocol/pull)
      if [[ $pull -eq 0 || $data -ne 0 ]]; then
        echo "$pull puts were pulled, $data came with their bytes"
      fi ;;
  esac
}

# bench SIDE OP CLIENTS BATCH SECONDS [extra]: one kvdepot-bench run's JSON,
# with "failed": true when the run is not valid (it failed, or did not take
# its side's path): such a run counts in no figure. Its callers read that
# JSON through $(...), a subshell, so a failed run is also recorded in a file
# ($WORK/failed), not in a variable the subshell would lose.
bench() {
  local side=$1 op=$2 clients=$3 batch=$4 seconds=$5 out before after why
  shift 5
  local args=("${ARGS_A[@]}")
  [[ $side == "$SIDE_B" ]] && args=("${ARGS_B[@]}")
  before="$(ucx_requests)"
  if ! out="$("$BENCH" --server "$KVD" --op "$op" "${args[@]}" \
      --block-size "$BLOCK" --clients "$clients" --batch "$batch" \
      --duration "$seconds" --ns requests "$@" --json 2>"$WORK/bench.err")" ||
      [[ $out != '{'* ]]; then
    echo "kvdepot-bench ${args[*]} --op $op x$clients batch $batch failed:" >&2
    sed 's/^/  /' "$WORK/bench.err" >&2
    : >"$WORK/failed"
    echo '{"failed": true}'
    return
  fi
  local failed=false
  if grep -q "falls back to grpc" "$WORK/bench.err"; then
    echo "kvdepot-bench: blocks did not move over UCX:" >&2
    sed 's/^/  /' "$WORK/bench.err" >&2
    failed=true
  fi
  after="$(ucx_requests)"
  local push pull data all  # the run's requests: the counters' growth
  read -r push pull data all < <(awk -v a="$before" -v b="$after" -v op="$op" 'BEGIN{split(a, x); split(b, y);
    print y[1] - x[1], y[2] - x[2], y[3] - x[3], op == "get" ? y[4] - x[4] : y[5] - x[5]}')
  why="$(path_error "$side" "$op" "$push" "$pull" "$data" "$all")"
  if [[ -n $why ]]; then
    echo "kvdepot-bench ${args[*]} --op $op x$clients batch $batch: not a $side run: $why" >&2
    failed=true
  fi
  [[ $failed == true ]] && : >"$WORK/failed"
  # The run's UCX requests by op, from the daemon's counters.
  out="${out%\}}, \"paths\": {\"PushBlocks\": $push, \"PullBlocks\": $pull, \"PullBlocksWithData\": $data, \"all_$op\": $all}, \"failed\": $failed}"
  echo "$out"
}
# A run's figures, empty for a run that is not valid.
valid() { [[ $1 != *'"failed": true'* ]] && echo "$1"; }
gbps() { sed -n 's/.*"gb_per_sec":\([0-9.]*\).*/\1/p' <<<"$(valid "$1")"; }
p99() { sed -n 's/.*"p99_us":\([0-9.]*\).*/\1/p' <<<"$(valid "$1")"; }

printf '%-4s %-7s %-5s %-12s %-12s %-8s %-12s %-12s\n' op clients batch \
  "${SIDE_A}_GB/s" "${SIDE_B}_GB/s" ratio "${SIDE_A}_p99_us" "${SIDE_B}_p99_us"
rows=()
for op in $OPS; do
  for clients in $CLIENTS; do
    for batch in $BATCHES; do
      # Warm-up (and for get, the working set is stored by the first run).
      bench "$SIDE_A" "$op" "$clients" "$batch" "$WARMUP" --clear-ns >/dev/null
      bench "$SIDE_B" "$op" "$clients" "$batch" "$WARMUP" >/dev/null
      best_a=0 best_b=0 a_p99=0 b_p99=0 rounds=""
      for ((r = 1; r <= ROUNDS; r++)); do
        a="$(bench "$SIDE_A" "$op" "$clients" "$batch" "$DURATION")"
        b="$(bench "$SIDE_B" "$op" "$clients" "$batch" "$DURATION")"
        ga="$(gbps "$a")"; gb="$(gbps "$b")"
        ga=${ga:-0}; gb=${gb:-0}
        if awk -v x="$ga" -v y="$best_a" 'BEGIN{exit !(x > y)}'; then best_a=$ga; a_p99="$(p99 "$a")"; fi
        if awk -v x="$gb" -v y="$best_b" 'BEGIN{exit !(x > y)}'; then best_b=$gb; b_p99="$(p99 "$b")"; fi
        rounds+="${rounds:+, }{\"round\": $r, \"$SIDE_A\": $a, \"$SIDE_B\": $b}"
      done
      ratio="$(awk -v a="$best_a" -v b="$best_b" 'BEGIN {if (a > 0 && b > 0) printf "%.2f", a / b; else print "n/a"}')"
      printf '%-4s %-7s %-5s %-12.3f %-12.3f %-8s %-12s %-12s\n' "$op" "$clients" "$batch" \
        "$best_a" "$best_b" "$ratio" "${a_p99:-0}" "${b_p99:-0}"
      rows+=("{\"op\": \"$op\", \"clients\": $clients, \"batch\": $batch, \"${SIDE_A}_gb_per_s\": $best_a, \"${SIDE_B}_gb_per_s\": $best_b, \"ratio\": \"$ratio\", \"${SIDE_A}_p99_us\": ${a_p99:-0}, \"${SIDE_B}_p99_us\": ${b_p99:-0}, \"rounds\": [$rounds]}")
    done
  done
done
{
  echo "{\"benchmark\": \"compare_requests\", \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\","
  echo " \"host\": \"$(hostname)\", \"commit\": \"$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo unknown)\","
  echo " \"command\": \"$COMMAND_LINE\","
  echo " \"compare\": \"$COMPARE\", \"workload\": \"$WORKLOAD\","
  echo " \"block_size\": $BLOCK, \"ucx_tls\": \"$TLS\", \"duration_s\": $DURATION, \"rounds_per_side\": $ROUNDS,"
  echo " \"results\": ["
  for ((i = 0; i < ${#rows[@]}; i++)); do
    printf '  %s%s\n' "${rows[$i]}" "$([[ $i -lt $((${#rows[@]} - 1)) ]] && echo ,)"
  done
  echo " ]}"
} >"$OUT"
echo "JSON: $OUT"
if [[ -e $WORK/failed ]]; then
  echo "compare_requests.sh: a kvdepot-bench run failed (above); its figures are not valid" >&2
  exit 1
fi
