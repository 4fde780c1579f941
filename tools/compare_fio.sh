#!/usr/bin/env bash
# compare_fio.sh: the NVMe tier module against the disk's limit (fio) and
# RocksDB's db_bench, side by side on one file system (see
# ../shared/BENCHMARKS.md, "How a benchmark reports", and issue 3).
#
# Every side works in one temporary directory under --dir (default /tmp):
#   write  fio sequential write, 1 MiB, direct, iodepth 16, of --size bytes
#          vs nvme-tier-bench --op fill: --size / 256 KiB blocks of 256 KiB
#             put into a fresh tier, then Flush (included in its time)
#          vs db_bench fillrandom,flush, value 262144, default options
#   read   fio randread, 256 KiB, direct, iodepth 16, over that file
#          vs nvme-tier-bench --op randread, --threads (default 16) threads
#             of NvmeTier::Read over the filled tier
#          vs db_bench readrandom, value 262144, --threads threads,
#             --use_direct_reads=1 (its keys repeat: buffered, most of its
#             reads came from the page cache, 0.17 device bytes per byte)
# Rounds alternate the sides (fio, kvdepot, db_bench, fio, kvdepot, ...):
# round r writes all sides, then reads them, then deletes its files, so the
# disk holds at most about 2 x --size at a time. The page cache is dropped
# (sync; echo 3 > /proc/sys/vm/drop_caches) before every measured run; both
# fio and nvme-tier-bench read each block at most once per run (fio's random
# map; the bench's random permutation), and a read run ends after --duration
# seconds or one pass over the data, whichever comes first. Where the cache
# cannot be dropped (not root, or --no-drop-caches: it drops the whole
# machine's cache), the tier is read with O_DIRECT (nvme-tier-bench
# --direct-reads), as fio reads: its blocks, just written, would otherwise
# come from memory. Whatever the mode, a read side whose best round took
# under 0.9 device bytes per byte returned (page-cache hits) makes the read
# ratios against it INVALID and the script exit 1. Each side's figure is its
# BEST round (highest GB/s); every round is kept in the JSON, with the bytes
# the block device read and wrote during it. The ratios to fio are also
# given round by round ("round by round", JSON ratios_by_round): on a disk
# whose speed swings between rounds, best against best can compare a fast
# round of one side with a slow round of the other.
#
# The kvdepotd (demotion) row stops its clock when the demoted blocks are
# durable: after demotion stops, kvdepotd is stopped (SIGTERM,
# --persist-on-shutdown false) and closing its NVMe tier flushes the
# memtables (use_wal=false: until then the last blocks are in memory only),
# as fio's write ends with its fsync. The clock runs to the later of the
# last demotion and the daemon's last write (a timer flush of the tier),
# plus the daemon's time from SIGTERM to exit; the idle polling that
# detects the end of demotion is not counted.
#
#   tools/compare_fio.sh [--dir /tmp] [--size 8GiB] [--duration 10]
#       [--rounds 2] [--threads 16] [--ioengine libaio] [--db-bench "default blob"]
#       [--no-drop-caches] [--build DIR] [--out FILE] [--smoke]
#
# Prints a table and writes JSON (default tools/results/compare_fio.json).
# Removes everything it created on exit. Exit 0 when every run succeeded, 1
# when a run failed (the table still shows what was measured), 2 for usage
# errors, 77 when fio is not installed (ctest reports the smoke as skipped).
# Needs: the nvme-tier-bench build, fio (apt-get install fio), python3
# (standard library); db_bench (Debian rocksdb-tools) for the third column,
# skipped with a note when missing; root for drop_caches (without it, or
# with --no-drop-caches, the tier is read with O_DIRECT: the JSON says so).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$REPO/build"
DIR=/tmp
SIZE=8GiB
DURATION=10
ROUNDS=2
THREADS=16
IOENGINE=libaio
DB_BENCH_VARIANTS="default blob"
OUT=""
SMOKE=0
NO_DROP=0
BLOCK=262144

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --dir DIR            file system to measure: a temporary directory is made
                       under DIR and removed at the end (default /tmp)
  --size SIZE          bytes per side: fio file, tier data, db_bench values
                       (default 8GiB; K/M/G/KiB/MiB/GiB)
  --duration S         most seconds per read run (default 10)
  --rounds N           rounds of A B (C) (default 2)
  --threads N          kvdepot and db_bench read threads (default 16, as fio's
                       iodepth)
  --ioengine E         fio engine: libaio or io_uring (default libaio)
  --db-bench "V ..."   db_bench variants: default (RocksDB defaults), blob
                       (--enable_blob_files=1); "" for none
                       (default "default blob")
  --no-drop-caches     never write /proc/sys/vm/drop_caches (it empties the
                       whole machine's page cache); the tier is then read
                       with O_DIRECT (nvme-tier-bench --direct-reads)
  --build DIR          build directory with tools/nvme-tier-bench
                       (default <repo>/build)
  --out FILE           JSON output (default tools/results/compare_fio.json;
                       with --smoke, <build>/tools/compare_fio_smoke.json)
  --smoke              tiny run for CI: 64 MiB, 1 s, 2 rounds, 4 threads
EOF
}

