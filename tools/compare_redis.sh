#!/usr/bin/env bash
# compare_redis.sh: kvdepot vs Redis, block GET and PUT side by side on
# loopback (see ../shared/BENCHMARKS.md, "How a benchmark reports").
#
# Starts its own kvdepotd (port 0, temporary data dir) and redis-server
# (a free loopback port and/or a Unix socket, no persistence), then for every block size, client
# count and batch runs PUT/SET and then GET on both sides in alternation:
# warm-up of each, then A B A B (kvdepot, Redis) for --rounds rounds. Each
# side's figure is its BEST round (highest GB/s); every round is kept in the
# JSON. kvdepot is driven by kvdepot-bench (one thread and one gRPC channel
# per client), Redis by two clients, each run in every round: redis-benchmark
# (-c connections, -r keyspace) and redis-load (tools/redis_load.cc: one
# thread per connection, replies read with large recv() calls and checked
# value by value; redis-benchmark's own client caps Redis's GETs of large
# values at about half of what Redis serves); both sides read from a working
# set of the same keys x block size, stored before the GET runs (by
# redis-load --op fill, which stamps each value with its key). GB/s is
# decimal (1e9 bytes/s); ratio = kvdepot GB/s / Redis GB/s.
#
# Redis's figure for a row is its best run of the same workload (op, value
# size, connections, -P) anywhere in this run: a -P 1 run made for the
# batch-16 row also counts for the batch-1 row and the other way round, with
# either client, every attempt included. The "redis best" column names the
# run (client, connection, -P); "old ratio" is the ratio as this script
# computed it before (redis-benchmark only, the row's own runs).
#
# Batch B is the number of blocks each client moves per round trip: kvdepot-
# bench --batch B (B blocks in one Get or Put call). Redis runs at -P B (B
# GETs or SETs pipelined per round trip) AND at -P 1, with the same -c, in
# every round (over each of its connections, see --redis-via); its figure
# is the best of them (deep pipelines of large values can make Redis slower
# than no pipelining at all, and comparing with that drop would flatter
# kvdepot). Rows where -P B was slower than -P 1 are marked. Ops and GB/s
# count blocks.
#
# Every Redis run is checked against Redis's own counters (INFO stats and
# commandstats, read before and after it): a GET that missed, fewer
# GETs/SETs served than requested, or network bytes that disagree with the
# values moved fail the run (exit 1), and a failed round never counts as a
# side's best. The GB/s of a Redis run are the values it actually served
# (keyspace hits x size for GET, SET calls x size for SET, at most the -n
# requested) over redis-benchmark's elapsed time. When Redis cannot be
# filled with GET's whole working set, that GET case is not measured.
#
# Latency: kvdepot's p50/p99/p999 are per call (the whole batch); redis-
# benchmark times a round trip only to the first reply byte, so its
# percentiles are kept in the JSON, labelled, and left out of the table.
#
#   tools/compare_redis.sh [--build DIR] [--sizes "65536 262144 2097152"]
#       [--clients "1 4"] [--batches "1 16"] [--duration S] [--rounds N]
#       [--transport ucx|grpc] [--ucx-tls TLS] [--redis-via tcp|unix|both]
#       [--redis-clients "redis-benchmark redis-load"] [--redis-load FILE]
#       [--out FILE] [--smoke]
#
# kvdepot's blocks move over --transport: ucx (the default: the UCX data
# plane, with each client's buffer registered) or grpc (the byte streams).
# --ucx-tls sets UCX_TLS for kvdepotd and the clients: tcp (the default,
# so that both sides cross loopback TCP), "shm,tcp" for shared memory
# between co-located processes (kvdepotd then copies blocks straight into
# the bench's buffers), or auto (UCX_TLS left unset: UCX chooses, which here
# means shared memory). When kvdepot may use shared memory (ucx with shm or
# auto), the comparison is a co-located one and Redis is given its own best
# local path too: redis-server listens on a Unix socket as well as on
# loopback TCP, every Redis run is made over both (redis-benchmark -s and
# -h/-p), and its figure is the best of them (the socket does 256 KiB -P 16
# about twice as fast as TCP here, but 16 MiB values five times slower);
# otherwise Redis is on loopback TCP only. --redis-via tcp|unix|both
# overrides that. The table's "via" column and "redis best" name them.
#
# Prints a table and writes JSON (default tools/results/compare_redis.json).
# Stops everything it started on exit. Exit 0 when every run succeeded, 1 when
# a run failed (the table still shows what was measured), 2 for usage errors.
# Needs: the kvdepotd, kvdepot-bench and redis-load builds, redis-server, redis-benchmark,
# redis-cli (Debian redis-server, redis-tools) and python3 (standard library).
set -euo pipefail
# For the report: what was run, at which commit.
export COMPARE_REDIS_COMMAND="$0 $*"
COMPARE_REDIS_COMMIT="$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo unknown)"
export COMPARE_REDIS_COMMIT

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$REPO/build"
SIZES="65536 262144 2097152"
CLIENTS="1 4"
BATCHES="1"
DURATION=5
ROUNDS=2
WARMUP=1                          # seconds of warm-up per side and workload
WORKING_SET=$((256 * 1024 * 1024))  # bytes read by GET (keys = this / size)
DRAM_CAPACITY=2GiB
# Redis keeps its data in memory only; so does kvdepotd here, by default
# (PUT runs overflow DRAM, and demotion to NVMe would make them a disk
# benchmark: tools/compare_fio.sh measures that tier against fio).
NVME_CAPACITY=0
OUT="$REPO/tools/results/compare_redis.json"
TRANSPORT=ucx
UCX_TLS_SETTING=tcp
REDIS_VIA=""   # tcp, unix or both; empty: both when kvdepot's UCX may use shm
REDIS_CLIENTS="redis-benchmark redis-load"
REDIS_LOAD=""  # default: $BUILD/tools/redis-load

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --build DIR          build directory with server/kvdepotd, tools/kvdepot-bench
                       (default: <repo>/build)
  --sizes "B ..."      block sizes in bytes (default "65536 262144 2097152")
  --clients "N ..."    client counts (default "1 4")
  --batches "B ..."    blocks per round trip: kvdepot-bench --batch B; Redis
                       runs -P B and -P 1, its better counts (default "1")
  --duration S         seconds per measured run (default 5)
  --rounds N           A B rounds per workload (default 2)
  --working-set BYTES  GET working set per block size (default 268435456)
  --dram-capacity SIZE kvdepotd DRAM tier (default 2GiB)
  --nvme-capacity SIZE kvdepotd NVMe tier (default 0: off, memory only as
                       Redis; blocks evicted from DRAM are dropped)
  --transport T        kvdepot's data path: ucx (default) or grpc
  --ucx-tls TLS        UCX_TLS for kvdepotd and kvdepot-bench: tcp (default),
                       shm,tcp, or auto (unset: UCX chooses)
  --redis-via V        Redis's connections: tcp, unix (a Unix socket) or
                       both (each Redis run over each; its best counts);
                       default both when kvdepot's UCX may use shared memory
                       (--transport ucx with shm in --ucx-tls, or auto),
                       tcp otherwise
  --redis-clients "C ..." Redis clients run in every round, the best run
                       counts: redis-benchmark and/or redis-load (default both)
  --redis-load FILE    the redis-load binary (default <build>/tools/redis-load)
  --out FILE           JSON output (default tools/results/compare_redis.json)
  --smoke              tiny run for CI: 65536 bytes, 1 client, batch 1,
                       1 s rounds
