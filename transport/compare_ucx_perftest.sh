#!/usr/bin/env bash
# compare_ucx_perftest.sh: kvdepot_transport's one-sided GET against UCX's
# own limit, ucx_perftest (ucx-utils), side by side in one run with the same
# UCX settings (see ../shared/BENCHMARKS.md and transport/README.md).
#
# For each transport (tcp: UCX_TLS=tcp over lo with 512k TCP segments;
# shm: UCX_TLS=shm,tcp, shared memory chosen) and each client count:
#   A  ucx_bench: a server process registers a 64 MiB region; N client
#      threads, each with its own worker and endpoint, read random 256 KiB
#      blocks in batches of 8 for --seconds.
#   B  ucx_perftest -t ucp_get -s 262144 -O 8: P server/client process
#      pairs at once, as many gets in all as A managed.
# With --through kvdepotd, the whole daemon instead (issue 4's figure):
#   A  kvdepotd (memory only) and kvdepot-bench --op get --clients N
#      --batch 16: per call, lookup + pin + the daemon's puts into the
#      client's buffer + unpin + the client's checksum check;
#   B  ucx_perftest -t ucp_put_bw -s 262144 -O 16, P pairs.
#   --depth D (kvdepotd only): kvdepot-bench keeps D calls of 16/D blocks
#   in flight per client instead of one of 16, so that, like perftest's
#   16 outstanding puts, the next blocks are on their way while a call's
#   reply and checksum check are handled (an engine loading layer by layer
#   overlaps its calls so too); the same 16 blocks in flight.
# Side B's pair counts P: 1, 2, 4, ... up to min(N, the machine's cores),
# and that maximum; B's figure is its best over them. Every pair is two
# busy-polling processes, so N pairs on fewer cores than 2N measure the
# scheduler, not UCX: with 4 clients on 2 cores, 4 pairs are 8 spinning
# processes, and the perftest side came out far below what 1 pair does.
# The table and the JSON name the pair count that gave B's best.
# Rounds alternate A B A B; each side's figure is its best round. Prints a
# table with the ratio A/B and writes JSON (default
# transport/results/compare_ucx_perftest.json, or
# compare_ucx_perftest_kvdepotd.json with --through kvdepotd).
#
#   transport/compare_ucx_perftest.sh [--seconds 3] [--rounds 2]
#       [--threads "1 4"] [--transports "tcp shm"] [--build DIR]
#       [--through transport|kvdepotd] [--depth 1|2|4|8|16] [--out FILE] [--smoke]
#
# Exit 0 when every run succeeded, 1 when one failed, 2 for usage errors,
# 77 when ucx_perftest is not installed (ctest reports a skip).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$REPO/build"
SECONDS_PER_RUN=3
ROUNDS=2
THREADS="1 4"
TRANSPORTS="tcp shm"
OUT=""
SMOKE=0
THROUGH=transport
BLOCK=262144
BATCH=8
DEPTH=1

die_usage() { echo "compare_ucx_perftest.sh: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) SECONDS_PER_RUN="${2:?}"; shift 2 ;;
    --rounds) ROUNDS="${2:?}"; shift 2 ;;
    --threads) THREADS="${2:?}"; shift 2 ;;
    --transports) TRANSPORTS="${2:?}"; shift 2 ;;
    --build) BUILD="${2:?}"; shift 2 ;;
    --out) OUT="${2:?}"; shift 2 ;;
    --through) THROUGH="${2:?}"; shift 2 ;;
    --depth) DEPTH="${2:?}"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die_usage "unknown argument: $1" ;;
  esac
done
if [[ $SMOKE -eq 1 ]]; then
  SECONDS_PER_RUN=1; ROUNDS=1; THREADS=1; TRANSPORTS=tcp
  [[ -n $OUT ]] || OUT="$BUILD/transport/compare_ucx_perftest_${THROUGH}_smoke.json"
fi
case "$THROUGH" in
  transport) [[ -n $OUT ]] || OUT="$REPO/transport/results/compare_ucx_perftest.json" ;;
  kvdepotd)
    BATCH=16
    [[ -n $OUT ]] || OUT="$REPO/transport/results/compare_ucx_perftest_kvdepotd.json" ;;
  *) die_usage "--through must be transport or kvdepotd" ;;
esac
case "$DEPTH" in
  1) ;;
  2|4|8|16) [[ $THROUGH == kvdepotd ]] || die_usage "--depth is for --through kvdepotd" ;;
  *) die_usage "--depth must be 1, 2, 4, 8 or 16" ;;