die_usage() { echo "compare_fio.sh: $*" >&2; echo "Run with --help for more information." >&2; exit 2; }
need_value() { [[ $# -ge 2 ]] || die_usage "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) need_value "$@"; DIR="$2"; shift 2 ;;
    --size) need_value "$@"; SIZE="$2"; shift 2 ;;
    --duration) need_value "$@"; DURATION="$2"; shift 2 ;;
    --rounds) need_value "$@"; ROUNDS="$2"; shift 2 ;;
    --threads) need_value "$@"; THREADS="$2"; shift 2 ;;
    --ioengine) need_value "$@"; IOENGINE="$2"; shift 2 ;;
    --db-bench) need_value "$@"; DB_BENCH_VARIANTS="$2"; shift 2 ;;
    --build) need_value "$@"; BUILD="$2"; shift 2 ;;
    --out) need_value "$@"; OUT="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --no-drop-caches) NO_DROP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown argument: $1" ;;
  esac
done
if [[ $SMOKE -eq 1 ]]; then
  SIZE=64MiB; DURATION=1; ROUNDS=2; THREADS=4
  [[ -n $OUT ]] || OUT="$BUILD/tools/compare_fio_smoke.json"
fi
[[ -n $OUT ]] || OUT="$REPO/tools/results/compare_fio.json"

# --size in bytes, a whole number of 1 MiB (fio's write block) and so of
# 256 KiB blocks.
size_bytes() {
  awk -v s="$1" 'BEGIN{
    s = tolower(s); n = s; sub(/[a-z]+$/, "", n); u = substr(s, length(n) + 1)
    f["" ] = 1; f["b"] = 1; f["k"] = 1024; f["kib"] = 1024; f["kb"] = 1e3
    f["m"] = 1048576; f["mib"] = 1048576; f["mb"] = 1e6
    f["g"] = 1073741824; f["gib"] = 1073741824; f["gb"] = 1e9
    if (n !~ /^[0-9]+([.][0-9]+)?$/ || !(u in f)) exit 1
    printf "%.0f", n * f[u] }'
}
SIZE_BYTES="$(size_bytes "$SIZE")" || die_usage "--size: \"$SIZE\" is not a size"
SIZE_BYTES=$((SIZE_BYTES / 1048576 * 1048576))
((SIZE_BYTES >= 4 * 1048576)) || die_usage "--size: at least 4MiB"
BLOCKS=$((SIZE_BYTES / BLOCK))
is_uint() { [[ $1 =~ ^[0-9]+$ ]] && [[ $1 -gt 0 ]]; }
[[ $DURATION =~ ^[0-9]+$ && $DURATION -gt 0 ]] ||
  die_usage "--duration: \"$DURATION\" is not a positive whole number of seconds"
is_uint "$ROUNDS" || die_usage "--rounds: \"$ROUNDS\" is not a positive integer"
is_uint "$THREADS" && [[ $THREADS -le 256 ]] || die_usage "--threads: \"$THREADS\" is not in 1..256"
[[ $IOENGINE == libaio || $IOENGINE == io_uring ]] || die_usage "--ioengine: libaio or io_uring"
for v in $DB_BENCH_VARIANTS; do
  [[ $v == default || $v == blob ]] || die_usage "--db-bench: \"$v\" is not default or blob"
done
[[ -d $DIR ]] || die_usage "--dir: $DIR is not a directory"

BENCH="$BUILD/tools/nvme-tier-bench"
PYTHON=/usr/bin/python3
[[ -x $PYTHON ]] || PYTHON="$(command -v python3 || true)"
[[ -n $PYTHON ]] || { echo "compare_fio.sh: python3 not found" >&2; exit 1; }
[[ -x $BENCH ]] || { echo "compare_fio.sh: $BENCH not found; build it: cd build && ninja nvme-tier-bench" >&2; exit 1; }
if ! command -v fio >/dev/null; then
  echo "compare_fio.sh: fio not found (apt-get install fio): skipped" >&2
  exit 77
fi
DB_BENCH="$(command -v db_bench || true)"
if [[ -z $DB_BENCH && -n $DB_BENCH_VARIANTS ]]; then
  echo "compare_fio.sh: db_bench not found (Debian rocksdb-tools): its column is left out" >&2
  DB_BENCH_VARIANTS=""
fi

log() { echo "compare_fio.sh: $*" >&2; }

# Room for the fio file and the tier (and compaction's temporary files in
# db_bench's round), plus 2 GiB for everyone else.
avail=$(($(df -Pk "$DIR" | awk 'NR == 2 {print $4}') * 1024))
need=$((SIZE_BYTES * 5 / 2 + (2 << 30)))
if ((avail < need)); then
  log "$DIR has $((avail >> 20)) MiB free, this run needs about $((need >> 20)) MiB: use a smaller --size or another --dir"
  exit 1
fi

# --- Everything created here is removed here ----------------------------------

TMP="$(mktemp -d "$DIR/compare_fio.XXXXXX")"
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A private copy of the bench: the build directory may be shared, and a
# rebuild during the run would swap the binary under it.
cp "$BENCH" "$TMP/nvme-tier-bench"
BENCH="$TMP/nvme-tier-bench"
# The daemon side (demotion through kvdepotd) needs kvdepotd, kvdepot-bench
# and kvdepotctl; without them it is left out.
DAEMON_SIDE=1
for tool in server/kvdepotd tools/kvdepot-bench client/kvdepotctl; do
  if [[ -x $BUILD/$tool ]]; then cp "$BUILD/$tool" "$TMP/"; else DAEMON_SIDE=0; fi
