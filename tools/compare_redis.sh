#!/usr/bin/env bash
# compare_redis.sh: kvdepot vs Redis, block GET and PUT side by side on
# loopback (see ../shared/BENCHMARKS.md, "How a benchmark reports").
#
# Starts its own kvdepotd (port 0, temporary data dir) and redis-server
# (a free loopback port, no persistence), then for every block size, client
# count and batch runs PUT/SET and then GET on both sides in alternation:
# warm-up of each, then A B A B (kvdepot, Redis) for --rounds rounds. Each
# side's figure is its BEST round (highest GB/s); every round is kept in the
# JSON. kvdepot is driven by kvdepot-bench (one thread and one gRPC channel
# per client), Redis by redis-benchmark (-c connections, -r keyspace); both
# read from a working set of the same keys x block size, stored before the
# GET runs. GB/s is decimal (1e9 bytes/s); ratio = kvdepot GB/s / Redis GB/s.
#
# Batch B is the number of blocks each client moves per round trip: kvdepot-
# bench --batch B (B blocks in one Get or Put call) against redis-benchmark
# -P B (B GETs or SETs pipelined per round trip). Ops and GB/s count blocks;
# latencies are per call (kvdepot) or per round trip (Redis).
#
#   tools/compare_redis.sh [--build DIR] [--sizes "65536 262144 2097152"]
#       [--clients "1 4"] [--batches "1 16"] [--duration S] [--rounds N]
#       [--transport ucx|grpc] [--ucx-tls TLS] [--out FILE] [--smoke]
#
# kvdepot's blocks move over --transport: ucx (the default: the UCX data
# plane, with each client's buffer registered) or grpc (the byte streams).
# --ucx-tls sets UCX_TLS for kvdepotd and the clients: tcp (the default,
# so that both sides cross loopback TCP), "shm,tcp" for shared memory
# between co-located processes (kvdepotd then copies blocks straight into
# the bench's buffers, while Redis stays on TCP: the co-located comparison),
# or auto (UCX_TLS left unset: UCX chooses, which here means shared memory).
# The table's "via" column names it.
#
# Prints a table and writes JSON (default tools/results/compare_redis.json).
# Stops everything it started on exit. Exit 0 when every run succeeded, 1 when
# a run failed (the table still shows what was measured), 2 for usage errors.
# Needs: the kvdepotd and kvdepot-bench builds, redis-server, redis-benchmark,
# redis-cli (Debian redis-server, redis-tools) and python3 (standard library).
set -euo pipefail

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

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --build DIR          build directory with server/kvdepotd, tools/kvdepot-bench
                       (default: <repo>/build)
  --sizes "B ..."      block sizes in bytes (default "65536 262144 2097152")
  --clients "N ..."    client counts (default "1 4")
  --batches "B ..."    blocks per round trip: kvdepot-bench --batch B, Redis
                       pipelining -P B (default "1")
  --duration S         seconds per measured run (default 5)
  --rounds N           A B rounds per workload (default 2)
  --working-set BYTES  GET working set per block size (default 268435456)
  --dram-capacity SIZE kvdepotd DRAM tier (default 2GiB)
  --nvme-capacity SIZE kvdepotd NVMe tier (default 0: off, memory only as
                       Redis; blocks evicted from DRAM are dropped)
  --transport T        kvdepot's data path: ucx (default) or grpc
  --ucx-tls TLS        UCX_TLS for kvdepotd and kvdepot-bench: tcp (default),
                       shm,tcp, or auto (unset: UCX chooses)
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
export KVD_NVME_CAPACITY="$NVME_CAPACITY"  # recorded in the JSON
is_uint "$ROUNDS" || die_usage "--rounds: \"$ROUNDS\" is not a positive integer"
is_uint "$WORKING_SET" || die_usage "--working-set: \"$WORKING_SET\" is not a byte count"