EOF
}

die_usage() { echo "compare_redis.sh: $*" >&2; echo "Run with --help for more information." >&2; exit 2; }
need_value() { [[ $# -ge 2 ]] || die_usage "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) need_value "$@"; BUILD="$2"; shift 2 ;;
    --sizes) need_value "$@"; SIZES="$2"; shift 2 ;;
    --clients) need_value "$@"; CLIENTS="$2"; shift 2 ;;
    --batches) need_value "$@"; BATCHES="$2"; shift 2 ;;
    --duration) need_value "$@"; DURATION="$2"; shift 2 ;;
    --rounds) need_value "$@"; ROUNDS="$2"; shift 2 ;;
    --working-set) need_value "$@"; WORKING_SET="$2"; shift 2 ;;
    --dram-capacity) need_value "$@"; DRAM_CAPACITY="$2"; shift 2 ;;
    --nvme-capacity) need_value "$@"; NVME_CAPACITY="$2"; shift 2 ;;
    --out) need_value "$@"; OUT="$2"; shift 2 ;;
    --transport) need_value "$@"; TRANSPORT="$2"; shift 2 ;;
    --ucx-tls) need_value "$@"; UCX_TLS_SETTING="$2"; shift 2 ;;
    --redis-via) need_value "$@"; REDIS_VIA="$2"; shift 2 ;;
    --redis-clients) need_value "$@"; REDIS_CLIENTS="$2"; shift 2 ;;
    --redis-load) need_value "$@"; REDIS_LOAD="$2"; shift 2 ;;
    --smoke)
      SIZES=65536; CLIENTS=1; BATCHES=1; DURATION=1; ROUNDS=2; WARMUP=0.3
      WORKING_SET=$((64 * 1024 * 1024)); shift ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown argument: $1" ;;
  esac
done

is_uint() { [[ $1 =~ ^[0-9]+$ ]] && [[ $1 -gt 0 ]]; }
for s in $SIZES; do is_uint "$s" || die_usage "--sizes: \"$s\" is not a byte count"; done
for c in $CLIENTS; do is_uint "$c" || die_usage "--clients: \"$c\" is not a positive integer"; done
for b in $BATCHES; do
  is_uint "$b" && [[ $b -le 1024 ]] || die_usage "--batches: \"$b\" is not an integer in 1..1024"
done
[[ -n $SIZES && -n $CLIENTS && -n $BATCHES ]] ||
  die_usage "--sizes, --clients and --batches must not be empty"
if ! [[ $DURATION =~ ^[0-9]+([.][0-9]+)?$ ]] ||
  ! awk -v d="$DURATION" 'BEGIN{exit !(d > 0)}'; then
  die_usage "--duration: \"$DURATION\" is not a positive number of seconds"
fi
[[ $TRANSPORT == ucx || $TRANSPORT == grpc ]] || die_usage "--transport must be ucx or grpc"
[[ -n $UCX_TLS_SETTING ]] || die_usage "--ucx-tls needs a value (tcp, shm,tcp or auto)"
if [[ $UCX_TLS_SETTING == auto ]]; then unset UCX_TLS; else export UCX_TLS="$UCX_TLS_SETTING"; fi
# Co-located: kvdepot's blocks may move through shared memory (UCX's shm
# transports, or UCX's own choice, which here is shared memory).
if [[ -z $REDIS_VIA ]]; then
  REDIS_VIA=tcp
  if [[ $TRANSPORT == ucx ]] &&
    [[ $UCX_TLS_SETTING == auto || ,$UCX_TLS_SETTING, =~ ,(shm|sm|posix|sysv|cma|knem|xpmem), ]]; then
    REDIS_VIA=both
  fi
fi
case "$REDIS_VIA" in
  tcp|unix) VIAS=$REDIS_VIA ;;
  both) VIAS="tcp unix" ;;
  *) die_usage "--redis-via must be tcp, unix or both" ;;
esac
for t in $REDIS_CLIENTS; do
  [[ $t == redis-benchmark || $t == redis-load ]] ||
    die_usage "--redis-clients: \"$t\" is not redis-benchmark or redis-load"
done
[[ -n $REDIS_CLIENTS ]] || die_usage "--redis-clients must not be empty"
export KVD_NVME_CAPACITY="$NVME_CAPACITY"  # recorded in the JSON
is_uint "$ROUNDS" || die_usage "--rounds: \"$ROUNDS\" is not a positive integer"
is_uint "$WORKING_SET" || die_usage "--working-set: \"$WORKING_SET\" is not a byte count"