esac
KV_BATCH=$((BATCH / DEPTH))  # kvdepot-bench's blocks per call
# ucx_perftest's side: the operation kvdepot's GET is made of.
PERFTEST_OP=ucp_get
[[ $THROUGH == kvdepotd ]] && PERFTEST_OP=ucp_put_bw
command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 77; }
BENCH="$BUILD/transport/ucx_bench"
KVDEPOTD="$BUILD/server/kvdepotd"
KVBENCH="$BUILD/tools/kvdepot-bench"
if [[ $THROUGH == kvdepotd ]]; then
  for tool in "$KVDEPOTD" "$KVBENCH"; do
    [[ -x $tool ]] || die_usage "$tool not built (ninja -C $BUILD kvdepotd kvdepot-bench)"
  done
else
  [[ -x $BENCH ]] || die_usage "$BENCH not built (ninja -C $BUILD ucx_bench)"
fi
mkdir -p "$(dirname "$OUT")"
WORK="$(mktemp -d)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

# The UCX settings of a transport, as environment assignments; the same as
# ucx_test::TransportConfig, which ucx_bench uses.
ucx_env() {
  case "$1" in
    tcp) echo "UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_TCP_TX_SEG_SIZE=512k UCX_TCP_RX_SEG_SIZE=512k" ;;
    shm) echo "UCX_TLS=shm,tcp UCX_NET_DEVICES=lo" ;;
  esac
}

# run_perftest TRANSPORT PAIRS ITERS: prints the summed GB/s of PAIRS
# concurrent ucx_perftest pairs, or "fail".

# pair_counts CLIENTS: the pair counts side B runs for CLIENTS clients: 1,
# 2, 4, ... up to min(CLIENTS, cores), and that maximum.
CORES="$(nproc 2>/dev/null || echo 1)"
pair_counts() {
  local max=$1 p=1 out=""
  ((max > CORES)) && max=$CORES
  ((max < 1)) && max=1
  while ((p < max)); do out+="$p "; p=$((p * 2)); done
  echo "$out$max"
}
run_perftest() {
  local transport=$1 pairs=$2 iters=$3 env port i total=0 mbs
  env="$(ucx_env "$transport")"
  local base_port=$((20000 + RANDOM % 20000))
  for ((i = 0; i < pairs; i++)); do
    port=$((base_port + i))
    env $env timeout 120 ucx_perftest -t $PERFTEST_OP -s $BLOCK -O $BATCH -n "$iters" \
      -w 50 -p "$port" -f >"$WORK/server.$i" 2>&1 &
    PIDS+=($!)
  done
  sleep 1
  local clients=()
  for ((i = 0; i < pairs; i++)); do
    port=$((base_port + i))
    env $env timeout 120 ucx_perftest 127.0.0.1 -t $PERFTEST_OP -s $BLOCK -O $BATCH \
      -n "$iters" -w 50 -p "$port" -f >"$WORK/client.$i" 2>&1 &
    clients+=($!)
  done
  local ok=1
  for p in "${clients[@]}"; do wait "$p" || ok=0; done
  wait || true
  PIDS=()
  [[ $ok -eq 1 ]] || { echo fail; return; }
  for ((i = 0; i < pairs; i++)); do
    # Final line: iterations, latency 50%/average/overall (us), bandwidth
    # average/overall (MB/s of 2^20 bytes), message rate average/overall.
    mbs="$(awk 'NF == 8 && $1 ~ /^[0-9]+$/ {v = $6} END {print v}' "$WORK/client.$i")"
    [[ -n $mbs ]] || { echo fail; return; }
    total="$(awk -v a="$total" -v b="$mbs" 'BEGIN {printf "%.6f", a + b * 1048576 / 1e9}')"
  done
  echo "$total"
}

# start_kvdepotd TRANSPORT: a memory-only kvdepotd with the transport's UCX
# settings; sets KVD (its address) and KVD_PID.
KVD_PID=""
start_kvdepotd() {
  local env port i
  env="$(ucx_env "$1")"
  : >"$WORK/kvdepotd.log"  # read by the port loop before the daemon opens it
  env $env "$KVDEPOTD" --listen 127.0.0.1:0 --metrics-listen "" \
    --data-dir "$WORK/kvdepot-$1" --dram-capacity 1GiB --nvme-capacity 0 \
    2>"$WORK/kvdepotd.log" &
  KVD_PID=$!
  PIDS+=("$KVD_PID")
  for ((i = 0; i < 600; i++)); do  # up to 60 s (a loaded host)
    port="$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$WORK/kvdepotd.log" | head -n1)"
    [[ -n $port ]] && break
    sleep 0.1
  done
  [[ -n $port ]] || { cat "$WORK/kvdepotd.log" >&2; die_usage "kvdepotd did not start"; }
  KVD="127.0.0.1:$port"
}
stop_kvdepotd() {
  kill "$KVD_PID" 2>/dev/null || true
  wait "$KVD_PID" 2>/dev/null || true
  PIDS=()
}