KVDEPOTD="$BUILD/server/kvdepotd"
BENCH="$BUILD/tools/kvdepot-bench"
PYTHON=/usr/bin/python3
[[ -x $PYTHON ]] || PYTHON="$(command -v python3 || true)"
for tool in "$KVDEPOTD" "$BENCH"; do
  [[ -x $tool ]] || { echo "compare_redis.sh: $tool not found; build it: cd build && ninja kvdepotd kvdepot-bench" >&2; exit 1; }
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
for ((attempt = 0; attempt < 5; attempt++)); do
  port="$(free_port)"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --dir "$TMP" --logfile "$TMP/redis.log" &
  REDIS_PID=$!
  for ((i = 0; i < 100; i++)); do
    if [[ "$(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null)" == PONG ]]; then
      REDIS_PORT=$port; break
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
rcli() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }
log "kvdepotd on $KVD, redis-server on 127.0.0.1:$REDIS_PORT"

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
    echo "{\"side\":\"kvdepot\",\"workload\":\"$op\",\"round\":$round,\"working_set_keys\":$keys,${out#\{}" >>"$RECORDS"
    log "  kvdepot round $round: $(tail -n1 "$TMP/bench.err")"
  fi
}

# redis_run TEST SIZE CLIENTS BATCH KEYS REQUESTS ROUND: one redis-benchmark
# run (TEST is set or get; BATCH requests pipelined per round trip, -P).
# Sets REDIS_RPS (requests/s) and, for a measured round (ROUND > 0),
# REDIS_RECORD (its JSON line, for $RECORDS).
REDIS_RPS=0
REDIS_RECORD=""
redis_run() {
  local test=$1 size=$2 clients=$3 batch=$4 keys=$5 requests=$6 round=$7 out rc=0 line
  # Bounded in time as well as count, in case the request estimate is off.
  out="$(timeout "$(awk -v d="$DURATION" 'BEGIN{printf "%d", d * 6 + 30}')" \
    redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -t "$test" -d "$size" -c "$clients" \
    -P "$batch" -n "$requests" -r "$keys" -q --csv 2>"$TMP/redis-benchmark.err")" || rc=$?
  # "SET","2061.86","1.517","0.112","0.911","4.959","9.343","14.215"
  line="$(printf '%s\n' "$out" | grep -i "^\"$test\"," | head -n1 || true)"
  if [[ $rc -ne 0 || -z $line ]]; then
    log "redis-benchmark $test $size x$clients -P $batch failed (exit $rc):"
    sed 's/^/  /' "$TMP/redis-benchmark.err" >&2; printf '%s\n' "$out" | sed 's/^/  /' >&2
    FAILED=1; REDIS_RPS=0; REDIS_RECORD=""; return 0
  fi
  REDIS_RPS="$(printf '%s\n' "$line" | awk -F'"' '{print $4}')"
  if [[ $round -gt 0 ]]; then
    # ops are requests (blocks); calls are pipelined round trips of BATCH
    # requests. redis-benchmark's latency of a request is its round trip's
    # time to the first reply byte.
    REDIS_RECORD="$(printf '%s\n' "$line" | awk -F'"' -v w="$( [[ $test == set ]] && echo put || echo get )" \
      -v r="$round" -v s="$size" -v c="$clients" -v b="$batch" -v k="$keys" -v n="$requests" '{
        rps = $4; printf "{\"side\":\"redis\",\"workload\":\"%s\",\"round\":%d,", w, r
        printf "\"working_set_keys\":%d,\"tool\":\"redis-benchmark\",\"op\":\"%s\",", k, tolower($2)
        printf "\"block_size\":%d,\"clients\":%d,\"batch\":%d,\"ops\":%d,", s, c, b, n
        printf "\"ops_unit\":\"block\",\"seconds\":%.6f,\"ops_per_sec\":%.3f,", n / rps, rps
        printf "\"calls_per_sec\":%.3f,\"gb_per_sec\":%.6f,", rps / b, rps * s / 1e9
        printf "\"latency_unit\":\"round trip, to the first reply byte\","
        printf "\"p50_us\":%.3f,\"p99_us\":%.3f,\"p999_us\":null,\"errors\":0}\n", $10 * 1000, $14 * 1000
      }')"
    log "  redis   round $round: $test $size x$clients -P $batch: $REDIS_RPS ops/s, $(awk -v r="$REDIS_RPS" -v s="$size" 'BEGIN{printf "%.3f", r * s / 1e9}') GB/s, p99 $(printf '%s\n' "$line" | awk -F'"' '{print $14}') ms"
  fi
}