KVDEPOTD="$BUILD/server/kvdepotd"
BENCH="$BUILD/tools/kvdepot-bench"
[[ -n $REDIS_LOAD ]] || REDIS_LOAD="$BUILD/tools/redis-load"
PYTHON=/usr/bin/python3
[[ -x $PYTHON ]] || PYTHON="$(command -v python3 || true)"
needed=("$KVDEPOTD" "$BENCH")
[[ " $REDIS_CLIENTS " == *" redis-load "* ]] && needed+=("$REDIS_LOAD")
for tool in "${needed[@]}"; do
  [[ -x $tool ]] || { echo "compare_redis.sh: $tool not found; build it: cd build && ninja kvdepotd kvdepot-bench redis-load" >&2; exit 1; }
done
for tool in redis-server redis-benchmark redis-cli; do
  command -v "$tool" >/dev/null || { echo "compare_redis.sh: $tool not found (apt-get install redis-server redis-tools)" >&2; exit 1; }
done
[[ -n $PYTHON ]] || { echo "compare_redis.sh: python3 not found" >&2; exit 1; }

log() { echo "compare_redis.sh: $*" >&2; }

# --- Everything started here is stopped here --------------------------------

TMP="$(mktemp -d "${TMPDIR:-/tmp}/compare_redis.XXXXXX")"
KVD_PID=""
REDIS_PID=""

stop_pid() {  # stop_pid PID NAME: SIGTERM, then SIGKILL after 10 s
  local pid=$1 name=$2 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "$name ($pid) ignored SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [[ -n $KVD_PID ]] && stop_pid "$KVD_PID" kvdepotd
  [[ -n $REDIS_PID ]] && stop_pid "$REDIS_PID" redis-server
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- Start both servers ------------------------------------------------------

# The log exists before the daemon starts: the port loop reads it at once
# (a background job opens its redirection only when it runs).
: >"$TMP/kvdepotd.log"
"$KVDEPOTD" --listen 127.0.0.1:0 --metrics-listen "" --data-dir "$TMP/kvdepot-data" \
  --dram-capacity "$DRAM_CAPACITY" --nvme-capacity "$NVME_CAPACITY" 2>"$TMP/kvdepotd.log" &
KVD_PID=$!
KVD_PORT=""
for ((i = 0; i < 600; i++)); do  # up to 60 s (a loaded host)
  KVD_PORT="$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$TMP/kvdepotd.log" | head -n1)"
  [[ -n $KVD_PORT ]] && break
  kill -0 "$KVD_PID" 2>/dev/null || break
  sleep 0.1
done
if [[ -z $KVD_PORT ]]; then
  log "kvdepotd did not start; its log:"; cat "$TMP/kvdepotd.log" >&2; exit 1
fi
KVD="127.0.0.1:$KVD_PORT"

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
REDIS_PORT=""
REDIS_SOCK="$TMP/redis.sock"
REDIS_ADDR=()  # how redis-cli reaches it
for ((attempt = 0; attempt < 5; attempt++)); do
  if [[ $REDIS_VIA == unix ]]; then
    # No TCP listener at all: every client goes through the socket.
    port=0 addr=(-s "$REDIS_SOCK")
    redis-server --port 0 --unixsocket "$REDIS_SOCK" --unixsocketperm 700 \
      --save '' --appendonly no --daemonize no --dir "$TMP" --logfile "$TMP/redis.log" &
  else
    port="$(free_port)" addr=(-h 127.0.0.1 -p "$port") sock=()
    [[ $REDIS_VIA == both ]] && sock=(--unixsocket "$REDIS_SOCK" --unixsocketperm 700)
    redis-server --port "$port" --bind 127.0.0.1 "${sock[@]}" --save '' --appendonly no \
      --daemonize no --dir "$TMP" --logfile "$TMP/redis.log" &
  fi
  REDIS_PID=$!
  for ((i = 0; i < 100; i++)); do
    if [[ "$(redis-cli "${addr[@]}" ping 2>/dev/null)" == PONG ]]; then
      REDIS_PORT=$port REDIS_ADDR=("${addr[@]}"); break
    fi
    kill -0 "$REDIS_PID" 2>/dev/null || break
    sleep 0.1
  done
  # The port may have been taken between the probe and the bind: try another.
  [[ -z $REDIS_PORT ]] || break
  stop_pid "$REDIS_PID" redis-server
  REDIS_PID=""
done
if [[ -z $REDIS_PORT ]]; then
  log "redis-server did not start; its log:"; cat "$TMP/redis.log" >&2 || true; exit 1
fi
if [[ $REDIS_VIA == both ]] && [[ "$(redis-cli -s "$REDIS_SOCK" ping 2>/dev/null)" != PONG ]]; then
  log "redis-server does not answer on $REDIS_SOCK; its log:"; cat "$TMP/redis.log" >&2 || true; exit 1
fi
rcli() { redis-cli "${REDIS_ADDR[@]}" "$@"; }
case "$REDIS_VIA" in
  unix) log "kvdepotd on $KVD, redis-server on unix socket $REDIS_SOCK (co-located comparison)" ;;
  both) log "kvdepotd on $KVD, redis-server on 127.0.0.1:$REDIS_PORT and unix socket $REDIS_SOCK (co-located comparison: its best of the two counts)" ;;
  *) log "kvdepotd on $KVD, redis-server on 127.0.0.1:$REDIS_PORT" ;;
esac

# --- One run of each side ----------------------------------------------------

RECORDS="$TMP/records.jsonl"  # one JSON object per measured run
: >"$RECORDS"
FAILED=0