done
[[ $DAEMON_SIDE -eq 1 ]] || log "kvdepotd, kvdepot-bench or kvdepotctl is not built: the kvdepotd (demotion) side is left out"
# DRAM tier of the daemon side: an eighth of --size (at least 32 MiB), so
# most blocks are demoted to NVMe while they are put.
DEMOTE_DRAM=$((SIZE_BYTES / 8 > (32 << 20) ? SIZE_BYTES / 8 : (32 << 20)))

# demote.sh DIR BLOCKS: kvdepotd with a DRAM tier of DEMOTE_DRAM
# bytes and an NVMe tier under DIR; kvdepot-bench puts BLOCKS blocks of
# 256 KiB (2 clients, 16 blocks per call, UCX where it connects), then the
# daemon's demotion counter is polled (every 0.1 s) until it stops moving,
# and the daemon is stopped (SIGTERM; --persist-on-shutdown false, so the
# blocks left in DRAM are dropped, not written): closing its NVMe tier
# flushes the memtables, and only then are the demoted blocks durable (the
# tier runs without a WAL). On stdout: the bench's JSON with "demotion":
# {"blocks", "seconds", ...}, the blocks demoted to NVMe and the time from
# the first put until they were durable (what the row reports: the blocks
# left in DRAM never reach the disk, so the put rate alone would overstate
# what was written). That time is the later of the last demotion and the
# daemon's last write (write_bytes of /proc/PID/io, which counts its
# background threads' writes too, sampled at every poll: a rise of 64 KiB
# or more, more than its log lines, is a write), plus the daemon's time from
# SIGTERM to exit (the flush); so the idle polling that detects the end is
# not counted, and a memtable flush the tier's timer makes during it is.
# When /proc/PID/io cannot be read, the clock runs to the daemon's exit.
# On stderr, the daemon's stats once demotion stopped.
cat >"$TMP/demote.sh" <<EOF
#!/usr/bin/env bash
set -euo pipefail
dir=\$1 blocks=\$2
mkdir -p "\$dir"
: >"\$dir/kvdepotd.log"  # read by the port loop before the daemon opens it
"$TMP/kvdepotd" --listen 127.0.0.1:0 --metrics-listen "" --data-dir "\$dir/data" \\
  --dram-capacity $DEMOTE_DRAM --nvme-capacity \$((blocks * 262144 * 5 / 4 + (1 << 30))) \\
  --persist-on-shutdown false --hugepages off 2>"\$dir/kvdepotd.log" &
pid=\$!
trap 'kill -9 \$pid 2>/dev/null || true' EXIT
port=""
for _ in \$(seq 1 300); do
  port=\$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "\$dir/kvdepotd.log" | head -n1)
  [[ -n \$port ]] && break
  kill -0 \$pid 2>/dev/null || { cat "\$dir/kvdepotd.log" >&2; exit 1; }
  sleep 0.1
done
[[ -n \$port ]] || { echo "kvdepotd did not start" >&2; exit 1; }
devw() {  # bytes the daemon has written or dirtied for writing (-1: unknown)
  awk '/^write_bytes:/ {print \$2; found = 1} END {if (!found) print -1}' /proc/\$pid/io 2>/dev/null || echo -1
}
t0=\$(date +%s.%N)
"$TMP/kvdepot-bench" --server 127.0.0.1:\$port --op put --count "\$blocks" --batch 16 \\
  --clients 2 --block-size 262144 --json >"\$dir/bench.json"
demotions() {
  "$TMP/kvdepotctl" --server 127.0.0.1:\$port --json stats |
    "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["demotions"])'
}
# wrote: notes the daemon's write_bytes; a rise of 64 KiB or more since
# the last one noted moves t_wlast (its last write, seen at most a poll late).
wrote() {
  local w; w=\$(devw)
  if [[ \$w -lt 0 || \$w_prev -lt 0 ]]; then w_prev=-1; return; fi
  if ((w - w_prev >= 65536)); then w_prev=\$w t_wlast=\$(date +%s.%N); fi
}
w_prev=\$(devw) t_wlast=\$(date +%s.%N)
last=\$(demotions) t_last=\$(date +%s.%N) still=0
for _ in \$(seq 1 3000); do  # at most about 5 minutes
  sleep 0.1
  now=\$(demotions)
  wrote
  if [[ \$now == "\$last" ]]; then
    still=\$((still + 1))
    [[ \$still -ge 5 ]] && break  # unchanged for half a second
  else
    last=\$now t_last=\$(date +%s.%N) still=0
  fi
done
[[ \$still -ge 5 ]] || { echo "demotion did not settle" >&2; exit 1; }
"$TMP/kvdepotctl" --server 127.0.0.1:\$port stats >&2
# Durable: the daemon flushes its NVMe tier as it exits.
t_term=\$(date +%s.%N)
wrote
kill -TERM \$pid
rc=0
wait \$pid || rc=\$?
t_exit=\$(date +%s.%N)
trap - EXIT
if [[ \$rc -ne 0 ]]; then
  echo "kvdepotd exited with \$rc on SIGTERM (its NVMe tier may not be flushed); its log ends:" >&2
  tail -n 20 "\$dir/kvdepotd.log" >&2
  exit 1