# redis_round TEST SIZE CLIENTS BATCH KEYS ROUND: a measured Redis round of
# about $DURATION seconds. redis-benchmark stops after -n requests, sized from
# the last measured rate; a run that lasted under half of $DURATION (the rate
# rose since) is run again, sized from its own rate (at most twice), so Redis
# is not measured over shorter runs than kvdepot.
redis_round() {
  local test=$1 size=$2 clients=$3 batch=$4 keys=$5 round=$6 n attempt
  for ((attempt = 0; attempt < 3; attempt++)); do
    [[ $REDIS_RPS == 0 ]] && REDIS_RPS=100
    n="$(requests_for "$REDIS_RPS" "$DURATION" "$clients" "$batch")"
    REDIS_RECORD=""
    redis_run "$test" "$size" "$clients" "$batch" "$keys" "$n" "$round"
    [[ -n $REDIS_RECORD ]] || return 0
    awk -v n="$n" -v r="$REDIS_RPS" -v d="$DURATION" -v c="$clients" -v b="$batch" \
      'BEGIN{exit !(n / r >= d / 2 || n <= 10 * c * b)}' && break
    [[ $attempt -lt 2 ]] && log "  (that Redis run lasted under $DURATION / 2 s; running it again)"
  done
  echo "$REDIS_RECORD" >>"$RECORDS"
}

# requests_for RATE SECONDS CLIENTS BATCH: requests (-n counts requests, not
# round trips) for a Redis run of about SECONDS at RATE requests/s: at least
# 10 round trips per connection, rounded up to whole round trips.
requests_for() {
  awk -v r="$1" -v d="$2" -v c="$3" -v b="$4" 'BEGIN{
    n = int(r * d); if (n < 10 * c * b) n = 10 * c * b
    print int((n + b - 1) / b) * b }'
}

# Stores all KEYS keys in Redis (SET with -r hits keys at random: repeat until
# every one exists, so no GET misses).
redis_fill() {
  local size=$1 keys=$2 i
  for ((i = 0; i < 20; i++)); do
    [[ "$(rcli dbsize)" -ge $keys ]] && return 0
    redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -t set -d "$size" -c 4 -n $((keys * 2)) \
      -r "$keys" -q --csv >/dev/null 2>&1 || true
  done
  log "Redis holds $(rcli dbsize) of $keys keys after filling"; FAILED=1
}

# --- The comparison ------------------------------------------------------------

for size in $SIZES; do
  keys=$((WORKING_SET / size))
  ((keys < 8)) && keys=8
  ((keys > 1024)) && keys=1024
  for clients in $CLIENTS; do
    for batch in $BATCHES; do
      rcli flushall >/dev/null
      for workload in put get; do
        test=$([[ $workload == put ]] && echo set || echo get)
        if [[ $workload == get && $batch -gt $keys ]]; then
          # A kvdepot get batch reads distinct keys of the working set.
          log "get $size bytes batch $batch: skipped, the working set has only $keys keys"
          continue
        fi
        log "$workload $size bytes x$clients clients batch $batch (working set $keys keys)"
        [[ $workload == get ]] && redis_fill "$size" "$keys"
        # Warm-up (also stores kvdepot's working set, and measures Redis's
        # rate to size its runs).
        kvdepot_run "$workload" "$size" "$clients" "$batch" "$keys" "$WARMUP" 0
        redis_run "$test" "$size" "$clients" "$batch" "$keys" \
          "$(requests_for "$(awk -v s="$size" 'BEGIN{print 1e9 / s}')" "$WARMUP" "$clients" "$batch")" 0
        for ((round = 1; round <= ROUNDS; round++)); do
          kvdepot_run "$workload" "$size" "$clients" "$batch" "$keys" "$DURATION" "$round"
          redis_round "$test" "$size" "$clients" "$batch" "$keys" "$round"
        done
      done
    done
  done
done

# --- Report ------------------------------------------------------------------

mkdir -p "$(dirname "$OUT")"
"$PYTHON" - "$RECORDS" "$OUT" "$DURATION" "$ROUNDS" "$WORKING_SET" "$DRAM_CAPACITY" \
  "$("$KVDEPOTD" --version 2>/dev/null || echo unknown)" "$(redis-server --version)" <<'EOF'