# kvdepot_run OP SIZE CLIENTS BATCH KEYS SECONDS ROUND: one kvdepot-bench
# run; a measured round (ROUND > 0) is appended to $RECORDS. The warm-up
# (ROUND 0) first empties the namespace (--clear-ns), as Redis is flushed:
# the blocks of earlier put runs would otherwise fill the DRAM tier, and the
# eviction they cause could take GET's working set away during the run.
kvdepot_run() {
  local op=$1 size=$2 clients=$3 batch=$4 keys=$5 seconds=$6 round=$7 out rc=0
  local clear=()
  [[ $round -eq 0 ]] && clear=(--clear-ns)
  out="$("$BENCH" --server "$KVD" --op "$op" --block-size "$size" --clients "$clients" \
    --batch "$batch" --duration "$seconds" --keys "$keys" --ns compare "${clear[@]}" \
    --transport "$TRANSPORT" \
    --json 2>"$TMP/bench.err")" || rc=$?
  if [[ $rc -ne 0 || $out != '{'* ]]; then
    log "kvdepot-bench $op $size x$clients batch $batch failed (exit $rc):"
    sed 's/^/  /' "$TMP/bench.err" >&2
    [[ -z $out ]] || printf '%s\n' "$out" | head -c 2000 | sed 's/^/  stdout: /' >&2
    FAILED=1
  fi
  [[ $out == '{'* ]] || return 0
  if [[ $round -gt 0 ]]; then
    # A run with errors (exit 1) is kept in the JSON but never counts as
    # kvdepot's best.
    local failed=false
    [[ $rc -eq 0 ]] || failed=true
    echo "{\"side\":\"kvdepot\",\"workload\":\"$op\",\"round\":$round,\"working_set_keys\":$keys,\"failed\":$failed,${out#\{}" >>"$RECORDS"
    log "  kvdepot round $round: $(tail -n1 "$TMP/bench.err")"
  fi
}

# redis_counters: Redis's own counts, as "hits misses net_in net_out gets
# sets" (INFO stats: keyspace_hits/misses, total_net_input/output_bytes;
# commandstats: calls of GET and SET). Fails when INFO cannot be read.
redis_counters() {
  rcli info stats commandstats 2>/dev/null | tr -d '\r' | awk -F'[:,=]' '
    $1 == "keyspace_hits" {h = $2} $1 == "keyspace_misses" {m = $2}
    $1 == "total_net_input_bytes" {i = $2} $1 == "total_net_output_bytes" {o = $2}
    $1 == "cmdstat_get" {g = $3} $1 == "cmdstat_set" {s = $3}
    END {if (h == "" || m == "" || i == "" || o == "") exit 1
         printf "%s %s %s %s %d %d\n", h, m, i, o, g, s}'
}

# redis_run TOOL TEST SIZE CLIENTS PIPELINE KEYS REQUESTS ROUND BATCH VIA
# [ATTEMPT]: one run of TOOL (redis-benchmark or redis-load; TEST is set or
# get; PIPELINE requests per round trip, -P; over VIA, tcp or unix) for the
# case of batch BATCH. redis-benchmark stops after REQUESTS requests (-n);
# redis-load after SECONDS = REQUESTS (a duration: it is bounded by time).
# Sets REDIS_RPS (requests/s, for sizing the next run) and REDIS_RECORD
# (its JSON line; for a measured round, ROUND > 0, the caller appends it to
# $RECORDS). The run is checked against Redis's counters read around it:
# every one of the requests made must have been served (GET: a keyspace hit
# each, no miss at all) and the network bytes in the values' direction must
# match the values served; redis-load also checks every reply itself (each
# GET's length and the key stamped in its value). Otherwise the record says
# "failed" and FAILED is set.
REDIS_RPS=0
REDIS_RECORD=""
redis_run() {
  local tool=$1 test=$2 size=$3 clients=$4 pipeline=$5 keys=$6 requests=$7 round=$8 batch=$9
  local via=${10} attempt=${11:-0}
  local out rc=0 line before after addr stats label
  label="$tool $test $size x$clients -P $pipeline ($via)"
  REDIS_RPS=0; REDIS_RECORD=""
  if ! before="$(redis_counters)"; then
    log "$label: cannot read Redis's INFO"
    FAILED=1; return 0
  fi
  if [[ $tool == redis-benchmark ]]; then
    if [[ $via == unix ]]; then addr=(-s "$REDIS_SOCK"); else addr=(-h 127.0.0.1 -p "$REDIS_PORT"); fi
    # Bounded in time as well as count, in case the request estimate is off.
    out="$(timeout "$(awk -v d="$DURATION" 'BEGIN{printf "%d", d * 6 + 30}')" \
      redis-benchmark "${addr[@]}" -t "$test" -d "$size" -c "$clients" \
      -P "$pipeline" -n "$requests" -r "$keys" -q --csv 2>"$TMP/redis-client.err")" || rc=$?
    # "SET","2061.86","1.517","0.112","0.911","4.959","9.343","14.215"
    line="$(printf '%s\n' "$out" | grep -i "^\"$test\"," | head -n1 || true)"
    # stats: requests made, requests/s, seconds, p50, p99, p999 (us), errors
    # the client saw. ops are the requests Redis served (at most -n:
    # redis-benchmark may send up to a pipeline per connection more, which
    # its clock does not cover); seconds are redis-benchmark's (-n /
    # requests/s). Its latency of a request is its round trip's time to the
    # first reply byte.
    [[ -z $line ]] || stats="$(printf '%s\n' "$line" | awk -F'"' -v n="$requests" \
      '{printf "%d %s %.6f %.3f %.3f null 0", n, $4, n / $4, $10 * 1000, $14 * 1000}')"
  else
    if [[ $via == unix ]]; then addr=(--unix "$REDIS_SOCK"); else addr=(--port "$REDIS_PORT"); fi
    out="$(timeout "$(awk -v d="$requests" 'BEGIN{printf "%d", d * 6 + 30}')" \
      "$REDIS_LOAD" "${addr[@]}" --op "$test" --size "$size" --clients "$clients" \
      --pipeline "$pipeline" --keys "$keys" --duration "$requests" --json \
      2>"$TMP/redis-client.err")" || rc=$?
    line="$(printf '%s\n' "$out" | grep '^{' | head -n1 || true)"
    # redis-load's seconds run from the common start to the last
    # connection's end; its latency is per round trip, to the last reply
    # byte. Bad replies (exit 1) are its errors.
    [[ -z $line ]] || stats="$("$PYTHON" -c 'import json, sys