# run_a TRANSPORT THREADS: side A's JSON line (gb_per_s or gb_per_sec).
run_a() {
  if [[ $THROUGH == kvdepotd ]]; then
    env $(ucx_env "$1") "$KVBENCH" --server "$KVD" --op get --clients "$2" \
      --batch $KV_BATCH --depth $DEPTH --block-size $BLOCK \
      --duration "$SECONDS_PER_RUN" --json
  else
    "$BENCH" --transport "$1" --threads "$2" \
      --seconds "$SECONDS_PER_RUN" --batch $BATCH --block-size $BLOCK
  fi
}

failed=0
rows=()
json_rows=()
echo "perftest: best over 1..min(clients, $CORES cores) ucx_perftest pairs (pairs = the count that gave it)"
printf '%-9s %-7s %-12s %-13s %-5s %-8s\n' transport clients kvdepot_GB/s perftest_GB/s pairs ratio
for transport in $TRANSPORTS; do
  [[ $THROUGH == kvdepotd ]] && start_kvdepotd "$transport"
  for threads in $THREADS; do
    pairs_list="$(pair_counts "$threads")"
    best_a=0 best_b=0 best_pairs=0 rounds_json=""
    for ((r = 1; r <= ROUNDS; r++)); do
      a_json="$(run_a "$transport" "$threads" 2>"$WORK/bench.err" | tail -1)" || a_json=""
      a="$(sed -n 's/.*"gb_per_s\(ec\)\{0,1\}": *\([0-9.]*\).*/\2/p' <<<"$a_json")"
      if [[ -z $a ]]; then failed=1; a=0; cat "$WORK/bench.err" >&2; fi
      b_json=""
      for pairs in $pairs_list; do
        # As many gets in all as the kvdepot clients made, split over the
        # pairs.
        iters="$(awk -v g="$a" -v t="$pairs" -v s="$SECONDS_PER_RUN" -v b=$BLOCK \
          'BEGIN {n = int(g * 1e9 * s / t / b); if (n < 200) n = 200; print n}')"
        b="$(run_perftest "$transport" "$pairs" "$iters")"
        if [[ $b == fail ]]; then failed=1; b=0; fi
        if awk -v x="$best_b" -v y="$b" 'BEGIN {exit !(y > x)}'; then
          best_b=$b best_pairs=$pairs
        fi
        b_json+="${b_json:+, }{\"pairs\": $pairs, \"gb_per_s\": $b}"
      done
      best_a="$(awk -v x="$best_a" -v y="$a" 'BEGIN {print (y > x) ? y : x}')"
      rounds_json+="${rounds_json:+, }{\"round\": $r, \"kvdepot_gb_per_s\": $a, \"perftest\": [$b_json]}"
    done
    ratio="$(awk -v a="$best_a" -v b="$best_b" 'BEGIN {if (b > 0) printf "%.2f", a / b; else print "n/a"}')"
    printf '%-9s %-7s %-12.3f %-13.3f %-5s %-8s\n' "$transport" "$threads" "$best_a" "$best_b" "$best_pairs" "$ratio"
    json_rows+=("{\"transport\": \"$transport\", \"ucx\": \"$(ucx_env "$transport")\", \"clients\": $threads, \"block_size\": $BLOCK, \"batch\": $BATCH, \"kvdepot_batch\": $KV_BATCH, \"kvdepot_depth\": $DEPTH, \"kvdepot_gb_per_s\": $best_a, \"perftest_gb_per_s\": $best_b, \"perftest_pairs\": $best_pairs, \"perftest_pair_counts\": \"$pairs_list\", \"ratio\": \"$ratio\", \"rounds\": [$rounds_json]}")
  done
  [[ $THROUGH == kvdepotd ]] && stop_kvdepotd
done
{
  if [[ $THROUGH == kvdepotd ]]; then
    workload="kvdepot GET through kvdepotd (kvdepot-bench, batch $KV_BATCH, depth $DEPTH) vs ucx_perftest $PERFTEST_OP -O $BATCH, 256 KiB blocks, loopback"
  else
    workload="one-sided GET, 256 KiB blocks, loopback"
  fi
  echo "{\"workload\": \"$workload\", \"ucx_version\": \"$(ucx_info -v | sed -n 's/^# Version //p')\", \"seconds\": $SECONDS_PER_RUN, \"cores\": $CORES, \"baseline\": \"ucx_perftest: the best over 1, 2, 4, ... up to min(clients, cores) concurrent pairs (perftest_pairs: the count that gave it); more pairs than cores oversubscribe the machine (two busy-polling processes a pair)\", \"results\": ["
  (IFS=,; echo "${json_rows[*]}")
  echo "]}"
} >"$OUT"
echo "JSON: $OUT"
exit $failed