import json, os, sys, time, platform

records_path, out_path, duration, rounds, working_set, dram, kvd_ver, redis_ver = sys.argv[1:9]
runs = [json.loads(line) for line in open(records_path) if line.strip()]

def case_of(r):
    return (r["workload"], r["block_size"], r["clients"], r["batch"])

cases = []  # (workload, block_size, clients, batch) in the order they ran
for r in runs:
    case = case_of(r)
    if case not in cases:
        cases.append(case)

def side_summary(rs):
    if not rs:
        return None
    best = max(rs, key=lambda r: r["gb_per_sec"] if r["workload"] != "lookup" else r["ops_per_sec"])
    keep = ("ops_per_sec", "calls_per_sec", "gb_per_sec", "p50_us", "p99_us",
            "p999_us", "errors")
    summary = {k: best[k] for k in keep}
    summary["latency_unit"] = best["latency_unit"]
    if "transport" in best:
        summary["transport"] = best["transport"]
    summary["rounds"] = [{k: r[k] for k in ("round", "ops", "seconds") + keep} for r in rs]
    return summary

results = []
for workload, size, clients, batch in cases:
    rs = [r for r in runs if case_of(r) == (workload, size, clients, batch)]
    kvd = side_summary([r for r in rs if r["side"] == "kvdepot"])
    red = side_summary([r for r in rs if r["side"] == "redis"])
    ratio = None
    if kvd and red and red["gb_per_sec"] > 0:
        ratio = kvd["gb_per_sec"] / red["gb_per_sec"]
    results.append({
        "workload": workload, "block_size": size, "clients": clients,
        "batch": batch, "working_set_keys": rs[0]["working_set_keys"],
        "kvdepot": kvd, "redis": red,
        "ratio_gb_per_sec": None if ratio is None else round(ratio, 4),
    })

report = {
    "tool": "compare_redis",
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "host": platform.node(),
    "kvdepotd": kvd_ver.strip(),
    "redis": redis_ver.strip(),
    "method": "warm-up, then A B A B (kvdepot, redis) per workload; each side's "
              "figures are its best round (highest GB/s); all rounds listed",
    "batch": "blocks per round trip: kvdepot-bench --batch B (B blocks in one "
             "Get/Put call), redis-benchmark -P B (B requests pipelined)",
    "ops": "blocks (ops_per_sec, gb_per_sec); calls_per_sec = round trips/s",
    "latency": "kvdepot: per call, whole batch; redis: per round trip, to the "
               "first reply byte (redis-benchmark)",
    "ucx_tls": os.environ.get("UCX_TLS") or "auto",
    "duration_s": float(duration),
    "rounds": int(rounds),
    "working_set_bytes": int(working_set),
    "kvdepot_dram_capacity": dram,
    "kvdepot_nvme_capacity": os.environ.get("KVD_NVME_CAPACITY", ""),
    "gb": "1e9 bytes",
    "ratio": "kvdepot GB/s / redis GB/s",
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
          "redis GB/s", "ratio", "kvdepot p99 us", "redis p99 us")
rows = []
for r in results:
    k, d = r["kvdepot"] or {}, r["redis"] or {}
    rows.append((r["workload"], size_name(r["block_size"]), str(r["clients"]),
                 str(r["batch"]), via(k.get("transport")),
                 fmt(k.get("gb_per_sec"), ".3f"), fmt(d.get("gb_per_sec"), ".3f"),
                 fmt(r["ratio_gb_per_sec"], ".2f"), fmt(k.get("p99_us"), ".0f"),
                 fmt(d.get("p99_us"), ".0f")))
widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
          for i, h in enumerate(header)]
print(f"kvdepot vs Redis, best of {rounds} rounds of {duration} s "
      f"(GB = 1e9 bytes; ratio = kvdepot / redis)")
print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
for row in rows:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
print("batch: blocks per round trip (kvdepot --batch, redis -P); p99: kvdepot "
      "per call, redis per round trip to the first reply byte")
print(f"JSON: {out_path}")
EOF

if [[ $FAILED -ne 0 ]]; then
  log "some runs failed; see the messages above"
  exit 1
fi