r = json.loads(sys.argv[1]); n = r["ops"] + r["errors"]
print(n, r["ops_per_sec"], r["seconds"], r["p50_us"], r["p99_us"], r["p999_us"], r["errors"])' "$line")"
    # Exit 1 with bad replies counted: the record says failed. Exit 1
    # without (a connection lost, RESP not understood) is a failed run.
    [[ $rc -eq 1 && -n ${stats:-} && $(awk '{print $7}' <<<"$stats") -gt 0 ]] && rc=0
  fi
  after="$(redis_counters)" || after=""
  if [[ $rc -ne 0 || -z $line || -z $after || -z ${stats:-} ]]; then
    log "$label failed (exit $rc):"
    sed 's/^/  /' "$TMP/redis-client.err" >&2; printf '%s\n' "$out" | sed 's/^/  /' >&2
    FAILED=1; return 0
  fi
  REDIS_RPS="$(awk '{print $2}' <<<"$stats")"
  local lat_unit="round trip, to the first reply byte (not comparable with kvdepot per call)"
  [[ $tool == redis-load ]] && lat_unit="round trip, to the last reply byte (as kvdepot's per call)"
  REDIS_RECORD="$(awk -v t="$test" -v tool="$tool" -v r="$round" -v a="$attempt" \
    -v s="$size" -v c="$clients" -v b="$batch" -v p="$pipeline" -v k="$keys" \
    -v before="$before" -v after="$after" -v via="$via" -v lu="$lat_unit" \
    -v bad_msg="$(grep -m1 'bad reply' "$TMP/redis-client.err" | tr -d '"\\' || true)" '{
      n = $1; rps = $2; secs = $3; p50 = $4; p99 = $5; p999 = $6; bad = $7
      split(before, x, " "); split(after, y, " ")
      hits = y[1] - x[1]; misses = y[2] - x[2]; net_in = y[3] - x[3]; net_out = y[4] - x[4]
      gets = y[5] - x[5]; sets = y[6] - x[6]
      served = (t == "get") ? hits : sets
      net = (t == "get") ? net_out : net_in
      why = ""
      if (bad > 0) why = why sprintf("%d bad replies (%s); ", bad, bad_msg)
      if (t == "get" && misses > 0) why = why sprintf("%d GETs missed; ", misses)
      if (t == "get" && gets < n) why = why sprintf("Redis counted %d GETs of %d; ", gets, n)
      if (served < n) why = why sprintf("%d of %d requests served; ", served, n)
      # Each value crosses the connection once, plus the protocol (a few
      # dozen bytes per request) and the INFO and CONFIG replies around it.
      if (net < served * s || net > served * (s + 256) + 65536)
        why = why sprintf("%.0f network bytes for %d values of %d bytes; ", net, served, s)
      ops = (served < n ? served : n) - bad
      if (ops < 0) ops = 0
      if (secs <= 0) secs = 1e-9
      printf "{\"side\":\"redis\",\"workload\":\"%s\",\"round\":%d,\"attempt\":%d,", (t == "set") ? "put" : "get", r, a
      printf "\"working_set_keys\":%d,\"tool\":\"%s\",\"op\":\"%s\",", k, tool, t
      printf "\"redis_via\":\"%s\",\"block_size\":%d,\"clients\":%d,\"batch\":%d,\"pipeline\":%d,", via, s, c, b, p
      printf "\"requests\":%d,\"ops\":%d,\"ops_unit\":\"block\",\"seconds\":%.6f,", n, ops, secs
      printf "\"ops_per_sec\":%.3f,\"calls_per_sec\":%.3f,\"gb_per_sec\":%.6f,", ops / secs, ops / secs / p, ops * s / secs / 1e9
      printf "\"client_rps\":%.3f,", rps
      printf "\"counters\":{\"keyspace_hits\":%d,\"keyspace_misses\":%d,\"gets\":%d,\"sets\":%d,\"net_payload_direction_bytes\":%.0f},", hits, misses, gets, sets, net
      printf "\"latency_unit\":\"%s\",", lu
      printf "\"p50_us\":%.3f,\"p99_us\":%.3f,\"p999_us\":%s,", p50, p99, p999
      printf "\"errors\":%d,\"failed\":%s", (n - ops) + misses, why == "" ? "false" : "true"
      if (why != "") { sub(/; $/, "", why); printf ",\"failure\":\"%s\"", why }
      printf "}\n"
    }' <<<"$stats")"
  if [[ $REDIS_RECORD == *'"failed":true'* ]]; then
    log "$label: FAILED the check: $(sed 's/.*"failure":"\([^"]*\)".*/\1/' <<<"$REDIS_RECORD")"
    FAILED=1
  fi
  if [[ $round -gt 0 ]]; then
    log "  redis   round $round: $label: $(sed 's/.*"gb_per_sec":\([0-9.]*\).*/\1/' <<<"$REDIS_RECORD") GB/s of values served ($REDIS_RPS requests/s)"
  fi
}

# redis_round TOOL TEST SIZE CLIENTS PIPELINE KEYS ROUND BATCH VIA: a
# measured Redis round of about $DURATION seconds, every attempt appended
# to $RECORDS (each one counts towards Redis's best). redis-load is bounded
# by time. redis-benchmark stops after -n requests, sized from the last
# measured rate at this -P and VIA (RATE); a run that lasted under half of
# $DURATION (the rate rose since) is followed by another, sized from its
# own rate (at most twice), so Redis is also measured over runs as long as
# kvdepot's. (Before, only the last attempt was kept, which dropped exactly
# the runs where Redis had been faster than estimated.)
declare -A RATE=()
redis_round() {
  local tool=$1 test=$2 size=$3 clients=$4 pipeline=$5 keys=$6 round=$7 batch=$8 via=$9 n attempt rate
  if [[ $tool == redis-load ]]; then
    redis_run "$tool" "$test" "$size" "$clients" "$pipeline" "$keys" "$DURATION" "$round" "$batch" "$via"
    [[ -z $REDIS_RECORD ]] || echo "$REDIS_RECORD" >>"$RECORDS"
    return 0
  fi
  for ((attempt = 0; attempt < 3; attempt++)); do
    rate="${RATE[$via/$pipeline]:-100}"
    n="$(requests_for "$rate" "$DURATION" "$clients" "$pipeline")"
    redis_run "$tool" "$test" "$size" "$clients" "$pipeline" "$keys" "$n" "$round" "$batch" "$via" "$attempt"
    [[ -n $REDIS_RECORD ]] || return 0
    echo "$REDIS_RECORD" >>"$RECORDS"
    [[ $REDIS_RPS != 0 ]] && RATE[$via/$pipeline]=$REDIS_RPS
    awk -v n="$n" -v r="$REDIS_RPS" -v d="$DURATION" -v c="$clients" -v b="$pipeline" \
      'BEGIN{exit !(n / r >= d / 2 || n <= 10 * c * b)}' && break
    [[ $attempt -lt 2 ]] && log "  (that Redis run lasted under $DURATION / 2 s; another one, sized from its rate; both count)"
  done
  return 0
}

# requests_for RATE SECONDS CLIENTS BATCH: requests (-n counts requests, not
# round trips) for a Redis run of about SECONDS at RATE requests/s: at least
# 10 round trips per connection, rounded up to whole round trips.
requests_for() {
  awk -v r="$1" -v d="$2" -v c="$3" -v b="$4" 'BEGIN{
    n = int(r * d); if (n < 10 * c * b) n = 10 * c * b
    print int((n + b - 1) / b) * b }'
}