fi
"$PYTHON" - "\$dir/bench.json" "\$last" "\$t0" "\$t_last" "\$t_wlast" "\$t_term" "\$t_exit" "\$w_prev" <<'PY'
import json, sys
d = json.loads(open(sys.argv[1]).read())
blocks = int(sys.argv[2])
t0, t_last, t_wlast, t_term, t_exit = map(float, sys.argv[3:8])
known = int(sys.argv[8]) >= 0
# The tier's work ends at the later of its last demotion and its last
# write (a timer flush may come after the last demotion), plus the flush
# at exit; the idle polling after that is the script's, not the tier's.
# Without the daemon's write counter, the clock runs to its exit.
work_end = max(t_last, t_wlast)
end = work_end + (t_exit - t_term) if known else t_exit
d["demotion"] = {
    "blocks": blocks, "seconds": end - t0,
    "clock_ends": ("last demotion or daemon write, plus its flush from SIGTERM to exit"
                   if known else "daemon exit (NVMe tier flushed)"),
    "settled_seconds": t_last - t0, "last_write_seconds": t_wlast - t0,
    "flush_on_exit_seconds": t_exit - t_term,
    "idle_polling_seconds": t_term - work_end, "idle_left_out": known,
}
print(json.dumps(d))
PY
EOF
chmod +x "$TMP/demote.sh"

DROP_OK=1
[[ $NO_DROP -eq 1 ]] && DROP_OK=0
drop_caches() {
  sync
  if [[ $DROP_OK -eq 1 ]] && ! { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null; then
    DROP_OK=0
    log "WARNING: cannot drop the page cache (needs root): the tier is read with O_DIRECT (--direct-reads)"
  fi
}
drop_caches

# The block device under $TMP: /sys/dev/block/MAJ:MIN/stat (sectors read and
# written are fields 3 and 7). Empty when there is none (overlayfs, tmpfs).
DEV_STAT="/sys/dev/block/$(stat -c '%Hd:%Ld' "$TMP")/stat"
[[ -r $DEV_STAT ]] || DEV_STAT=""
DEV_NAME="$( [[ -n $DEV_STAT ]] && sed -n 's/^DEVNAME=//p' "${DEV_STAT%/stat}/uevent" || echo unknown)"
dev_sample() {  # prints "read_bytes write_bytes"
  if [[ -n $DEV_STAT ]]; then awk '{printf "%.0f %.0f\n", $3 * 512, $7 * 512}' "$DEV_STAT"; else echo "0 0"; fi
}

RECORDS="$TMP/records.jsonl"  # one JSON object per measured run
: >"$RECORDS"
FAILED=0

# The parser of fio's JSON and db_bench's text: turns one run's output into
# a record line (side, workload, round, ops/s, GB/s, p50/p99/p999 us, ...).
cat >"$TMP/parse.py" <<'EOF'
import json, re, sys

kind, path, side, workload, rnd, block, dev_r, dev_w, wall, load = sys.argv[1:11]
rnd, block, dev_r, dev_w, wall = int(rnd), int(block), int(dev_r), int(dev_w), float(wall)
rec = {"side": side, "workload": workload, "round": int(rnd), "load": load}
text = open(path).read()
if kind == "fio":
    d = json.loads(text[text.index("{"):])
    j = d["jobs"][0]
    io = j["write" if workload == "write" else "read"]
    pct = io["clat_ns"].get("percentile", {})
    p = lambda k: pct[k] / 1e3 if k in pct else None
    rec.update(tool=d["fio version"],
               ops=io["total_ios"], seconds=io["runtime"] / 1e3,
               ops_per_sec=io["iops"], gb_per_sec=io["bw_bytes"] / 1e9,
               bytes=io["io_bytes"], latency_unit="io (clat)",
               p50_us=p("50.000000"), p99_us=p("99.000000"),
               p999_us=p("99.900000"), errors=j.get("error", 0))
elif kind in ("kvdepot", "kvdepotd"):
    # nvme-tier-bench and kvdepot-bench print the same fields.
    d = json.loads(text[text.index("{"):])
    tool = ("nvme-tier-bench" if kind == "kvdepot"
            else "kvdepotd + kvdepot-bench put (" + d["transport"] + ")")
    rec.update(tool=tool, ops=d["ops"], seconds=d["seconds"],
               ops_per_sec=d["ops_per_sec"], gb_per_sec=d["gb_per_sec"],
               bytes=d["ops"] * d["block_size"], latency_unit="call",
               p50_us=d["p50_us"], p99_us=d["p99_us"], p999_us=d["p999_us"],
               errors=d["errors"], detail=d)
    if kind == "kvdepotd":
        # Demotion throughput: the blocks that reached the NVMe tier over
        # the time from the first put until the last of them was demoted
        # (the put rate, which also counts the blocks that stay in DRAM,
        # is kept in detail).
        dem = d["demotion"]
        if dem["blocks"] <= 0 or dem["seconds"] <= 0:
            sys.exit("kvdepotd demoted nothing")
        moved = dem["blocks"] * d["block_size"]
        rec.update(ops=dem["blocks"], seconds=dem["seconds"],
                   ops_per_sec=dem["blocks"] / dem["seconds"],
                   gb_per_sec=moved / dem["seconds"] / 1e9, bytes=moved)
    if d.get("device"):  # nvme-tier-bench's own sample of its timed window
        dev_r, dev_w = d["device"]["read_bytes"], d["device"]["write_bytes"]
else:  # db_bench
    bench = "fillrandom" if workload == "write" else "readrandom"
    m = re.search(bench + r"\s*:\s*([\d.]+) micros/op (\d+) ops/sec ([\d.]+) seconds (\d+) operations;\s*([\d.]+) MB/s(?: \((\d+) of (\d+) found\))?", text)
    if not m:
        sys.exit("no " + bench + " line in db_bench's output")
    ops_s, secs, nops, mbs = float(m.group(2)), float(m.group(3)), int(m.group(4)), float(m.group(5))
    found = (int(m.group(6)), int(m.group(7))) if m.group(6) else None
    pm = re.search(r"Percentiles: P50: ([\d.]+) P75: [\d.]+ P99: ([\d.]+) P99.9: ([\d.]+)", text)
    frac = found[0] / found[1] if found and found[1] else 1.0
    if workload == "write":
        # End to end, as the tier's fill: the values written over the
        # process's whole time (fillrandom, then flush of the memtable).
        seconds = wall
        ops = nops
    else:
        # Only reads that found a value move a block (fillrandom draws keys
        # with repetition, so about 1 - 1/e of them exist).
        seconds = secs
        ops = nops * frac
    rec.update(tool="db_bench", ops=ops, seconds=seconds,
               ops_per_sec=ops / seconds if seconds else 0,
               gb_per_sec=ops * block / seconds / 1e9 if seconds else 0,
               bytes=ops * block, latency_unit="op",
               p50_us=float(pm.group(1)) if pm else None,
               p99_us=float(pm.group(2)) if pm else None,
               p999_us=float(pm.group(3)) if pm else None, errors=0,
               detail={"line": m.group(0), "db_bench_ops_per_sec": ops_s,
                       "db_bench_seconds": secs, "db_bench_mb_per_sec": mbs,
                       "found": list(found) if found else None,
                       "process_wall_s": wall})
rec["device_read_bytes"] = dev_r
rec["device_write_bytes"] = dev_w
moved = rec["bytes"]
dev_moved = dev_w if workload == "write" else dev_r
rec["device_bytes_per_byte"] = round(dev_moved / moved, 4) if moved else None
# What the device itself moved per second of the run (whole device): for
# reads, the disk's share, page-cache hits left out.
rec["device_gb_per_sec"] = round(dev_moved / rec["seconds"] / 1e9, 4) if rec["seconds"] else None
print(json.dumps(rec))
EOF

# measure KIND SIDE WORKLOAD ROUND -- COMMAND...: drops the page cache, runs
# COMMAND (its stdout to a file), samples the block device around it, and
# appends its record.
measure() {
  local kind=$1 side=$2 workload=$3 round=$4 out="$TMP/out.txt" rc=0 before after t0 t1 load
  shift 5
  drop_caches
  load="$(cut -d' ' -f1-3 /proc/loadavg)"
  before="$(dev_sample)"
  t0="$(date +%s.%N)"
  "$@" >"$out" 2>"$TMP/err.txt" || rc=$?
  t1="$(date +%s.%N)"
  after="$(dev_sample)"
  if [[ $rc -ne 0 ]]; then
    log "$side $workload round $round failed (exit $rc):"
    tail -n 20 "$TMP/err.txt" | sed 's/^/  /' >&2
    FAILED=1
    return 0
  fi
  local rec
  if ! rec="$("$PYTHON" "$TMP/parse.py" "$kind" "$out" "$side" "$workload" "$round" "$BLOCK" \
      "$(awk -v a="$before" -v b="$after" 'BEGIN{split(a, x); split(b, y); printf "%.0f", y[1] - x[1]}')" \
      "$(awk -v a="$before" -v b="$after" 'BEGIN{split(a, x); split(b, y); printf "%.0f", y[2] - x[2]}')" \
      "$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.6f", b - a}')" "$load" 2>"$TMP/parse.err")"; then
    log "$side $workload round $round: cannot read its output:"; sed 's/^/  /' "$TMP/parse.err" >&2
    tail -n 20 "$out" | sed 's/^/  /' >&2
    FAILED=1
    return 0
  fi
  echo "$rec" >>"$RECORDS"
  log "  $(printf '%-14s %-5s round %d' "$side" "$workload" "$round"): $(printf '%s\n' "$rec" | "$PYTHON" -c '
import json, sys; r = json.loads(sys.stdin.read())
f = lambda v: "-" if v is None else "%.0f" % v
print("%.3f GB/s, %.1f ops/s, p50 %s us, p99 %s us, device %.2f GB read %.2f GB written" % (
    r["gb_per_sec"], r["ops_per_sec"], f(r["p50_us"]), f(r["p99_us"]),
    r["device_read_bytes"] / 1e9, r["device_write_bytes"] / 1e9))')"
}

FIO_COMMON=(--name=compare --ioengine="$IOENGINE" --direct=1 --iodepth=16 --numjobs=1
  --size="$SIZE_BYTES" --output-format=json)
DB_COMMON=(--value_size="$BLOCK" --num="$BLOCKS" --compression_ratio=1 --histogram=1)

db_args() {  # db_args VARIANT: the variant's options
  case "$1" in
    default) ;;
    blob) echo "--enable_blob_files=1" ;;
  esac
}

# Sizes on disk after a fill: total bytes and the files by kind.
du_record() {  # du_record SIDE ROUND DIR
  "$PYTHON" - "$1" "$2" "$3" >>"$TMP/sizes.jsonl" <<'EOF'
import json, os, sys
side, rnd, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kinds = {}
for root, _, files in os.walk(d):
    for f in files:
        st = os.stat(os.path.join(root, f))
        ext = f.rsplit(".", 1)[-1] if "." in f else f.split("-")[0]
        k = kinds.setdefault(ext, {"files": 0, "bytes": 0, "largest": 0})
        k["files"] += 1; k["bytes"] += st.st_blocks * 512; k["largest"] = max(k["largest"], st.st_size)
print(json.dumps({"side": side, "round": rnd, "disk_bytes": sum(k["bytes"] for k in kinds.values()), "by_kind": kinds}))
EOF
}
: >"$TMP/sizes.jsonl"