# redis_fill SIZE KEYS: stores all KEYS keys in Redis. With redis-load: every
# key once, its value stamped with its key (what redis-load's GETs check),
# over whatever redis-benchmark SETs wrote before. Otherwise with
# redis-benchmark (SET with -r hits keys at random: repeat until every one
# exists). Returns 1 when Redis does not hold them all, or holds a first key
# of another size.
redis_fill() {
  local size=$1 keys=$2 i held len
  if [[ " $REDIS_CLIENTS " == *" redis-load "* ]]; then
    local addr=(--port "$REDIS_PORT")
    [[ $REDIS_VIA == unix ]] && addr=(--unix "$REDIS_SOCK")
    if ! "$REDIS_LOAD" "${addr[@]}" --op fill --size "$size" --keys "$keys" --clients 4 \
      --pipeline 4 >/dev/null 2>"$TMP/redis-fill.err"; then
      log "redis-load --op fill failed:"; sed 's/^/  /' "$TMP/redis-fill.err" >&2; return 1
    fi
  fi
  for ((i = 0; i < 20; i++)); do
    held="$(rcli dbsize 2>/dev/null || echo 0)"
    [[ $held =~ ^[0-9]+$ ]] || held=0
    if ((held >= keys)); then
      len="$(rcli strlen key:000000000000 2>/dev/null || echo 0)"
      [[ $len == "$size" ]] && return 0
      log "Redis's key:000000000000 holds $len bytes, not $size"; return 1
    fi
    redis-benchmark "${REDIS_ADDR[@]}" -t set -d "$size" -c 4 -n $((keys * 2)) \
      -r "$keys" -q --csv >/dev/null 2>&1 || true
  done
  log "Redis holds $held of $keys keys after filling"; return 1
}

# --- The comparison ------------------------------------------------------------