LOAD_START="$(cat /proc/loadavg)"
log "dir $TMP on $DEV_NAME, $((SIZE_BYTES >> 20)) MiB per side ($BLOCKS blocks of 256 KiB), $ROUNDS rounds, load $LOAD_START"

for ((round = 1; round <= ROUNDS; round++)); do
  log "round $round: write"
  measure fio fio write "$round" -- fio "${FIO_COMMON[@]}" --rw=write --bs=1M --end_fsync=1 \
    --filename="$TMP/fio.dat"
  measure kvdepot kvdepot write "$round" -- "$BENCH" --path "$TMP/tier" --op fill \
    --block-size "$BLOCK" --blocks "$BLOCKS" --threads 1 --json
  [[ -d $TMP/tier ]] && du_record kvdepot "$round" "$TMP/tier"

  log "round $round: read"
  measure fio fio read "$round" -- fio "${FIO_COMMON[@]}" --rw=randread --bs=256k \
    --runtime="$DURATION" --filename="$TMP/fio.dat"
  # Without a cache drop, the blocks just written are in the page cache:
  # the tier then reads with O_DIRECT, as fio does.
  if [[ $DROP_OK -eq 1 ]]; then read_mode=(--drop-caches); else read_mode=(--direct-reads); fi
  measure kvdepot kvdepot read "$round" -- "$BENCH" --path "$TMP/tier" --op randread \
    --block-size "$BLOCK" --threads "$THREADS" --duration "$DURATION" "${read_mode[@]}" --json
  rm -rf "$TMP/fio.dat" "$TMP/tier"

  if [[ $DAEMON_SIDE -eq 1 ]]; then
    log "round $round: kvdepotd (demotion)"
    measure kvdepotd kvdepotd write "$round" -- "$TMP/demote.sh" "$TMP/daemon" "$BLOCKS"
    grep -E "^(dram|nvme):" "$TMP/err.txt" | sed 's/^/    kvdepotd once demotion stopped: /' >&2 || true
    rm -rf "$TMP/daemon"
  fi

  for v in $DB_BENCH_VARIANTS; do
    side="db_bench_$v"
    log "round $round: $side"
    # shellcheck disable=SC2046
    measure db_bench "$side" write "$round" -- "$DB_BENCH" --db="$TMP/db" \
      --benchmarks=fillrandom,flush "${DB_COMMON[@]}" $(db_args "$v")
    [[ -d $TMP/db ]] && du_record "$side" "$round" "$TMP/db"
    # shellcheck disable=SC2046
    measure db_bench "$side" read "$round" -- "$DB_BENCH" --db="$TMP/db" --use_existing_db=1 \
      --benchmarks=readrandom --threads="$THREADS" --duration="$DURATION" \
      --ops_between_duration_checks=1 --use_direct_reads=1 "${DB_COMMON[@]}" $(db_args "$v")
    rm -rf "$TMP/db"
  done
done
LOAD_END="$(cat /proc/loadavg)"

# --- Report --------------------------------------------------------------------

mkdir -p "$(dirname "$OUT")"
# Exits 3 (after writing the JSON and the table) when a read comparison is
# invalid: a read side served from the page cache.
REPORT_RC=0
"$PYTHON" - "$RECORDS" "$TMP/sizes.jsonl" "$OUT" "$SIZE_BYTES" "$DURATION" "$ROUNDS" "$THREADS" \
  "$IOENGINE" "$DROP_OK" "$DEV_NAME" "$DIR" "$LOAD_START" "$LOAD_END" \
  "$(fio --version)" "$( [[ -n $DB_BENCH ]] && echo "$DB_BENCH (Debian $(dpkg-query -W -f='${Package} ${Version}' rocksdb-tools 2>/dev/null || echo '?'))" || echo "not installed")" \
  "$SMOKE" "$DEV_STAT" <<'EOF' || REPORT_RC=$?
import json, platform, sys, time

(records_path, sizes_path, out_path, size, duration, rounds, threads, engine, drop_ok,
 dev, base_dir, load_start, load_end, fio_ver, db_ver, smoke, dev_stat) = sys.argv[1:18]
runs = [json.loads(l) for l in open(records_path) if l.strip()]
sizes = [json.loads(l) for l in open(sizes_path) if l.strip()]
sides = []
for r in runs:
    if r["side"] not in sides:
        sides.append(r["side"])

def summary(rs):
    if not rs:
        return None
    best = max(rs, key=lambda r: r["gb_per_sec"])
    keep = ("ops_per_sec", "gb_per_sec", "p50_us", "p99_us", "p999_us")
    s = {k: best[k] for k in keep}
    s["latency_unit"] = best["latency_unit"]
    s["mean_gb_per_sec"] = sum(r["gb_per_sec"] for r in rs) / len(rs)
    s["rounds"] = rs
    return s

results = {}
for w in ("write", "read"):
    results[w] = {side: summary([r for r in runs if r["side"] == side and r["workload"] == w])
                  for side in sides}

# A read side whose best round took fewer device bytes than it returned was
# served (partly) from the page cache: any read ratio with it compares
# memory with a disk. Only where the device's counters are known.
MIN_DEVICE_BYTES_PER_BYTE = 0.9
from_memory = {}
if dev_stat:
    for side, s in results["read"].items():
        if not s:
            continue
        best = max(s["rounds"], key=lambda r: r["gb_per_sec"])
        dbb = best.get("device_bytes_per_byte")
        if dbb is not None and dbb < MIN_DEVICE_BYTES_PER_BYTE:
            from_memory[side] = dbb
            s["served_from_page_cache"] = True

def ratio(w, a, b, key="gb_per_sec"):
    x, y = results[w].get(a), results[w].get(b)
    if not x or not y or not y[key]:
        return None
    if w == "read" and (a in from_memory or b in from_memory):
        return None
    return round(x[key] / y[key], 4)

ratios = {}
for w in ("write", "read"):
    for base in sides:
        if base == "kvdepot":
            continue
        ratios[f"{w}_kvdepot_over_{base}"] = ratio(w, "kvdepot", base)
        ratios[f"{w}_kvdepot_over_{base}_mean"] = ratio(w, "kvdepot", base, "mean_gb_per_sec")

# Round by round (the sides of a round run one after the other): a disk
# whose speed swings between rounds makes best-against-best mislead.
def per_round(w, a, b):
    ra = {r["round"]: r["gb_per_sec"] for r in runs if r["side"] == a and r["workload"] == w}
    rb = {r["round"]: r["gb_per_sec"] for r in runs if r["side"] == b and r["workload"] == w}
    return [round(ra[k] / rb[k], 4) for k in sorted(ra) if rb.get(k)]
ratios_by_round = {}
for w, a in (("write", "kvdepot"), ("read", "kvdepot"), ("write", "kvdepotd")):
    if a in sides and "fio" in sides and not (w == "read" and (a in from_memory or "fio" in from_memory)):
        ratios_by_round[f"{w}_{a}_over_fio"] = per_round(w, a, "fio")

# Issue 3's targets (best rounds).
targets = []
def target(name, value, goal, read_sides=()):
    bad = [s for s in read_sides if s in from_memory]
    t = {"target": name, "ratio": value, "goal": goal,
         "met": None if value is None else value >= goal}
    if bad:
        t["invalid"] = "reads served from the page cache: " + ", ".join(
            f"{s} {from_memory[s]:.2f} device bytes per byte" for s in bad)
    targets.append(t)
target("read: kvdepot tier randread / fio randread 256KiB qd16", ratios.get("read_kvdepot_over_fio"), 0.70,
       ("kvdepot", "fio"))
target("write: kvdepot tier fill / fio seq write 1MiB", ratios.get("write_kvdepot_over_fio"), 0.60)
if "kvdepotd" in sides:
    target("write: kvdepotd demotion (bytes reaching NVMe) / fio seq write 1MiB", ratio("write", "kvdepotd", "fio"), 0.60)
if "db_bench_default" in sides:
    target("read: kvdepot / db_bench default", ratios.get("read_kvdepot_over_db_bench_default"), 2.0,
           ("kvdepot", "db_bench_default"))
    target("write: kvdepot / db_bench default", ratios.get("write_kvdepot_over_db_bench_default"), 2.0)