read -r -a REDIS_TOOLS <<<"$REDIS_CLIENTS"
for size in $SIZES; do
  keys=$((WORKING_SET / size))
  ((keys < 8)) && keys=8
  ((keys > 1024)) && keys=1024
  for clients in $CLIENTS; do
    for batch in $BATCHES; do
      rcli flushall >/dev/null
      # Redis's baseline at batch B: the better of -P B and -P 1.
      pipelines=("$batch")
      [[ $batch -gt 1 ]] && pipelines+=(1)
      for workload in put get; do
        test=$([[ $workload == put ]] && echo set || echo get)
        if [[ $workload == get && $batch -gt $keys ]]; then
          # A kvdepot get batch reads distinct keys of the working set.
          log "get $size bytes batch $batch: skipped, the working set has only $keys keys"
          continue
        fi
        log "$workload $size bytes x$clients clients batch $batch (working set $keys keys; Redis -P ${pipelines[*]} over $VIAS with ${REDIS_TOOLS[*]})"
        if [[ $workload == get ]] && ! redis_fill "$size" "$keys"; then
          log "get $size bytes x$clients batch $batch: NOT measured (Redis could not be filled)"
          FAILED=1
          continue
        fi
        # Warm-up (also stores kvdepot's working set, and measures Redis's
        # rate at each -P to size redis-benchmark's runs).
        kvdepot_run "$workload" "$size" "$clients" "$batch" "$keys" "$WARMUP" 0
        RATE=()
        for v in $VIAS; do
          for p in "${pipelines[@]}"; do
            for tool in "${REDIS_TOOLS[@]}"; do
              if [[ $tool == redis-load ]]; then
                redis_run "$tool" "$test" "$size" "$clients" "$p" "$keys" "$WARMUP" 0 "$batch" "$v"
              else
                redis_run "$tool" "$test" "$size" "$clients" "$p" "$keys" \
                  "$(requests_for "$(awk -v s="$size" 'BEGIN{print 1e9 / s}')" "$WARMUP" "$clients" "$p")" 0 "$batch" "$v"
                [[ $REDIS_RPS != 0 ]] && RATE[$v/$p]=$REDIS_RPS
              fi
            done
          done
        done
        for ((round = 1; round <= ROUNDS; round++)); do
          kvdepot_run "$workload" "$size" "$clients" "$batch" "$keys" "$DURATION" "$round"
          # The Redis clients take turns going first.
          tools=("${REDIS_TOOLS[@]}")
          if ((round % 2 == 0 && ${#tools[@]} == 2)); then tools=("${tools[1]}" "${tools[0]}"); fi
          for v in $VIAS; do
            for p in "${pipelines[@]}"; do
              for tool in "${tools[@]}"; do
                redis_round "$tool" "$test" "$size" "$clients" "$p" "$keys" "$round" "$batch" "$v"
              done
            done
          done
        done
      done
    done
  done
done

# --- Report ------------------------------------------------------------------

mkdir -p "$(dirname "$OUT")"
"$PYTHON" - "$RECORDS" "$OUT" "$DURATION" "$ROUNDS" "$WORKING_SET" "$DRAM_CAPACITY" \
  "$("$KVDEPOTD" --version 2>/dev/null || echo unknown)" "$(redis-server --version)" "$REDIS_VIA" <<'EOF'
import json, os, sys, time, platform

(records_path, out_path, duration, rounds, working_set, dram, kvd_ver, redis_ver,
 redis_via) = sys.argv[1:10]
runs = [json.loads(line) for line in open(records_path) if line.strip()]

def case_of(r):
    return (r["workload"], r["block_size"], r["clients"], r["batch"])

cases = []  # (workload, block_size, clients, batch) in the order they ran
for r in runs:
    case = case_of(r)
    if case not in cases:
        cases.append(case)

KEEP = ("ops_per_sec", "calls_per_sec", "gb_per_sec", "p50_us", "p99_us",
        "p999_us", "errors")

def side_summary(rs):
    """The best round that did not fail (highest GB/s); every round listed."""
    if not rs:
        return None
    good = [r for r in rs if not r.get("failed") and not r.get("errors")]
    listed = [{k: r.get(k) for k in ("round", "tool", "redis_via", "batch", "pipeline",
                                     "attempt", "ops", "seconds", "failed", "failure") + KEEP
               if k in r} for r in rs]
    if not good:
        return {"failed": True, "rounds": listed}
    best = max(good, key=lambda r: r["gb_per_sec"])
    summary = {k: best[k] for k in KEEP}
    summary["latency_unit"] = best["latency_unit"]
    for k in ("transport", "tool", "redis_via", "batch", "pipeline"):
        if k in best:
            summary[k] = best[k]
    summary["rounds"] = listed
    return summary

def gbps(summary):
    return None if not summary or summary.get("failed") else summary["gb_per_sec"]

results = []
for workload, size, clients, batch in cases:
    rs = [r for r in runs if case_of(r) == (workload, size, clients, batch)]
    kvd = side_summary([r for r in rs if r["side"] == "kvdepot"])
    # Redis's pool for this row: every run of the same workload, size and
    # connections at -P B or -P 1, from whichever row of this run made it,
    # with either client, every attempt.
    pipes = {batch, 1}
    red_rs = [r for r in runs if r["side"] == "redis" and r["workload"] == workload
              and r["block_size"] == size and r["clients"] == clients
              and r["pipeline"] in pipes]
    # Best over Redis's clients and connections (tcp, unix) at each -P, per
    # client, and per variant.
    by_p = {}
    for p in sorted({r["pipeline"] for r in red_rs}, reverse=True):
        by_p[str(p)] = side_summary([r for r in red_rs if r["pipeline"] == p])
    by_tool = {}
    for t in sorted({r["tool"] for r in red_rs}):
        by_tool[t] = side_summary([r for r in red_rs if r["tool"] == t])
    by_variant = {}
    for t, v, p in sorted({(r["tool"], r["redis_via"], r["pipeline"]) for r in red_rs}):
        by_variant[f"{t} {v} -P {p}"] = side_summary(
            [r for r in red_rs if (r["tool"], r["redis_via"], r["pipeline"]) == (t, v, p)])
    # Redis's baseline: its best run of the pool.
    red = side_summary(red_rs)
    ratio = None
    if gbps(kvd) is not None and gbps(red):
        ratio = kvd["gb_per_sec"] / red["gb_per_sec"]
    # The ratio as computed before: redis-benchmark only, this row's runs,
    # only the last attempt of each round.
    last = {}
    for r in rs:
        if r["side"] == "redis" and r["tool"] == "redis-benchmark":
            last[(r["round"], r["redis_via"], r["pipeline"])] = r
    old = side_summary(list(last.values()))
    old_ratio = None
    if gbps(kvd) is not None and gbps(old):
        old_ratio = kvd["gb_per_sec"] / old["gb_per_sec"]
    # The spread: per round, kvdepot's run against Redis's best of the same
    # row and round (runs that alternated with it), so that one lucky run
    # on either side shows as such.
    per_round = []
    for rnd in sorted({r["round"] for r in rs}):
        k_r = side_summary([r for r in rs if r["side"] == "kvdepot" and r["round"] == rnd])
        r_r = side_summary([r for r in rs if r["side"] == "redis" and r["round"] == rnd
                            and r["pipeline"] in pipes])
        if gbps(k_r) is not None and gbps(r_r):
            per_round.append(round(k_r["gb_per_sec"] / r_r["gb_per_sec"], 4))
    slower = None
    if batch > 1 and gbps(by_p.get(str(batch))) is not None and gbps(by_p.get("1")) is not None:
        slower = by_p[str(batch)]["gb_per_sec"] < by_p["1"]["gb_per_sec"]
    results.append({
        "workload": workload, "block_size": size, "clients": clients,
        "batch": batch, "working_set_keys": rs[0]["working_set_keys"],
        "kvdepot": kvd, "redis": red, "redis_by_pipeline": by_p,
        "redis_by_client": by_tool, "redis_by_variant": by_variant,
        "redis_pipelined_slower_than_p1": slower,
        "ratio_gb_per_sec": None if ratio is None else round(ratio, 4),
        "old_ratio_redis_benchmark_row_only": None if old_ratio is None else round(old_ratio, 4),
        "ratio_per_round": per_round,
        "ratio_per_round_min": min(per_round) if per_round else None,
        "ratio_per_round_max": max(per_round) if per_round else None,
    })

report = {
    "tool": "compare_redis",
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "host": platform.node(),
    "kvdepotd": kvd_ver.strip(),
    "redis": redis_ver.strip(),
    "redis_via": {"unix": "unix socket", "tcp": "loopback TCP",
                  "both": "loopback TCP and a unix socket, each run over both, the best counts"}[redis_via],
    "method": "warm-up, then A B A B (kvdepot, then redis at -P B and -P 1 over each "
              "of its connections, with each Redis client) per workload; each side's "
              "figures are its best run that did not fail (highest GB/s); Redis's best "
              "is taken over -P B, -P 1, its connections, its clients and every attempt, "
              "pooled over every row of this run with the same workload, size and "
              "connections; all runs listed",
    "redis_clients": "redis-benchmark (its -n sized from the last rate; a run under "
                     "half the duration is followed by another, all attempts count) and "
                     "redis-load (tools/redis_load.cc: bounded by time, large recv(), every "
                     "reply's length and key stamp checked)",
    "batch": "blocks per round trip: kvdepot-bench --batch B (B blocks in one "
             "Get/Put call); redis-benchmark at -P B (B requests pipelined) and "
             "at -P 1, same -c; redis_by_pipeline has both, and "
             "redis_pipelined_slower_than_p1 says when -P B lost",
    "ops": "blocks (ops_per_sec, gb_per_sec); calls_per_sec = round trips/s",
    "redis_check": "Redis INFO (keyspace_hits/misses, commandstats GET/SET calls, "
                   "total_net_input/output_bytes) read around every run: any miss, "
                   "fewer requests served than asked, or network bytes that do not "
                   "match the values served fail the run; GB/s = values served x "
                   "size / the client's elapsed time",
    "latency": "kvdepot: per call, whole batch; redis-benchmark: per round trip, "
               "to the first reply byte (not comparable); redis-load: per round trip, "
               "to the last reply byte; Redis's are not in the table",
    "ucx_tls": os.environ.get("UCX_TLS") or "auto",
    "duration_s": float(duration),
    "rounds": int(rounds),
    "working_set_bytes": int(working_set),
    "kvdepot_dram_capacity": dram,
    "kvdepot_nvme_capacity": os.environ.get("KVD_NVME_CAPACITY", ""),
    "gb": "1e9 bytes",
    "ratio": "kvdepot GB/s / redis GB/s (redis: best of -P B and -P 1, of its clients, "
             "and of tcp and unix where both ran, pooled over the rows of this run); "
             "old_ratio_redis_benchmark_row_only: the method until 2026-12-06: redis-benchmark "
             "only, the row's own runs, the last attempt of each; ratio_per_round: "
             "per round, kvdepot's run / Redis's best of the same row and round "
             "(the spread of the estimate)",
    "command": os.environ.get("COMPARE_REDIS_COMMAND", ""),
    "commit": os.environ.get("COMPARE_REDIS_COMMIT", ""),
    "results": results,
}
with open(out_path, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")

def size_name(b):
    for unit, n in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n and b % n == 0:
            return f"{b // n}{unit}"
    return f"{b}B"

def fmt(v, spec):
    return "-" if v is None else format(v, spec)

def via(transport):
    if transport is None:
        return "-"
    if transport != "ucx":
        return transport
    return "ucx/" + (os.environ.get("UCX_TLS") or "auto")

header = ("workload", "block", "clients", "batch", "via", "kvdepot GB/s",
          "redis -P B GB/s", "redis -P 1 GB/s", "r-bench GB/s", "r-load GB/s",
          "redis best", "ratio", "per round", "old ratio", "kvdepot p99 us", "note")
rows = []
for r in results:
    k = r["kvdepot"] or {}
    by_p = r["redis_by_pipeline"]
    pb = gbps(by_p.get(str(r["batch"])))
    p1 = gbps(by_p.get("1"))
    notes = []
    if r["redis_pipelined_slower_than_p1"]:
        notes.append(f"redis -P {r['batch']} slower than -P 1")
    if k.get("failed") or (r["redis"] or {}).get("failed"):
        notes.append("FAILED")
    red = r["redis"] or {}
    best_of = "-"
    if gbps(red) is not None:
        best_of = f"{red['tool']} {red['redis_via']} -P {red['pipeline']}"
        if red["batch"] != r["batch"]:
            best_of += f" (b{red['batch']} row)"
    by_tool = r["redis_by_client"]
    rows.append((r["workload"], size_name(r["block_size"]), str(r["clients"]),
                 str(r["batch"]), via(k.get("transport")),
                 fmt(gbps(k), ".3f"), fmt(pb, ".3f") if r["batch"] > 1 else "-",
                 fmt(p1, ".3f"), fmt(gbps(by_tool.get("redis-benchmark")), ".3f"),
                 fmt(gbps(by_tool.get("redis-load")), ".3f"), best_of,
                 fmt(r["ratio_gb_per_sec"], ".2f"),
                 (f"{r['ratio_per_round_min']:.2f}-{r['ratio_per_round_max']:.2f}"
                  if r["ratio_per_round"] else "-"),
                 fmt(r["old_ratio_redis_benchmark_row_only"], ".2f"),
                 fmt(k.get("p99_us"), ".0f"), "; ".join(notes) or "-"))
widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
          for i, h in enumerate(header)]
vias = {"both": "tcp and unix socket", "unix": "unix socket", "tcp": "tcp"}[redis_via]
print(f"kvdepot vs Redis, best of {rounds} rounds of {duration} s "
      f"(GB = 1e9 bytes; ratio = kvdepot / Redis's best of -P B and -P 1 over {vias}, "
      f"with each of its clients, pooled over the rows of this run)")
print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
for row in rows:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
print("batch: blocks per round trip (kvdepot --batch); Redis ran -P B and -P 1 with "
      "the same number of connections (redis -P columns: best over its clients and "
      "connection kinds; r-bench / r-load: best of redis-benchmark / redis-load alone), "
      "its best run of the same workload anywhere in this run is the baseline (redis "
      "best: which; \"bN row\": made for batch N's row). old ratio: against "
      "redis-benchmark's best in the row's own runs (the method until 2026-12-06). per "
      "round: the range over rounds of kvdepot's run / Redis's best of the same row and "
      "round (the estimate's spread). Redis "
      "GB/s: values served, checked against its INFO counters. p99: kvdepot per call "
      "(whole batch); Redis's are in the JSON only")
print(f"JSON: {out_path}")
EOF

if [[ $FAILED -ne 0 ]]; then
  log "some runs failed; see the messages above"
  exit 1
fi