report = {
    "tool": "compare_fio",
    "smoke": smoke == "1",
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "host": platform.node(),
    "dir": base_dir, "device": dev,
    "size_bytes": int(size), "block_size": 262144, "duration_s": int(duration),
    "rounds": int(rounds), "read_threads": int(threads),
    "fio": fio_ver.strip(), "fio_ioengine": engine, "db_bench": db_ver,
    "drop_caches": drop_ok == "1",
    "kvdepot_read_mode": "buffered, page cache dropped" if drop_ok == "1" else "O_DIRECT (--direct-reads): the page cache was not dropped",
    "reads_served_from_page_cache": from_memory,
    "min_device_bytes_per_byte_for_a_valid_read": MIN_DEVICE_BYTES_PER_BYTE if dev_stat else None,
    "load_start": load_start.strip(), "load_end": load_end.strip(),
    "sides": {
        "fio write": "fio --rw=write --bs=1M --direct=1 --iodepth=16 --end_fsync=1 --size=SIZE",
        "fio read": "fio --rw=randread --bs=256k --direct=1 --iodepth=16 --size=SIZE --runtime=DURATION (random map: each block once)",
        "kvdepot write": "nvme-tier-bench --op fill --threads 1: SIZE/256KiB puts into a fresh tier + Flush, no WAL",
        "kvdepotd write": "kvdepotd with a DRAM tier of SIZE/8 (at least 32 MiB) and an NVMe tier: kvdepot-bench --op put, 2 clients, 16 blocks of 256KiB per call, SIZE in all; the daemon's background threads demote most blocks to NVMe while the puts go on. GB/s: the blocks demoted to NVMe over the time from the first put until they were durable: demotion stopped (the daemon's demotion counter, polled every 0.1 s), then kvdepotd was stopped with SIGTERM (--persist-on-shutdown false) and closing its NVMe tier flushed the memtables; the clock runs to the later of the last demotion and the daemon's last write (/proc/PID/io write_bytes, sampled every poll), plus its time from SIGTERM to exit (detail.demotion); latency: the put calls; the put rate itself is in each round's detail",
        "kvdepot read": "nvme-tier-bench --op randread --threads T, with --drop-caches when the page cache is dropped, else --direct-reads (O_DIRECT, as fio): NvmeTier::Read of each block at most once, random order, XXH3 verified",
        "db_bench_default write": "db_bench --benchmarks=fillrandom,flush --value_size=262144 --num=SIZE/256KiB --compression_ratio=1 (defaults: WAL on, snappy, no BlobDB); GB/s over the process's wall time",
        "db_bench_default read": "db_bench --benchmarks=readrandom --use_existing_db --threads=T --duration=DURATION --ops_between_duration_checks=1 --use_direct_reads=1 (O_DIRECT, as fio: its keys repeat, and buffered its reads came mostly from the page cache); GB/s counts found keys only",
        "db_bench_blob": "the same with --enable_blob_files=1",
    },
    "method": ("page cache dropped before every run" if drop_ok == "1" else
               "page cache NOT dropped: the tier and db_bench read with O_DIRECT, as fio") +
              "; rounds alternate the sides; "
              "each side's figure is its best round (highest GB/s), mean_gb_per_sec "
              "is the mean over rounds; device_* bytes: the whole block device during "
              "the run (every process)",
    "gb": "1e9 bytes",
    "results": results,
    "ratios": ratios,
    "ratios_by_round": ratios_by_round,
    "issue3_targets": targets,
    "disk_usage_after_fill": sizes,
}
with open(out_path, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")

def fmt(v, spec):
    return "-" if v is None else format(v, spec)

header = ["workload", "side", "GB/s best", "GB/s mean", "ops/s", "p50 us", "p99 us",
          "dev bytes/byte", "dev GB/s", "kvdepot/side"]
rows = []
for w in ("write", "read"):
    for side in sides:
        s = results[w].get(side)
        if not s:
            continue
        best = max(s["rounds"], key=lambda r: r["gb_per_sec"])
        rows.append([w, side, fmt(s["gb_per_sec"], ".3f"), fmt(s["mean_gb_per_sec"], ".3f"),
                     fmt(s["ops_per_sec"], ".0f"), fmt(s["p50_us"], ".0f"), fmt(s["p99_us"], ".0f"),
                     fmt(best.get("device_bytes_per_byte"), ".2f"),
                     fmt(best.get("device_gb_per_sec"), ".3f"),
                     "1" if side == "kvdepot" else
                     ("INVALID" if w == "read" and ("kvdepot" in from_memory or side in from_memory)
                      else fmt(ratios.get(f"{w}_kvdepot_over_{side}"), ".2f"))])
widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
print(f"NVMe tier (in-process) vs fio{' and db_bench' if any(s.startswith('db_bench') for s in sides) else ''}: "
      f"{int(size) >> 20} MiB per side on {dev} ({base_dir}), 256 KiB blocks, best of {rounds} rounds "
      f"(GB = 1e9 bytes)")
if drop_ok != "1":
    print("page cache not dropped: the tier read with O_DIRECT (--direct-reads), as fio and db_bench")
for side, dbb in from_memory.items():
    print(f"INVALID: {side}'s reads came from the page cache ({dbb:.2f} device bytes per byte "
          f"returned): no read ratio with it is reported")
print("  ".join(h.ljust(wd) for h, wd in zip(header, widths)))
for r in rows:
    print("  ".join(c.ljust(wd) for c, wd in zip(r, widths)))
print("write: fio 1 MiB seq direct qd16 | tier fill, 1 thread, incl. flush | kvdepotd: puts through the daemon into a DRAM tier of 1/8 the bytes, GB/s of the bytes demoted to NVMe until flushed (daemon exit) | db_bench fillrandom,flush")
print(f"read:  fio 256 KiB randread direct qd16 | tier Read x{threads} threads"
      f"{'' if drop_ok == '1' else ' (O_DIRECT)'} | db_bench readrandom x{threads} threads, direct reads")
print("p50/p99: fio per I/O (clat), tier per call, db_bench per op; dev bytes/byte: device "
      "bytes moved per block byte (read: <1 means page-cache hits, >1 extra reads such as "
      "compaction); dev GB/s: device bytes / run time (best round; whole device)")
if ratios_by_round:
    print("round by round (same round): " + "; ".join(
        f"{k.replace('_over_', '/').replace('_', ' ', 1)} " + " ".join(f"{v:.2f}" for v in vs)
        for k, vs in ratios_by_round.items()))
for t in targets:
    state = "-" if t["met"] is None else ("met" if t["met"] else "NOT met")
    if t.get("invalid"):
        state = "INVALID: " + t["invalid"]
    print(f"issue 3 target: {t['target']} >= {t['goal']}: {fmt(t['ratio'], '.2f')} ({state})")
for s in sizes:
    if s["round"] == 1:
        kinds = ", ".join(f"{k}: {v['files']} files {v['bytes'] / 1e9:.2f} GB (largest {v['largest'] / 1e6:.0f} MB)"
                          for k, v in sorted(s["by_kind"].items(), key=lambda kv: -kv[1]["bytes"])[:3])
        print(f"on disk after fill, {s['side']}: {s['disk_bytes'] / 1e9:.2f} GB ({kinds})")
print(f"JSON: {out_path}")
sys.exit(3 if from_memory else 0)
EOF
if [[ $REPORT_RC -eq 3 ]]; then
  log "INVALID: a read side was served from the page cache (see above)"
  FAILED=1
elif [[ $REPORT_RC -ne 0 ]]; then
  log "the report failed (exit $REPORT_RC)"
  FAILED=1
fi

if [[ $FAILED -ne 0 ]]; then
  log "some runs failed; see the messages above"
  exit 1
fi
